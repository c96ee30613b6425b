"""Ctrl-C at any moment of ``hpoflow run``: start-up (imports, the forkserver's torch preload, the oracle
service's start), trials running, the end. A terminal sends SIGINT to the whole foreground process
group; each test does the same at one moment and wants the run ended within 5 s with exit 130, no
traceback, no restart of anything, and no process of the run left (found by an environment variable
each of them inherits, so a worker that left the group with ``setsid`` is found too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from tests.conftest import ROOT, RUN_ENV, TINY

pytestmark = pytest.mark.slow  # each test starts a study and stops it (a few seconds)

N_TRIALS = 4
STOP_S = 5.0  # Ctrl-C to exit
GONE_S = 2.0  # the run's exit to its last process gone (the forkserver and resource tracker see EOF)
MARK = "HPOFLOW_TEST_INTERRUPT"  # inherited by every process of the run


def _spec() -> dict[str, Any]:
    data = yaml.safe_load(yaml.safe_dump(TINY))
    data["search"].update(n_trials=N_TRIALS, max_concurrent=2)
    data["training"]["epochs"] = 3
    return data


def _marked(mark: str) -> list[str]:
    """The live processes that carry ``mark`` in their environment (pid and command line)."""
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK) == mark and p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except psutil.Error:
            continue
    return out


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _forkserver(pid: int) -> bool:
    """The run's forkserver has started (its torch preload begins)."""
    for c in _children(pid):
        try:
            if "forkserver" in " ".join(c.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def _oracle(pid: int) -> bool:
    """A process forked from the forkserver is in the driver's process group: the oracle service (a
    worker leaves the group at once with ``setsid``)."""
    for c in _children(pid):
        try:
            if c.ppid() != pid and os.getpgid(c.pid) == pid:
                return True
        except (psutil.Error, OSError):
            continue
    return False


def _mapped(pid: int, library: str) -> bool:
    """The driver has loaded ``library`` (an extension module: how far its imports have come)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _results(run_dir: Path) -> int:
    return len(list(run_dir.glob("trials/*/result.json")))


Ready = Callable[[int, Path], bool]
SPEC_LOAD: Ready = lambda pid, rd: _mapped(pid, "_pydantic_core")  # the spec is being read  # noqa: E731
API_IMPORTS: Ready = lambda pid, rd: _mapped(pid, "_multiarray_umath")  # optuna imports numpy  # noqa: E731
FORKSERVER: Ready = lambda pid, rd: _forkserver(pid)  # noqa: E731
JOURNAL: Ready = lambda pid, rd: (rd / "study.journal").exists()  # noqa: E731
ORACLE: Ready = lambda pid, rd: _oracle(pid)  # noqa: E731
TRIAL_0: Ready = lambda pid, rd: (rd / "trials" / "0" / "rank0.log").exists()  # noqa: E731
TRIAL_1: Ready = lambda pid, rd: (rd / "trials" / "1" / "rank0.log").exists()  # noqa: E731
TRIAL_2: Ready = lambda pid, rd: (rd / "trials" / "2" / "rank0.log").exists()  # noqa: E731
TRIAL_3: Ready = lambda pid, rd: (rd / "trials" / "3" / "rank0.log").exists()  # noqa: E731
ONE_DONE: Ready = lambda pid, rd: _results(rd) >= 1  # noqa: E731
TWO_DONE: Ready = lambda pid, rd: _results(rd) >= 2  # noqa: E731
THREE_DONE: Ready = lambda pid, rd: _results(rd) >= 3  # noqa: E731
# the last trial's result: the driver stops
ALL_DONE: Ready = lambda pid, rd: _results(rd) >= N_TRIALS  # noqa: E731

# (name, what to wait for, then how long to wait more, whether to freeze the driver for the signal):
# 20 moments, from the spec's loading to the run's end. The first comes once hpoflow's code runs: a
# Ctrl-C while the interpreter itself starts (site, runpy: some 0.1 s) is Python's, its traceback too.
# The forkserver's preload takes seconds: the api's imports and three more moments fall inside it.
# Moments near the end freeze the driver (SIGSTOP) while the signal is sent, so it surely comes before
# the run ends on its own; the earlier ones need not (the run has seconds to go) and must not: a signal
# sent to a stopped process goes to whichever of its threads runs first when it continues, where a
# terminal's Ctrl-C goes to the main thread, the one that runs the handler (a wait of the main thread
# for the forkserver's preload sees it only once that returns).
MOMENTS: list[tuple[str, Ready, float, bool]] = [
    ("spec-load", SPEC_LOAD, 0.0, False),
    ("spec-load-0.1s", SPEC_LOAD, 0.1, False),
    ("forkserver-start", FORKSERVER, 0.0, False),
    ("api-imports", API_IMPORTS, 0.0, False),
    ("api-imports-0.2s", API_IMPORTS, 0.2, False),
    ("preload-0.5s", FORKSERVER, 0.5, False),
    ("preload-1.0s", FORKSERVER, 1.0, False),
    ("preload-1.6s", FORKSERVER, 1.6, False),
    ("study-opened", JOURNAL, 0.0, False),
    ("study-opened-0.2s", JOURNAL, 0.2, False),
    ("oracle-start", ORACLE, 0.0, False),
    ("oracle-0.1s", ORACLE, 0.1, False),
    ("first-trial", TRIAL_0, 0.0, True),
    ("second-trial", TRIAL_1, 0.0, True),
    ("third-trial", TRIAL_2, 0.0, True),
    ("fourth-trial", TRIAL_3, 0.0, True),
    ("one-done", ONE_DONE, 0.0, True),
    ("two-done", TWO_DONE, 0.0, True),
    ("three-done", THREE_DONE, 0.0, True),
    ("all-done", ALL_DONE, 0.0, True),
]


@pytest.mark.parametrize(("ready", "delay_s", "freeze"), [m[1:] for m in MOMENTS], ids=[m[0] for m in MOMENTS])
def test_ctrl_c_ends_the_run_at_once_with_nothing_left(tmp_path: Path, ready: Ready, delay_s: float,
                                                       freeze: bool) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec()))
    run_dir = tmp_path / "run"
    mark = uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "run", str(spec), "--run-dir", str(run_dir)],
                            env={**RUN_ENV, MARK: mark}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)  # its own group, as a terminal's foreground job
    try:
        t0 = time.monotonic()
        while not ready(proc.pid, run_dir):
            assert proc.poll() is None, f"the run ended before the moment: {proc.communicate()[1].decode()[-2000:]}"
            assert time.monotonic() - t0 < 50, "the moment never came"
            time.sleep(0.01)
        time.sleep(delay_s)
        if freeze:
            os.kill(proc.pid, signal.SIGSTOP)
        assert proc.poll() is None, "the run ended before the moment"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: to the whole group, as a terminal sends it
        sent = time.monotonic()
        if freeze:
            os.kill(proc.pid, signal.SIGCONT)
        try:
            out, err = proc.communicate(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not end within {STOP_S:g} s of Ctrl-C; running: {_marked(mark)}")
        took = time.monotonic() - sent
        text = out.decode() + err.decode()
        assert proc.returncode == 130, f"exit {proc.returncode} after {took:.1f} s:\n{text[-3000:]}"
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
        # a stop restarts nothing
        assert "starting a new one" not in text and "oracle service died" not in text, text[-3000:]
        left = _marked(mark)
        deadline = time.monotonic() + GONE_S
        while left and time.monotonic() < deadline:
            time.sleep(0.05)
            left = _marked(mark)
        assert left == [], f"still running {GONE_S:g} s after the run ended: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for line in _marked(mark):
            os.kill(int(line.split()[0]), signal.SIGKILL)
