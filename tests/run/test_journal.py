"""A torn journal record is cut off, damage elsewhere refused before anything is appended, and readers
change nothing (hpoflow.run.journal)."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.storages.journal._storage import JournalOperation  # the record format the test cuts into
from optuna.trial import TrialState

from hpoflow.run.journal import JournalDamaged, check_journal
from hpoflow.run.storage import open_storage

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _plain(path: Path, name: str) -> optuna.Study:
    """The study as plain Optuna reads the file."""
    return optuna.load_study(study_name=name, storage=JournalStorage(JournalFileBackend(str(path))))


def _study(tmp_path: Path, n: int = 3) -> Path:
    """A journal of ``n`` complete trials, written by hpoflow's storage; its path."""
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="j")
    for i in range(n):
        t = study.ask()
        t.suggest_float("x", 0, 1)
        study.tell(t, float(i))
    return tmp_path / "study.journal"


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# -- the tail check and the append, in process -----------------------------------------------------
def test_a_torn_last_record_is_cut_off_at_open_with_its_offset(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    path = _study(tmp_path)
    whole = path.read_bytes()
    path.write_bytes(whole[:-40])
    cut_at = whole[:-40].rfind(b"\n") + 1
    with caplog.at_level(logging.WARNING, logger="hpoflow"):
        check_journal(path, repair=False)  # a reader: says so, changes nothing
    assert path.read_bytes() == whole[:-40]
    assert f"byte offset {cut_at}" in caplog.text and "ignored here" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hpoflow"):
        study = optuna.load_study(study_name="j", storage=open_storage(None, tmp_path))  # a writer's open
    assert path.read_bytes() == whole[:cut_at]
    assert f"{len(whole) - 40 - cut_at} byte(s) dropped at byte offset {cut_at}" in caplog.text
    assert not (tmp_path / "study.journal.lock").exists()  # the journal's lock, taken and released
    t = study.ask()  # appends after the cut: the file stays readable by plain Optuna
    study.tell(t, 9.0)
    states = [t.state for t in _plain(path, "j").trials]
    assert states == [TrialState.COMPLETE, TrialState.COMPLETE, TrialState.RUNNING, TrialState.COMPLETE]


def test_a_whole_last_record_without_its_newline_gets_it_back(tmp_path: Path) -> None:
    path = _study(tmp_path)
    path.write_bytes(path.read_bytes()[:-1])  # only the newline of the last finish is missing
    assert [t.state for t in _plain(path, "j").trials][-1] == TrialState.RUNNING  # Optuna skips the line
    open_storage(None, tmp_path)
    assert path.read_bytes().endswith(b"}\n")
    assert [t.state for t in _plain(path, "j").trials] == [TrialState.COMPLETE] * 3  # nothing was lost


@pytest.mark.parametrize("damage", ["garbage at the end", "a line in the middle"])
def test_a_journal_damaged_elsewhere_is_refused_before_anything_is_appended(tmp_path: Path, damage: str) -> None:
    path = _study(tmp_path)
    lines = path.read_bytes().splitlines(keepends=True)
    if damage == "garbage at the end":
        lines.append(b"garbage{\n")
        bad = len(lines)
    else:
        lines[4] = lines[4][:30] + b"\n"  # a record cut short in the middle of the file
        bad = 5
    path.write_bytes(b"".join(lines))
    before = _sha(path)
    offset = sum(len(line) for line in lines[:bad - 1])
    with pytest.raises(JournalDamaged) as info:
        open_storage(None, tmp_path)
    assert f"line {bad} (byte offset {offset})" in str(info.value)
    assert f"head -c {offset} " in str(info.value) and "\n" not in str(info.value)
    assert _sha(path) == before and not (tmp_path / "study.journal.lock").exists()
    if damage == "a line in the middle":  # readers cannot read past it either
        with pytest.raises(JournalDamaged):
            open_storage(None, tmp_path, create=False)
    else:  # readers read what is whole, as Optuna does, and say what is wrong
        study = optuna.load_study(study_name="j", storage=open_storage(None, tmp_path, create=False))
        assert len(study.trials) == 3
    assert _sha(path) == before


def test_a_failed_append_leaves_no_part_of_a_record(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A full disk mid-append: the write that fails is taken back, so the next append (after space is
    freed) does not glue onto a partial line."""
    path = _study(tmp_path)
    storage = open_storage(None, tmp_path)
    study = optuna.load_study(study_name="j", storage=storage)
    before = path.read_bytes()
    real_write = os.write

    def half_then_full(fd: int, data: Any) -> int:
        real_write(fd, bytes(data)[: len(data) // 2])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError) as info:
        study.ask()
    assert info.value.errno == errno.ENOSPC
    assert path.read_bytes() == before
    monkeypatch.setattr(os, "write", real_write)
    study = optuna.load_study(study_name="j", storage=open_storage(None, tmp_path))
    t = study.ask()
    study.tell(t, 5.0)
    assert [t.value for t in _plain(path, "j").trials] == [0.0, 1.0, 2.0, 5.0]


def test_an_append_after_another_writer_died_mid_append_cuts_its_record_first(tmp_path: Path) -> None:
    path = _study(tmp_path)
    study = optuna.load_study(study_name="j", storage=open_storage(None, tmp_path))
    with open(path, "ab") as f:  # another process died after writing part of a record
        f.write(b'{"op_code":4,"worker_id":"x","study_id":0,"datetime_start":"2026-')
    t = study.ask()
    study.tell(t, 3.0)
    assert [t.value for t in _plain(path, "j").trials] == [0.0, 1.0, 2.0, 3.0]


# -- through the CLI -------------------------------------------------------------------------------
def _spec(path: Path, n: int) -> Path:
    data = {"study": {"name": "torn", "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": 2, "seed": 1},
            "training": {"function": "trainfns_light:costly"}, "oracle": {"enabled": False}}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _hpoflow(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpoflow", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=300)


def _last_finish_offset(journal: bytes) -> int:
    """Byte offset of the last record that sets a trial COMPLETE (Optuna's journal op SET_TRIAL_STATE_VALUES)."""
    offset, found = 0, -1
    for line in journal.splitlines(keepends=True):
        record = json.loads(line)
        if record["op_code"] == JournalOperation.SET_TRIAL_STATE_VALUES and record["state"] == TrialState.COMPLETE:
            found = offset
        offset += len(line)
    if found < 0:
        raise AssertionError("no trial finished in the journal")
    return found


@pytest.mark.slow  # whole studies through the CLI
def test_a_finished_run_with_40_bytes_cut_resumes_and_completes(tmp_path: Path) -> None:
    _spec(tmp_path / "spec.yaml", 4)
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--quiet")
    assert r.returncode == 0, r.stderr
    path = tmp_path / "run" / "study.journal"
    whole = path.read_bytes()
    # a node crash or a full disk during the append that finishes the last trial (records after it, such
    # as the driver's lease release, never made it): the file ends 40 bytes into that record
    cut_at = _last_finish_offset(whole)
    torn = whole[:cut_at + 40]
    path.write_bytes(torn)
    status = _hpoflow(tmp_path, "status", "run", "--json")
    assert status.returncode == 0, status.stderr
    assert f"at byte offset {cut_at}, no newline" in status.stderr
    assert json.loads(status.stdout)["n_complete"] == 3  # the fourth's finish was in the torn record
    assert path.read_bytes() == torn  # a reader changes nothing
    assert len(_plain(path, "torn").trials) == 4  # plain Optuna reads what is whole
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--json")
    assert r.returncode == 0, r.stderr
    assert f"dropped at byte offset {cut_at}" in r.stderr and "Traceback" not in r.stderr
    assert json.loads(r.stdout)["n_complete"] == 4
    status = _hpoflow(tmp_path, "status", "run", "--json")
    assert status.returncode == 0 and status.stderr == ""
    assert json.loads(status.stdout)["n_complete"] == 4
    trials = _plain(path, "torn").trials
    assert [t.state for t in trials].count(TrialState.COMPLETE) == 4  # the torn one was rerun


@pytest.mark.slow  # whole studies through the CLI
def test_a_damaged_journal_is_refused_by_the_cli_with_exit_2_and_left_as_it_was(tmp_path: Path) -> None:
    _spec(tmp_path / "spec.yaml", 3)
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--quiet")
    assert r.returncode == 0, r.stderr
    path = tmp_path / "run" / "study.journal"
    whole = path.read_bytes()
    lines = whole.splitlines(keepends=True)
    middle = b"".join([*lines[:3], lines[3][:25] + b"\n", *lines[4:]])  # a record cut short, then more
    for damaged, offset in ((whole + b"garbage\n", len(whole)), (middle, sum(map(len, lines[:3])))):
        path.write_bytes(damaged)
        r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--n-trials", "5")
        assert r.returncode == 2, r.stderr
        assert f"(byte offset {offset}) is not a valid JSON record" in r.stderr
        assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr  # one line
        assert path.read_bytes() == damaged  # nothing appended behind the damage


def _finishes(journal: bytes) -> int:
    """How many records of ``journal`` set a trial COMPLETE."""
    records = [json.loads(line) for line in journal.splitlines(keepends=True) if line.endswith(b"\n")]
    return sum(r["op_code"] == JournalOperation.SET_TRIAL_STATE_VALUES and r["state"] == TrialState.COMPLETE
               for r in records)


def _read_when(path: Path, finished: int, bound_s: float = 120.0) -> bytes:
    """``path``'s bytes once it records ``finished`` complete trials (polled every 0.05 s)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            data = path.read_bytes()
            if _finishes(data) >= finished:
                return data
        time.sleep(0.05)
    raise AssertionError(f"{path} did not record {finished} complete trial(s) in {bound_s} s")


@pytest.mark.slow  # whole studies through the CLI
@pytest.mark.parametrize("how", ["deleted", "replaced"])
def test_a_journal_deleted_or_replaced_mid_run_stops_it_cleanly_with_its_records_saved(tmp_path: Path,
                                                                                      how: str) -> None:
    """The journal is deleted, or an older copy of it moved over it (a backup restored), while the run
    writes it: the driver stops with one line and exit 1 (it died with a JSONDecodeError traceback),
    writes nothing to the file now at the path, and saves the records of the one it opened beside it;
    moving that back resumes the study to its full count."""
    n = 6
    data = {"study": {"name": "gone", "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": 1, "seed": 1},
            "training": {"function": "trainfns_light:nap", "options": {"seconds": 0.4}}, "oracle": {"enabled": False}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    path = tmp_path / "run" / "study.journal"
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "run", "spec.yaml", "--run-dir", "run", "--quiet"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        older = _read_when(path, 1)
        if how == "deleted":
            held = path.read_bytes()
            path.unlink()
        else:
            held = _read_when(path, 2)
            (tmp_path / "older").write_bytes(older)
            os.replace(tmp_path / "older", path)
        _, err = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    assert proc.returncode == 1, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    saved = path.with_name("study.journal.recovered")
    assert err.startswith(f"hpoflow: stopped: the study's journal {path} was {how} while this run was using it"), err
    assert f"saved in {saved}. Fix: move {saved} to {path}" in err, err
    if how == "replaced":
        assert path.read_bytes() == older  # nothing of this run mixed into the file now there
    assert saved.read_bytes().startswith(held)  # every record written before, and those after until it stopped
    assert 1 <= sum(t.state == TrialState.COMPLETE for t in _plain(saved, "gone").trials) < n
    os.replace(saved, path)
    r = _hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "run", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_complete"] == n


_HOLD = """
import sys, time
from pathlib import Path
from hpoflow.run.journal import journal_lock
lock = journal_lock(Path(sys.argv[1]))
lock.acquire()
Path(sys.argv[2]).touch()
time.sleep(600)
"""


def test_a_journal_lock_left_by_a_killed_process_is_taken_at_once_and_a_live_ones_is_waited_for(
        tmp_path: Path) -> None:
    """A driver killed while it appended left ``study.journal.lock``, and every resume waited Optuna's
    30 s grace period for it (three times in the five-moments driver-kill test). Now the lock of a dead
    holder is taken at once; a live holder's is still exclusive."""
    from hpoflow.run.journal import journal_lock

    journal = tmp_path / "study.journal"
    journal.touch()
    held = tmp_path / "held"
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(journal), str(held)], env=ENV)
    try:
        deadline = time.monotonic() + 60  # a bound for a hang only (an interpreter's start at load)
        while not held.exists():
            assert holder.poll() is None and time.monotonic() < deadline, "the holder never took the lock"
            time.sleep(0.01)
        lock = journal_lock(journal)
        assert lock._holder()[0] == "alive"  # a live holder's lock is not taken
        assert Path(f"{journal}.lock").exists()
        holder.kill()
        holder.wait(timeout=30)
        t0 = time.monotonic()
        assert lock.acquire()
        took = time.monotonic() - t0
        assert took < 10, f"waited {took:.1f} s for a dead holder's lock (Optuna's grace period is 30 s)"
        assert journal_lock(journal)._holder()[0] == "alive"  # now this process holds it
        lock.release()
        assert not Path(f"{journal}.lock").exists()
        assert lock.acquire()  # and it is free again
        lock.release()
    finally:
        holder.kill()
        holder.wait()
