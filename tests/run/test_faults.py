"""Storage faults a study survives, for real: a PostgreSQL server stopped mid-study (waited out, or a
clean stop and a resume past ``storage_retry_s``) and a disk that fills (a small tmpfs, filled with a
file) at start and mid-study. Each ends in one line, never a traceback, and a resume that completes
the study with exactly ``n_trials``."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from tests.conftest import mounted_tmpfs
from tests.infra.postgres import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}

pytestmark = pytest.mark.slow  # whole studies through the CLI, a database stopped for seconds


def _spec(path: Path, n: int, function: str = "trainfns_light:slow", options: dict[str, Any] | None = None,
          **extra: Any) -> Path:
    data = {"study": {"name": "faults", "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": 2, "seed": 1},
            "training": {"function": function, "options": options or {"sleep": 1.0}},
            "oracle": {"enabled": False}, **extra}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _run(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "hpoflow", *args], cwd=cwd, env=env or ENV, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _hpoflow(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpoflow", *args], cwd=cwd, env=env or ENV, capture_output=True,
                          text=True, timeout=600)


def _wait(what: str, cond: Callable[[], bool], timeout: float = 300) -> None:
    """Until ``cond()``; generous: a loaded 2-core machine may take long, and nothing here is timed."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _finished(rd: Path) -> int:
    """Trials whose result.json the driver wrote."""
    return len(list((rd / "trials").glob("*/result.json")))


def _complete(study: optuna.Study) -> int:
    return sum(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False))


# -- a database outage ------------------------------------------------------------------------------
@pytest.fixture
def database(postgres_server: PostgresServer, tmp_path: Path) -> Iterator[str]:
    """A fresh database on the session's server (the server is running again afterwards)."""
    name = f"faults_{abs(hash(tmp_path.name)) % 10**8}"
    url = postgres_server.create_database(name)
    try:
        yield url
    finally:
        postgres_server.start()  # a test that failed mid-outage leaves it stopped


def _pg_env(url: str) -> dict[str, str]:
    return {**ENV, "HPO_TEST_PG": url}


def _pg_study(url: str) -> optuna.Study:
    return optuna.load_study(study_name="faults", storage=optuna.storages.RDBStorage(url))


