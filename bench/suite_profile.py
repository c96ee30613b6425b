"""Where the test suite's time goes: per test, its wall time and the CPU the whole machine spent meanwhile,
and per kind of process (drivers, forkservers, ranks, SLURM daemons...), the CPU each kind used.

    python bench/suite_profile.py [--out DIR] [PYTEST ARGS...]     # default: the whole suite, serially

It runs ``python -m pytest -n0 -p suite_profile PYTEST ARGS`` (this file is also that pytest plugin). Serially
(``-n0``, the default), and on a machine with nothing else to do, the CPU a test is charged is what every
process spent while it ran: the test's own, its drivers', trials' and daemons'. A test whose wall time is far
above its CPU waits: on a process, on SLURM, on a timeout or a sleep. A sampling thread reads every process's
CPU time in ``/proc`` every 0.2 s and sums it by kind (a process shorter than that may be missed: they cost
little). Writes ``DIR/tests.jsonl`` (one line per test) and ``DIR/summary.json``, prints the largest items,
and ends with one JSON line: wall, CPU, the share of each tier and kind.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
_OUT_ENV = "HPOFLOW_SUITE_PROFILE_DIR"
_HZ = os.sysconf("SC_CLK_TCK")

# command line -> kind (first match)
KINDS = [
    ("forkserver (torch preload)", re.compile(r"multiprocessing\.forkserver")),
    ("multiprocessing spawn (light workers, helpers)", re.compile(r"multiprocessing\.spawn|spawn_main")),
    ("cluster rank", re.compile(r"hpoflow\.engines\.cluster\.node (rank|step)")),
    ("cluster node launcher / attempt", re.compile(r"hpoflow\.engines\.cluster\.(node|attempt)")),
    ("hpoflow CLI (driver, validate, status...)", re.compile(r"-m hpoflow\b|/bin/hpoflow\b")),
    ("pytest (tests in process)", re.compile(r"pytest")),
    ("bench script", re.compile(r"/bench/\w+\.py")),
    ("SLURM daemons and steps", re.compile(r"slurm(ctld|d|stepd|scriptd)|munged|\bsrun\b|\bsbatch\b")),
    ("PostgreSQL", re.compile(r"postgres|initdb")),
    ("other python", re.compile(r"python")),
]


def _kind(cmdline: str) -> str:
    for name, pattern in KINDS:
        if pattern.search(cmdline):
            return name
    return "other"


def _busy() -> float:
    """Core-seconds the machine has spent busy since boot (``/proc/stat``)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:8]
    user, nice, system, _idle, _iowait, irq, softirq = map(int, fields)
    return (user + nice + system + irq + softirq) / _HZ


class _Sampler(threading.Thread):
    """Every process's CPU time (utime + stime) and kind, read from /proc every ``period`` s."""

    def __init__(self, period: float = 0.2) -> None:
        super().__init__(name="suite-profile-sampler", daemon=True)
        self.period = period
        self.cpu: dict[tuple[int, float], tuple[str, float]] = {}  # (pid, start) -> (kind, cpu s)
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            self.sample()

    def sample(self) -> None:
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as f:
                    stat = f.read().rpartition(b")")[2].split()
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            cpu = (int(stat[11]) + int(stat[12])) / _HZ  # utime, stime (fields 14, 15)
            key = (int(entry.name), float(stat[19]))  # pid and start time: a reused pid is another process
            old = self.cpu.get(key)
            kind = old[0] if old and old[0] != "other" else _kind(cmdline)
            self.cpu[key] = (kind, max(cpu, old[1] if old else 0.0))

    def by_kind(self) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for kind, cpu in self.cpu.values():
            out[kind] += cpu
        return dict(out)


# -- the pytest plugin ------------------------------------------------------------------------------
_SAMPLER: _Sampler | None = None
_BASE: dict[tuple[int, float], tuple[str, float]] = {}


def pytest_configure(config: Any) -> None:
    global _SAMPLER, _BASE
    if os.environ.get(_OUT_ENV) and not hasattr(config, "workerinput"):
        _SAMPLER = _Sampler()
        _SAMPLER.sample()
        _BASE = dict(_SAMPLER.cpu)  # what ran before the session is not the suite's
        _SAMPLER.start()


