"""What a local worker's housekeeping costs per trial: finding and killing what a trial left running,
and moving a chatty rank's output through the capped log pipe.

- reap: the end-of-trial sweep of the worker's process tree, with nothing to kill (the usual case),
  by ``hpoflow.engines.proc.reap_descendants`` (the kernel's children lists of this process's
  threads) against psutil's ``Process().children(recursive=True)`` (the stat file of every process on
  the machine), in a process with torch's threads started, as a warm worker has.
- log: a child process printing ``--lines`` lines of 100 bytes with ``print``, its stdout a file (as
  rank logs were written before) or a pipe into ``LogPump`` (as now), with the default cap and a cap
  far below the output (trimming all the way).

    python bench/worker_overheads.py [--calls 2000] [--lines 2000000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import emit, median

PRINTER = "import sys\nline = 'x' * 88\nfor i in range(int(sys.argv[1])):\n    print(f'{i:010d}', line)\n"


def reap_us(calls: int) -> tuple[float, float]:
    import psutil
    import torch

    from hpoflow.engines.proc import reap_descendants

    torch.set_num_threads(2)
    torch.ones(1000).sum()  # start torch's thread pool, as a trial does

    def scan() -> None:
        kids = psutil.Process().children(recursive=True)
        for k in kids:
            k.kill()
        psutil.wait_procs(kids, timeout=2)

    out = []
    for f in (scan, reap_descendants):
        for _ in range(20):
            f()
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        out.append((time.perf_counter() - t0) / calls * 1e6)
    return out[0], out[1]


def log_s(lines: int, cap: int | None, directory: Path) -> float:
    """Seconds until a printer's output is in its log (``cap`` None: straight into a file)."""
    from hpoflow.engines.logcap import LogPump

    path = directory / "rank0.log"
    path.unlink(missing_ok=True)
    argv = [sys.executable, "-c", PRINTER, str(lines)]
    t0 = time.perf_counter()
    if cap is None:
        with open(path, "ab") as f:
            subprocess.run(argv, stdout=f, check=True)
        return time.perf_counter() - t0
    pump = LogPump(cap)
    w, stream = pump.open(str(path))
    try:
        subprocess.run(argv, stdout=w, check=True)
    finally:
        os.close(w)
    pump.wait([stream], 600)
    elapsed = time.perf_counter() - t0
    pump.close()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--lines", type=int, default=2_000_000)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    scan, proc = reap_us(a.calls)
    n_procs = len([p for p in os.listdir("/proc") if p.isdigit()])
    print(f"end-of-trial sweep with {n_procs} processes on the machine: psutil scan {scan:.0f} us, "
          f"/proc children lists {proc:.0f} us", flush=True)
    from hpoflow.engines.logcap import DEFAULT_CAP_MB

    runs: dict[str, list[float]] = {"file": [], "pump": [], "pump_trimming": []}
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.repeats):  # interleaved, so load changes hit every variant alike
            runs["file"].append(log_s(a.lines, None, Path(d)))
            runs["pump"].append(log_s(a.lines, DEFAULT_CAP_MB << 20, Path(d)))
            runs["pump_trimming"].append(log_s(a.lines, 1 << 20, Path(d)))
    mib = a.lines * 100 / (1 << 20)
    figures = {k: round(median(v), 3) for k, v in runs.items()}
    print(f"{mib:.0f} MiB printed: into a file {figures['file']} s, through the pump {figures['pump']} s "
          f"(cap {DEFAULT_CAP_MB} MiB), trimming to 1 MiB {figures['pump_trimming']} s", flush=True)
    emit({"reap_psutil_us": round(scan, 1), "reap_proc_children_us": round(proc, 1), "processes": n_procs,
          "log_mib": round(mib, 1), "log_file_s": figures["file"], "log_pump_s": figures["pump"],
          "log_pump_trimming_s": figures["pump_trimming"],
          "log_pump_overhead": round(figures["pump"] / figures["file"] - 1, 3)})


if __name__ == "__main__":
    main()
