"""Ctrl-C at any moment of ``hpoflow validate`` and ``hpoflow status``: exit 130 with the one line
``hpoflow: interrupted`` and no traceback, as ``hpoflow run`` (tests/test_interrupt.py).

A terminal sends SIGINT to the whole foreground process group: each test starts the command in a session
of its own, waits for a moment of it (an extension module it loads: how far its imports have come),
freezes it there (SIGSTOP), sends SIGINT to the group and lets it go on (SIGCONT), so the signal lands at
that moment however loaded the machine is. Before SIGINT ended these commands at once (``QUIT_AT_ONCE`` in
hpoflow/cli/main.py), a KeyboardInterrupt at the loading of pydantic-core became a ``PanicException``
traceback (exit 1, every time), at zoneinfo's CPython ended the process by SIGINT (exit -2, one time in
three), and at ssl's a ``TypeError`` traceback now and then."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT, RUN_ENV, TINY

STOP_S = 5.0  # Ctrl-C to exit


def _mapped(pid: int, library: str) -> bool:
    """The process has loaded ``library`` (an extension module: how far its imports have come)."""
    try:
        return library in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def _ctrl_c_at(argv: list[str], library: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``hpoflow ARGV`` given Ctrl-C once it has loaded ``library``: its exit code and output."""
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", *argv], env=RUN_ENV, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        t0 = time.monotonic()
        while not _mapped(proc.pid, library):
            assert proc.poll() is None, f"it ended before loading {library}: {proc.communicate()[1][-2000:]}"
            assert time.monotonic() - t0 < 60, f"it never loaded {library}"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGSTOP)
        assert proc.poll() is None, "it ended before the moment"
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: to the whole group, as a terminal sends it
        os.kill(proc.pid, signal.SIGCONT)
        try:
            out, err = proc.communicate(timeout=STOP_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"it did not end within {STOP_S:g} s of Ctrl-C")
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def _check_interrupted(r: subprocess.CompletedProcess[str]) -> None:
    assert r.returncode == 130, f"exit {r.returncode}:\n{r.stderr[-3000:]}"
    assert r.stderr == "hpoflow: interrupted\n", r.stderr[-3000:]
    assert "Traceback" not in r.stdout


# (moment, library), from the spec's loading on (as for run: before it, the interpreter and hpoflow's own first
# imports, some 0.1 s, a Ctrl-C is Python's): the spec's loading (pydantic-core, the YAML C loader, zoneinfo),
# Optuna's imports (NumPy, SQLite for its RDB storage, ssl, multiprocessing). Not the sampler's build (NumPy's
# random generators, mtrand): it is validate's last step, so on a loaded machine the command can be past its
# last Python instruction before the poll above sees the library and freezes it (it then exits 0, done).
VALIDATE_MOMENTS = [("pydantic-core", "_pydantic_core"), ("yaml", "_yaml"), ("zoneinfo", "_zoneinfo"),
                    ("numpy", "_multiarray_umath"), ("sqlite", "_sqlite3"), ("ssl", "_ssl"),
                    ("multiprocessing", "_multiprocessing")]


@pytest.mark.parametrize("library", [m[1] for m in VALIDATE_MOMENTS], ids=[m[0] for m in VALIDATE_MOMENTS])
def test_ctrl_c_ends_validate_with_one_line(tmp_path: Path, library: str) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(TINY))
    _check_interrupted(_ctrl_c_at(["validate", str(spec)], library, tmp_path))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as ``hpoflow run`` leaves one (spec.yaml, run.json, the journal with a finished trial
    and a running one), written with Optuna directly: no study is run."""
    import optuna

    from hpoflow.run.storage import open_storage

    rd = tmp_path_factory.mktemp("run")
    (rd / "spec.yaml").write_text(yaml.safe_dump(TINY))
    (rd / "run.json").write_text(json.dumps({"study_name": TINY["study"]["name"]}))
    study = optuna.create_study(storage=open_storage(None, rd), study_name=TINY["study"]["name"], direction="maximize")
    study.enqueue_trial({"lr": 0.01, "hidden": 32})
    study.optimize(lambda t: t.suggest_float("lr", 0.003, 0.03, log=True), n_trials=1)
    study.ask()
    return rd


# (moment, library): the run directory's reading, Optuna's imports, the study's replay (pydantic-core)
STATUS_MOMENTS = [("datetime", "_datetime"), ("numpy", "_multiarray_umath"), ("ssl", "_ssl"),
                  ("pydantic-core", "_pydantic_core")]


@pytest.mark.parametrize("library", [m[1] for m in STATUS_MOMENTS], ids=[m[0] for m in STATUS_MOMENTS])
def test_ctrl_c_ends_status_with_one_line(run_dir: Path, library: str) -> None:
    _check_interrupted(_ctrl_c_at(["status", str(run_dir), "--top", "5"], library, ROOT))


def test_status_and_validate_still_answer_when_left_alone(run_dir: Path, tmp_path: Path) -> None:
    """The handler changes nothing for a command that no signal reaches (the moments above would
    otherwise pass for a command that fails at once)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(TINY))
    for argv in (["validate", str(spec)], ["status", str(run_dir), "--top", "5"]):
        r = subprocess.run([sys.executable, "-m", "hpoflow", *argv], env=RUN_ENV, cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0 and r.stderr == "", (argv, r.stderr[-2000:])