_STARTS: dict[str, tuple[float, float]] = {}


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _STARTS[nodeid] = (time.monotonic(), _busy())


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    out = os.environ.get(_OUT_ENV)
    if not out:
        return
    now, busy = time.monotonic(), _busy()
    start = _STARTS.pop(nodeid, None)
    if start is None:
        return
    with open(Path(out) / "tests.jsonl", "a") as f:
        f.write(json.dumps({"test": nodeid, "wall_s": round(now - start[0], 3),
                            "cpu_s": round(busy - start[1], 2)}) + "\n")


def pytest_unconfigure(config: Any) -> None:
    out = os.environ.get(_OUT_ENV)
    if _SAMPLER is None or not out:
        return
    _SAMPLER.stop.set()
    _SAMPLER.sample()
    kinds: dict[str, float] = defaultdict(float)
    for key, (kind, cpu) in _SAMPLER.cpu.items():
        kinds[kind] += cpu - (_BASE[key][1] if key in _BASE else 0.0)
    (Path(out) / "kinds.json").write_text(json.dumps(dict(kinds), indent=1, sort_keys=True))


# -- the script -------------------------------------------------------------------------------------
def _slow_tests(args: list[str]) -> set[str]:
    p = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n0", "-p", "no:cacheprovider",
                        "-m", "slow", *args], capture_output=True, text=True, cwd=ROOT)
    return {line.strip() for line in p.stdout.splitlines() if "::" in line}


def summarize(out: Path, slow: set[str], wall: float, cpu: float) -> dict[str, Any]:
    rows = [json.loads(line) for line in (out / "tests.jsonl").read_text().splitlines() if line.strip()]
    kinds = json.loads((out / "kinds.json").read_text()) if (out / "kinds.json").exists() else {}
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
    for r in rows:
        f = by_file[r["test"].split("::")[0]]
        f[0] += 1
        f[1] += r["wall_s"]
        f[2] += r["cpu_s"]
    tiers = {"slow": [0.0, 0.0], "fast": [0.0, 0.0]}
    for r in rows:
        t = tiers["slow" if r["test"] in slow else "fast"]
        t[0] += r["wall_s"]
        t[1] += r["cpu_s"]

    def show(title: str, items: list[tuple[str, float, float]]) -> None:
        print(f"\n{title}\n{'wall s':>9} {'cpu s':>9}  test")
        for name, w, c in items:
            print(f"{w:9.1f} {c:9.1f}  {name}")

    show("files by CPU", [(f, v[1], v[2]) for f, v in sorted(by_file.items(), key=lambda kv: -kv[1][2])[:25]])
    show("tests by wall time", [(r["test"], r["wall_s"], r["cpu_s"])
                                for r in sorted(rows, key=lambda r: -r["wall_s"])[:25]])
    show("tests that wait most (wall - CPU)", [(r["test"], r["wall_s"], r["cpu_s"])
                                               for r in sorted(rows, key=lambda r: r["cpu_s"] - r["wall_s"])[:25]])
    print("\nCPU by kind of process (core-seconds)")
    for kind, c in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"{c:9.1f}  {kind}")
    summary = {"tests": len(rows), "wall_s": round(wall, 1), "cpu_core_s": round(cpu, 1),
               "tests_wall_s": round(sum(r["wall_s"] for r in rows), 1),
               "tests_cpu_core_s": round(sum(r["cpu_s"] for r in rows), 1),
               "tiers": {k: {"wall_s": round(v[0], 1), "cpu_core_s": round(v[1], 1)} for k, v in tiers.items()},
               "cpu_by_kind": {k: round(v, 1) for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="suite-profile", help="directory for tests.jsonl, kinds.json, summary.json")
    args, pytest_args = ap.parse_known_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in ("tests.jsonl", "kinds.json", "summary.json"):
        (out / name).unlink(missing_ok=True)
    slow = _slow_tests(pytest_args)
    env = {**os.environ, _OUT_ENV: str(out),
           "PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)}
    t0, b0 = time.monotonic(), _busy()
    code = subprocess.run([sys.executable, "-m", "pytest", "-n0", "-p", "no:cacheprovider", "-p", "suite_profile",
                           *pytest_args], cwd=ROOT, env=env).returncode
    wall, cpu = time.monotonic() - t0, _busy() - b0
    summary = summarize(out, slow, wall, cpu)
    summary["pytest_exit"] = code
    print(json.dumps(summary, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
