"""The CPU each test of the suite costs, whatever else the machine runs, under pytest-xdist as the README's
command runs it.

    python bench/suite_cpu.py [--out DIR] [PYTEST ARGS...]     # default: the whole suite, -n auto

Each pytest process that runs tests (every xdist worker, or the one process of ``-n0``) moves itself into a
cgroup of its own (cgroup v1 ``cpuacct``, else a cgroup v2 child of its own group) before its first test.
Everything it starts stays in that group: drivers, forkservers, workers, ranks, the SLURM daemons and job
steps of a session cluster (``ProctrackType=proctrack/linuxproc``: slurmd keeps its steps in its own
group), PostgreSQL. The group's CPU counter read before and after each test (setup and teardown included)
is that test's CPU, not the machine's: other work beside the suite (two CPU-bound processes, a helper's
tests) is not charged to it, and neither are the other workers' tests. A session fixture's start is
charged to the first test that uses it, and what a worker's daemons spend idle to the test that runs
meanwhile. Needs root (or a writable cgroup); where none is, the run fails at once with the reason.

Writes ``DIR/tests-<worker>.jsonl`` (one line per test: nodeid, cpu, wall, and own: the CPU of the pytest
process itself, its threads included, without the processes it starts), prints the 25 costliest files and
tests and the 25 whose pytest process spent the most itself, and ends with one JSON line: tests, total CPU,
own CPU, wall, the pytest exit code.
(``bench/suite_profile.py`` samples instead which kinds of process the CPU went to, serially.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
_OUT_ENV = "HPOFLOW_SUITE_CPU_DIR"
_TAG_ENV = "HPOFLOW_SUITE_CPU_TAG"
_V1 = Path("/sys/fs/cgroup/cpuacct")


class _Group:
    """This process's own cgroup and its CPU counter, in seconds."""

    def __init__(self, name: str) -> None:
        if (_V1 / "cpuacct.usage").is_file():
            self.path, self._v2 = _V1 / "hpoflow-suite-cpu" / name, False
        else:
            line = next(ln for ln in Path("/proc/self/cgroup").read_text().splitlines() if ln.startswith("0::"))
            self.path, self._v2 = Path("/sys/fs/cgroup", line[3:].lstrip("/"), f"hpoflow-suite-cpu-{name}"), True
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def cpu_s(self) -> float:
        if self._v2:
            stat = dict(ln.split() for ln in (self.path / "cpu.stat").read_text().splitlines())
            return int(stat["usage_usec"]) / 1e6
        return int((self.path / "cpuacct.usage").read_text()) / 1e9


# -- the pytest plugin (``-p suite_cpu``) ------------------------------------------------------------------
_state: dict[str, Any] = {}


def pytest_configure(config: pytest.Config) -> None:
    out = os.environ.get(_OUT_ENV)
    if not out or (config.pluginmanager.hasplugin("xdist") and config.getoption("numprocesses", None)
                   and not hasattr(config, "workerinput")):
        return  # the xdist controller runs no test
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    try:
        group = _Group(f"{os.environ.get(_TAG_ENV, 'run')}-{worker}")
    except (OSError, StopIteration) as exc:
        raise pytest.UsageError(f"suite_cpu: cannot make a cgroup of this process's own ({exc}); it needs "
                                "root or a writable cgroup") from None
    _state.update(group=group, file=Path(out) / f"tests-{worker}.jsonl")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    group: _Group | None = _state.get("group")
    if group is None:
        yield
        return
    c0, own0, t0 = group.cpu_s(), time.process_time(), time.monotonic()
    yield
    line = {"test": item.nodeid, "cpu": round(group.cpu_s() - c0, 3), "wall": round(time.monotonic() - t0, 3),
            "own": round(time.process_time() - own0, 3)}
    with open(_state["file"], "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


# -- the runner ----------------------------------------------------------------------------------------------
def summarize(out: Path, top: int = 25) -> dict[str, Any]:
    rows = [json.loads(line) for f in sorted(out.glob("tests-*.jsonl")) for line in f.read_text().splitlines()]
    by_file: dict[str, float] = defaultdict(float)
    for r in rows:
        by_file[r["test"].split("::")[0]] += r["cpu"]
    print(f"{'CPU s':>8}  file (the {top} costliest of {len(by_file)})")
    for name, cpu in sorted(by_file.items(), key=lambda kv: -kv[1])[:top]:
        print(f"{cpu:8.1f}  {name}")
    print(f"{'CPU s':>8} {'wall s':>7}  test (the {top} costliest of {len(rows)})")
    for r in sorted(rows, key=lambda r: -r["cpu"])[:top]:
        print(f"{r['cpu']:8.1f} {r['wall']:7.1f}  {r['test']}")
    print(f"{'own s':>8} {'CPU s':>7}  test (the {top} whose pytest process spent the most itself)")
    for r in sorted(rows, key=lambda r: -r["own"])[:top]:
        print(f"{r['own']:8.1f} {r['cpu']:7.1f}  {r['test']}")
    return {"tests": len(rows), "cpu_s": round(sum(r["cpu"] for r in rows), 1),
            "own_cpu_s": round(sum(r["own"] for r in rows), 1),
            "costliest_file": max(by_file, key=by_file.__getitem__) if by_file else None}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="suite-cpu", help="directory for tests-<worker>.jsonl")
    args, pytest_args = ap.parse_known_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for f in out.glob("tests-*.jsonl"):
        f.unlink()
    env = {**os.environ, _OUT_ENV: str(out), _TAG_ENV: str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH", "")) if p)}
    t0 = time.monotonic()
    code = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "suite_cpu",
                           *pytest_args], cwd=ROOT, env=env).returncode
    for group in (_V1 / "hpoflow-suite-cpu").glob(f"{os.getpid()}-*"):  # emptied as its processes ended
        if not (group / "cgroup.procs").read_text().strip():
            group.rmdir()
    summary = {**summarize(out), "wall_s": round(time.monotonic() - t0, 1), "pytest_exit": code}
    print(json.dumps(summary, sort_keys=True))
    return 0 if code in (0, 1) else code


if __name__ == "__main__":
    sys.exit(main())