def test_a_database_outage_shorter_than_storage_retry_s_is_waited_out(postgres_server: PostgresServer,
                                                                      database: str, tmp_path: Path) -> None:
    _spec(tmp_path / "spec.yaml", 8, storage_env="HPO_TEST_PG")
    proc = _run(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--quiet", env=_pg_env(database))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stderr.readline, "")))  # type: ignore[union-attr]
    reader.start()
    try:
        _wait("two finished trials", lambda: _finished(tmp_path / "run") >= 2)
        postgres_server.stop()
        # the outage lasts until the driver has met it, and 2 s more (trials keep running meanwhile)
        _wait("the driver to meet the outage", lambda: any("storage unreachable" in line for line in lines))
        time.sleep(2.0)
        postgres_server.start()
        out = proc.stdout.read() if proc.stdout else ""  # to its end: the driver has exited
        proc.wait(timeout=600)
        reader.join(timeout=60)
        err = "".join(lines)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == 0, err
    assert "storage unreachable, retrying for up to 60 s: " in err and "storage reachable again after" in err
    assert "Traceback" not in err and postgres_server.password not in err + out
    study = _pg_study(database)
    assert _complete(study) == 8
    assert not [t for t in study.trials if t.state == TrialState.RUNNING]


def test_an_outage_longer_than_storage_retry_s_stops_cleanly_and_the_resume_completes(
        postgres_server: PostgresServer, database: str, tmp_path: Path) -> None:
    _spec(tmp_path / "spec.yaml", 8, storage_env="HPO_TEST_PG", storage_retry_s=3)
    proc = _run(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--quiet", env=_pg_env(database))
    try:
        _wait("two finished trials", lambda: _finished(tmp_path / "run") >= 2)
        postgres_server.stop()
        out, err = proc.communicate(timeout=600)  # it gives up after ~3 s (and Optuna's own retries)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        postgres_server.start()
    assert proc.returncode == 1, err
    lines = err.strip().splitlines()
    assert lines[0].startswith("hpoflow: storage unreachable, retrying for up to 3 s: ")
    assert lines[-1].startswith("hpoflow: stopped: the study's storage postgresql+psycopg2://hpoflow:***@127.0.0.1:")
    assert "did not answer for" in lines[-1] and "rerun the same command to resume" in lines[-1]
    assert len(lines) == 2 and "Traceback" not in err and postgres_server.password not in err + out, err
    done = _complete(_pg_study(database))
    assert 1 <= done < 8  # (the second may have ended as the server stopped: it is rerun)
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--json", env=_pg_env(database))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_complete"] == 8
    study = _pg_study(database)
    assert _complete(study) == 8 and not [t for t in study.trials if t.state == TrialState.RUNNING]
    status = _hpoflow(tmp_path, "status", "run", "--json", "--storage-env", "HPO_TEST_PG", env=_pg_env(database))
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["n_complete"] == 8 and postgres_server.password not in status.stdout


# -- a full disk ------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs (a file system that can fill), unmounted afterwards whatever happened; skips where
    mounting is refused (not root, no CAP_SYS_ADMIN)."""
    with mounted_tmpfs(tmp_path / "disk", "size=4m,mode=0755") as mnt:
        yield mnt


def _fill(path: Path) -> None:
    """Write ``path`` until its file system is full."""
    with open(path, "ab") as f:
        with contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()


def _journal_study(rd: Path) -> optuna.Study:
    return optuna.load_study(study_name="faults",
                             storage=JournalStorage(JournalFileBackend(str(rd / "study.journal"))))


def test_a_full_disk_at_start_is_one_line_and_exit_2(small_disk: Path, tmp_path: Path) -> None:
    _spec(tmp_path / "spec.yaml", 2)
    _fill(small_disk / "filler")
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", str(small_disk / "run"))
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"hpoflow: error: cannot write to run directory {small_disk / 'run'}: the disk is full. " \
                       "Fix: free space or choose another --run-dir\n"


def test_a_disk_that_fills_mid_study_stops_it_cleanly_and_the_resume_completes(small_disk: Path,
                                                                              tmp_path: Path) -> None:
    _spec(tmp_path / "spec.yaml", 8)
    rd = small_disk / "run"
    proc = _run(tmp_path, "run", "spec.yaml", "--run-dir", str(rd), "--quiet")
    try:
        _wait("two finished trials", lambda: _finished(rd) >= 2)
        _fill(small_disk / "filler")
        _, err = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == 1, err
    *notes, last = err.strip().splitlines()
    assert "Traceback" not in err, err
    assert last.startswith("hpoflow: stopped: cannot write ") and "the disk is full" in last, err
    # before it, at most the note of a rank whose log the full disk cut (when a rank wrote first)
    assert all(re.fullmatch(r"hpoflow: rank log \S+: \[Errno 28\] No space left on device; the rest of its "
                            r"output is dropped", line) for line in notes), err
    done = _complete(_journal_study(rd))  # every trial recorded complete is still there, readable
    assert done >= 2
    (small_disk / "filler").unlink()
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", str(rd), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_complete"] == 8 and _complete(_journal_study(rd)) == 8


def test_a_trial_that_fails_because_the_disk_filled_is_rerun_on_resume(small_disk: Path, tmp_path: Path) -> None:
    """The journal lives elsewhere; trial 2 fills the run directory's disk and then prints: its rank log
    write fails (the rest of its output is dropped and the trial runs on), the driver cannot write the
    next result.json and stops; trial 2, still running (it holds 30 s: under load it finished before
    the next trial and its result found room freed by a failed write), is recorded interrupted (not
    counted), and the resume reruns it."""
    journal = tmp_path / "elsewhere" / "study.journal"
    _spec(tmp_path / "spec.yaml", 6, function="trainfns_light:fills_the_disk",
          options={"at": 2, "sleep": 0.2, "hold": 30}, storage=str(journal))
    rd = small_disk / "run"
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", str(rd), "--quiet")
    assert r.returncode == 1, r.stderr
    *notices, last = r.stderr.splitlines()
    assert last == f"hpoflow: stopped: cannot write to run directory {rd}: the disk is full; free space, then " \
                   "rerun the same command to resume"
    for line in notices:  # a running trial's log capture says, once per log, that its output is dropped
        assert re.fullmatch(rf"hpoflow: rank log {re.escape(str(rd))}/trials/\d+/rank0\.log: \[Errno 28\] No space "
                            r"left on device; the rest of its output is dropped", line), r.stderr
    study = optuna.load_study(study_name="faults", storage=JournalStorage(JournalFileBackend(str(journal))))
    by_number = {t.number: t for t in study.trials}
    assert by_number[2].state == TrialState.FAIL and "study stopped" in by_number[2].user_attrs["error"]
    assert any(t.user_attrs.get("hpoflow_replaces") == 2 for t in study.trials)  # interrupted: rerun, uncounted
    (rd / "filler").unlink()
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", str(rd), "--json")
    assert r.returncode == 0, r.stderr
    status = json.loads(r.stdout)
    assert status["n_complete"] == 6 and status["n_failed"] == 0
