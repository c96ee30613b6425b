"""Wall time and the machine's busy CPU time (``/proc/stat``) around one command: how much of the
machine a run used, whoever in it did the work (the test suite's workers, daemons, trials).

    python bench/busy.py python -m pytest

Prints the command's own output, then one JSON line: wall seconds, busy and idle core-seconds, and the
mean number of busy cores. Exits with the command's exit code. Linux only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

_HZ = os.sysconf("SC_CLK_TCK")


def _cpu() -> tuple[float, float]:
    """Busy and idle core-seconds since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / _HZ, (idle + iowait) / _HZ


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    busy0, idle0 = _cpu()
    t0 = time.monotonic()
    code = subprocess.call(argv)
    wall = time.monotonic() - t0
    busy1, idle1 = _cpu()
    busy = busy1 - busy0
    print(json.dumps({"command": argv, "exit": code, "wall_s": round(wall, 1), "busy_core_s": round(busy, 1),
                      "idle_core_s": round(idle1 - idle0, 1), "mean_busy_cores": round(busy / wall, 2)}))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
