"""Wall time and the machine's busy CPU time (``/proc/stat``) around one command: how much of the
machine a run used, whoever in it did the work (the test suite's workers, daemons, trials).

    python bench/busy.py python -m pytest
    python bench/busy.py --processes python -m pytest    # and the CPU of every process that ended

Prints the command's own output, then one JSON line: wall seconds, busy and idle core-seconds, and the
mean number of busy cores. Exits with the command's exit code. Linux only.

``--processes`` turns on the kernel's process accounting (``acct(2)``: root, a kernel with BSD process
accounting) for the command's run and turns it off after, so it also counts what no sampler sees: every
process that ended meanwhile, killed ones included, whoever started it (on a busy machine, other work's
too). It prints the CPU by command name, exec'd programs apart from processes forked without an exec
(``python*``: a forkserver's workers and ranks), and how the CPU of the largest group is spread over
per-process bands (a forkserver's torch preload is one of 2.5-6 CPU-s); the JSON line gets the same as
``processes``. Processes still running at the end (daemons) are not counted. The machine's accounting is
off afterwards, whatever it was before, and there is one per machine: two ``--processes`` runs at once
spoil each other's counts.
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_HZ = os.sysconf("SC_CLK_TCK")
_AHZ = 100  # the unit of acct_v3's CPU times (linux/acct.h)
_AFORK = 0x01  # ac_flag: forked, never exec'd
# struct acct_v3: flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float), then utime,
# stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm
_V3 = struct.Struct("=BBHIIIIIIf8H16s")
BANDS = (0.5, 1.0, 2.5, 6.0)  # CPU-s per process: the edges of the bands ``--processes`` prints


@dataclass(frozen=True)
class Ended:
    """One process as the kernel's accounting recorded it when it ended."""

    command: str  # its name (the first 15 bytes)
    forked: bool  # forked and never exec'd
    cpu_s: float  # user + system


def comp_t(value: int) -> int:
    """A ``comp_t`` (13-bit mantissa, 3-bit base-8 exponent) as an integer."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 0x7))


def read_accounting(data: bytes) -> Iterator[Ended]:
    """The records of an ``acct_v3`` file (what Linux writes); others are skipped."""
    for off in range(0, len(data) - _V3.size + 1, _V3.size):
        flag, version, *_, utime, stime, _mem, _io, _rw, _minflt, _majflt, _swaps, comm = _V3.unpack_from(data, off)
        if version & 0x7F != 3:
            continue
        yield Ended(comm.split(b"\0", 1)[0].decode(errors="replace"), bool(flag & _AFORK),
                    (comp_t(utime) + comp_t(stime)) / _AHZ)


def _acct(path: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(path.encode() if path else None) != 0:
        err = ctypes.get_errno()
        why = {errno.EPERM: "it needs root (CAP_SYS_PACCT)",
               errno.ENOSYS: "this kernel has no BSD process accounting"}.get(err, os.strerror(err))
        raise OSError(err, f"cannot turn process accounting {'on' if path else 'off'}: {why}")


def summarize(ended: list[Ended], top: int = 12) -> dict[str, Any]:
    """The CPU by command name (exec'd apart from forked), and the largest group's per-process bands."""
    groups: dict[str, list[float]] = defaultdict(list)  # by name, "name*" for the forked-only
    for e in ended:
        groups[e.command + ("*" if e.forked else "")].append(e.cpu_s)
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    by_command = [{"command": name, "processes": len(cpu), "cpu_s": round(sum(cpu), 1)} for name, cpu in ranked[:top]]
    bands: list[dict[str, Any]] = []
    if ranked:
        name, cpu = ranked[0]
        for lo, hi in itertools.pairwise((0.0, *BANDS, float("inf"))):
            inside = [c for c in cpu if lo <= c < hi]
            bands.append({"command": name, "band_s": [lo, hi if hi != float("inf") else None],
                          "processes": len(inside), "cpu_s": round(sum(inside), 1)})
    return {"processes": len(ended), "cpu_s": round(sum(e.cpu_s for e in ended), 1), "by_command": by_command,
            "largest_by_band": bands}


def _print_table(summary: dict[str, Any]) -> None:
    print(f"processes that ended: {summary['processes']}, {summary['cpu_s']} CPU-s "
          "(name* = forked, never exec'd)")
    for row in summary["by_command"]:
        print(f"  {row['cpu_s']:9.1f} CPU-s  {row['processes']:6d}  {row['command']}")
    for row in summary["largest_by_band"]:
        lo, hi = row["band_s"]
        print(f"  {row['command']} of {lo:g}-{'' if hi is None else f'{hi:g}'} CPU-s each: "
              f"{row['processes']} processes, {row['cpu_s']} CPU-s")


def _cpu() -> tuple[float, float]:
    """Busy and idle core-seconds since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / _HZ, (idle + iowait) / _HZ


def main(argv: list[str]) -> int:
    processes = bool(argv) and argv[0] == "--processes"
    if processes:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    log = None
    if processes:
        fd, log = tempfile.mkstemp(prefix="hpoflow-busy-", suffix=".acct")
        os.close(fd)
        try:
            _acct(log)
        except OSError as exc:
            os.unlink(log)
            print(f"busy.py: {exc.strerror}. Fix: run it as root, or leave out --processes", file=sys.stderr)
            return 2
    try:
        busy0, idle0 = _cpu()
        t0 = time.monotonic()
        code = subprocess.call(argv)
        wall = time.monotonic() - t0
        busy1, idle1 = _cpu()
    finally:
        if log is not None:
            _acct(None)
    busy = busy1 - busy0
    figures: dict[str, Any] = {"command": argv, "exit": code, "wall_s": round(wall, 1), "busy_core_s": round(busy, 1),
                               "idle_core_s": round(idle1 - idle0, 1), "mean_busy_cores": round(busy / wall, 2)}
    if log is not None:
        with open(log, "rb") as f:
            data = f.read()
        os.unlink(log)
        figures["processes"] = summarize(list(read_accounting(data)))
        _print_table(figures["processes"])
    print(json.dumps(figures))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
