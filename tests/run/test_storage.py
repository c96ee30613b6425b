"""The default storage: Optuna's journal format, readable by plain Optuna, with a fast WAITING index; and
storages that cannot work: refused with one line naming the file at fault, before anything is written."""

from __future__ import annotations

import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.storages import JournalStorage
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend
from optuna.storages.journal._storage import JournalStorageReplayResult
from optuna.trial import TrialState

from hpoflow.run.feed import TrialFeed
from hpoflow.run.retry import RetryingStorage
from hpoflow.run.storage import _Journal, open_storage
from tests.conftest import mounted_tmpfs


def test_waiting_index_answers_like_optunas_scan(tmp_path: Path) -> None:
    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    rng = random.Random(0)
    running = []
    for step in range(300):
        op = rng.random()
        if op < 0.3:
            study.enqueue_trial({"x": rng.random()})
        elif op < 0.7:
            t = study.ask()  # pops a waiting trial when there is one
            t.suggest_float("x", 0, 1)
            running.append(t)
        elif op < 0.75 and running:  # a driver gives back a trial it asked but did not run
            t = running.pop(rng.randrange(len(running)))
            storage.set_trial_state_values(t._trial_id, TrialState.WAITING)
        elif running:
            study.tell(running.pop(rng.randrange(len(running))), rng.random())
        if step % 10 == 0:
            plain = JournalStorage(JournalFileBackend(str(tmp_path / "study.journal")))
            want = [t.number for t in plain.get_all_trials(study._study_id, states=(TrialState.WAITING,))]
            got = [t.number for t in storage.get_all_trials(study._study_id, states=(TrialState.WAITING,))]
            assert got == want
    # other processes' enqueues are seen too (they arrive through the journal file)
    plain = JournalStorage(JournalFileBackend(str(tmp_path / "study.journal")))
    other = optuna.load_study(study_name="s", storage=plain)
    other.enqueue_trial({"x": 0.5})
    waiting = storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,))
    assert waiting and waiting[-1].system_attrs["fixed_params"] == {"x": 0.5}


def test_every_trials_read_is_what_optunas_replay_reads(tmp_path: Path) -> None:
    """The list of a study's trials is kept from read to read (the records the replay replaced swapped in, new
    trials added): after random asks, reports, attributes, tells, enqueues and another writer's trials, it
    holds what plain Optuna reads from the file, record for record."""

    def shape(t: optuna.trial.FrozenTrial) -> tuple[Any, ...]:
        return (t.number, t.state, t.values, dict(t.intermediate_values), t.user_attrs, t.params)

    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    other = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(
        str(tmp_path / "study.journal"))))
    rng = random.Random(1)
    running: list[optuna.trial.Trial] = []
    for step in range(400):
        _operate(rng, step, study, other, running, (0.25, 0.55, 0.65, 0.7, 0.7))
        if step % 7 == 0:
            plain = JournalStorage(JournalFileBackend(str(tmp_path / "study.journal")))
            want = [shape(t) for t in plain.get_all_trials(study._study_id)]
            assert [shape(t) for t in storage.get_all_trials(study._study_id, deepcopy=False)] == want, step


def test_the_waiting_query_looks_at_the_waiting_trials_alone(tmp_path: Path) -> None:
    """Thousands of running (or paused) trials do not make the query longer: it looks only at trials created
    or set WAITING."""
    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    for _ in range(2000):
        study.ask()
    study.enqueue_trial({"x": 0.5})
    popped = study.ask()  # the enqueued one
    given_back = study.ask()
    storage.set_trial_state_values(given_back._trial_id, TrialState.WAITING)
    waiting = storage.get_all_trials(study._study_id, states=(TrialState.WAITING,))
    assert storage.get_trial(popped._trial_id).system_attrs["fixed_params"] == {"x": 0.5}
    assert [t.number for t in waiting] == [given_back.number]
    assert isinstance(storage, _Journal) and storage._maybe_waiting == {given_back._trial_id}  # popped: RUNNING


def test_the_fast_paths_are_taken_with_this_optuna(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fast paths (the WAITING query, the append, an intermediate value added in place) read Optuna's
    journal internals and fall back to Optuna's own code when those change shape. The fallback would be
    silent (only slower), so here Optuna's own code paths raise or are counted: an Optuna upgrade that
    moves the internals fails this test instead of slowing every study."""

    def scan(self: JournalStorage, study_id: int, deepcopy: bool = True, states: Any = None) -> Any:
        if states is not None and list(states) == [TrialState.WAITING]:
            raise AssertionError("the WAITING query fell back to Optuna's full scan")
        return original_scan(self, study_id, deepcopy, states)

    def append(self: JournalFileBackend, logs: list[dict[str, Any]]) -> None:
        raise AssertionError("the journal append fell back to Optuna's fsync per append")

    copies: list[int] = []

    def copy_values(self: JournalStorageReplayResult, log: dict[str, Any]) -> None:
        copies.append(log["step"])
        original_copy(self, log)

    original_scan = JournalStorage.get_all_trials
    original_copy = JournalStorageReplayResult._apply_set_trial_intermediate_value
    monkeypatch.setattr(JournalStorage, "get_all_trials", scan)
    monkeypatch.setattr(JournalFileBackend, "append_logs", append)
    monkeypatch.setattr(JournalStorageReplayResult, "_apply_set_trial_intermediate_value", copy_values)
    monkeypatch.delenv("HPOFLOW_JOURNAL_FSYNC", raising=False)
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="fast")
    study.enqueue_trial({"x": 0.25})
    trial = study.ask()
    assert trial.suggest_float("x", 0, 1) == 0.25
    for step in range(5):
        trial.report(float(step), step)
    assert copies == [0]  # Optuna's copying replay: only once the trial was handed out (ask), not per value
    study.tell(trial, 1.0)
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE]


class _MemoryBackend(BaseJournalBackend):
    """Optuna's journal records in a list: the replay's own cost, without a file's per-append cost."""

    def __init__(self) -> None:
        self.logs: list[dict[str, Any]] = []

    def read_logs(self, log_number_from: int) -> Iterator[dict[str, Any]]:
        yield from self.logs[log_number_from:]

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        self.logs.extend(logs)


def test_a_trials_ten_thousandth_intermediate_value_costs_what_its_thousandth_did() -> None:
    """Optuna's journal replay copies a trial's earlier intermediate values at each new one (so a trial
    handed out never changes under its holder): the 10,000th cost ~5x the 1,000th, and 100,000 reports
    of one command trial took minutes (issue 66). ``_Journal`` adds a value in place unless the trial
    was handed out since its last copy. A backend in memory leaves only the replay's cost to compare;
    the median per write (CPU time) is robust to a pause (GC, another process); 2.5x is generous for
    a cost that must not grow (before: 4.8x here)."""
    storage = _Journal(_MemoryBackend())  # type: ignore[arg-type]  # (any Optuna journal backend)
    study_id = storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], "flat")
    trial_id = storage.create_new_trial(study_id)
    costs = []
    for step in range(10_000):
        t0 = time.process_time()
        storage.set_trial_intermediate_value(trial_id, step, 1.0 / (step + 1))
        costs.append(time.process_time() - t0)
    early, late = statistics.median(costs[1000:2000]), statistics.median(costs[-1000:])
    assert late < 2.5 * max(early, 1e-7), (early, late)
    assert storage.get_trial(trial_id).intermediate_values == {s: 1.0 / (s + 1) for s in range(10_000)}


def test_a_trial_handed_out_keeps_the_values_it_had_and_a_reopened_journal_has_them_all(tmp_path: Path) -> None:
    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="kept")
    trial = study.ask()
    for step in range(3):
        trial.report(float(step), step)
    held = storage.get_trial(trial._trial_id)  # handed out as it is (no deepcopy)
    listed = storage.get_all_trials(study._study_id, deepcopy=False)[0]
    copied = storage.get_all_trials(study._study_id)[0]
    for step in range(3, 2000):
        trial.report(float(step), step)
    assert held.intermediate_values == listed.intermediate_values == copied.intermediate_values == \
        {0: 0.0, 1: 1.0, 2: 2.0}  # as they were when handed out
    now = storage.get_trial(trial._trial_id)
    assert now.intermediate_values == {s: float(s) for s in range(2000)}
    trial.report(2000.0, 2000)  # (handed out again just now: this one is copied, `now` keeps its 2,000)
    assert len(now.intermediate_values) == 2000
    other = open_storage(None, tmp_path)  # another process's replay of the file, and its writes seen here
    assert other.get_trial(trial._trial_id).intermediate_values == {s: float(s) for s in range(2001)}
    other.set_trial_intermediate_value(trial._trial_id, 2001, 1.5)
    study.tell(trial, 1.0)
    final = open_storage(None, tmp_path).get_trial(trial._trial_id)
    assert final.state == TrialState.COMPLETE and len(final.intermediate_values) == 2002
    assert final.intermediate_values[2001] == 1.5 and final.last_step == 2001


# -- storages that cannot work, through the CLI ------------------------------------------------------
ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}
N = 3


def _spec(path: Path, **extra: Any) -> Path:
    data = {"study": {"name": "where", "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": N, "max_concurrent": 1, "seed": 1},
            "training": {"function": "trainfns_light:nap", "options": {"seconds": 0.05}},
            "oracle": {"enabled": False}, **extra}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _hpoflow(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpoflow", *args], cwd=cwd, env={**ENV, **(env or {})},
                          capture_output=True, text=True, timeout=300)


def _one_line(r: subprocess.CompletedProcess[str], code: int = 2) -> str:
    """The one line a refused command printed (asserting exit ``code``, one line, no traceback)."""
    assert r.returncode == code, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip()


@pytest.fixture
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A read-only tmpfs, unmounted afterwards; skips where mounting is refused (not root)."""
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as mnt:
        yield mnt


@pytest.mark.parametrize("kind", ["directory", "device", "proc file", "read-only file system"])
def test_a_journal_path_that_cannot_work_is_named_with_why(tmp_path: Path, kind: str,
                                                         request: pytest.FixtureRequest) -> None:
    """A journal path that is a directory, ``/dev/null``, ``/proc/self/status`` or on a read-only file
    system: one line naming it and why, exit 2, nothing written (they blamed the run directory, and
    ``/dev/null`` failed with "AssertionError: Should not reach"); validate refuses what it can see."""
    if kind == "directory":
        path, why, seen_by_validate = tmp_path / "adir", "it is a directory, and a journal is a file", True
        path.mkdir()
    elif kind == "device":
        path, why, seen_by_validate = Path("/dev/null"), "it is a character device, and a journal is a file", True
    elif kind == "proc file":
        path = Path("/proc/self/status")
        why, seen_by_validate = "its lock file /proc/self/status.lock: No such file or directory", False
    else:
        path = request.getfixturevalue("read_only_dir") / "study.journal"
        why, seen_by_validate = f"its lock file {path}.lock: the file system is read-only", False
    _spec(tmp_path / "spec.yaml", storage=str(path))
    expected = (f"hpoflow: error: storage: cannot use {path} as the study's journal: {why}. Fix: point storage: at a "
                "file in a directory you can write to, or leave storage: out (the run directory's study.journal)")
    assert _one_line(_hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "run")) == expected
    assert not (tmp_path / "run").exists()
    r = _hpoflow(tmp_path, "validate", "spec.yaml")
    if seen_by_validate:
        assert _one_line(r) == expected
    else:
        assert r.returncode == 0, r.stderr


def test_an_in_memory_storage_is_refused_by_validate_and_run(tmp_path: Path) -> None:
    """An in-memory database keeps nothing once the run ends (the run exited 0, ``status`` found no
    storage and a rerun ran every trial again): refused before anything is written, as the spec's
    ``storage`` (with its line) or as the value of ``storage_env``'s variable. (Which URLs are in
    memory: tests/spec/test_spec_errors.py.)"""
    lines = _spec(tmp_path / "spec.yaml", storage="sqlite://").read_text().splitlines()
    line = 1 + next(i for i, text in enumerate(lines) if text.startswith("storage:"))
    for args in (("validate", "spec.yaml"), ("run", "spec.yaml", "--run-dir", "run")):
        r = _hpoflow(tmp_path, *args)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert f"spec.yaml:{line}: storage: 'sqlite://' is an SQLite URL with no database file" in r.stderr
        assert "nothing is kept when the run ends: `hpoflow status` and a resume cannot find the study" in r.stderr
    _spec(tmp_path / "spec.yaml", storage_env="HPO_TEST_DB")
    for args in (("validate", "spec.yaml"), ("run", "spec.yaml", "--run-dir", "run")):
        line_ = _one_line(_hpoflow(tmp_path, *args, env={"HPO_TEST_DB": "sqlite:///:memory:"}))
        assert line_.startswith("hpoflow: error: storage_env: the environment variable HPO_TEST_DB holds "
                                "'sqlite:///:memory:', an SQLite in-memory database: it lives only"), line_
        assert line_.endswith("Fix: export HPO_TEST_DB=<URL of a database file or server>")
    assert not (tmp_path / "run").exists()


def test_a_feeds_reader_is_told_every_trial_whose_record_changed_since_its_last_read(tmp_path: Path) -> None:
    """``TrialFeed``: after random asks, reports (through an ``optuna.Trial``, which updates the record it read
    in place), attributes, tells, enqueues, a driver giving a trial back and another writer's trials, every
    trial a reader is not told about reads as it did at that reader's last read; two readers at different
    paces each get their own changes."""

    def shape(t: optuna.trial.FrozenTrial) -> tuple[Any, ...]:
        return (t.number, t.state, t.values, dict(t.intermediate_values), dict(t.user_attrs), dict(t.params))

    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    other = optuna.load_study(study_name="s", storage=JournalStorage(JournalFileBackend(
        str(tmp_path / "study.journal"))))
    readers = {3: TrialFeed(), 11: TrialFeed()}  # read every 3rd and every 11th operation
    last: dict[int, list[tuple[Any, ...]] | None] = {3: None, 11: None}
    told = {3: 0, 11: 0}
    rng = random.Random(2)
    running: list[optuna.trial.Trial] = []
    for step in range(1, 500):
        _operate(rng, step, study, other, running, (0.2, 0.55, 0.62, 0.66, 0.69))
        for pace, feed in readers.items():
            if step % pace:
                continue
            trials, changed = feed.read(study)
            now = [shape(t) for t in trials]
            before = last[pace]
            if before is None:
                assert changed is None  # a first read: nothing to compare with
            else:
                assert changed is not None
                told[pace] += len(set(changed))
                quiet = set(range(len(before))) - set(changed)
                assert [now[n] for n in sorted(quiet)] == [before[n] for n in sorted(quiet)], (pace, step)
            last[pace] = now
    assert told[3] > 0 and told[11] > 0


def test_a_feed_tells_what_changed_alone_however_many_trials_run(tmp_path: Path) -> None:
    """One report among 2,000 running trials: the reader is told that one trial; through the retrying wrapper
    the run uses too. A storage without the feed (Optuna's in-memory one) says nothing: None."""
    storage = RetryingStorage(open_storage(None, tmp_path), "study.journal", 0)
    study = optuna.create_study(storage=storage, study_name="s")
    trials = [study.ask() for _ in range(2000)]
    feed = TrialFeed()
    assert feed.read(study)[1] is None
    trials[1234].report(0.5, 1)
    read, changed = feed.read(study)
    assert changed == [1234] and len(read) == 2000 and read[1234].intermediate_values == {1: 0.5}
    assert feed.read(study)[1] == []
    memory = optuna.create_study()
    memory.ask()
    assert TrialFeed().read(memory)[1] is None and TrialFeed().read(memory)[0][0].number == 0


def _operate(rng: random.Random, step: int, study: optuna.Study, other: optuna.Study,
             running: list[optuna.trial.Trial], cuts: tuple[float, float, float, float, float]) -> None:
    """One random operation on the study, from this process (``study``) or another writer (``other``): by where
    a draw falls among ``cuts``, an ask, a report (through the ``optuna.Trial``), a user attribute, an
    enqueue, a running trial put back WAITING (a driver that did not run it), else a tell."""
    storage = study._storage
    op = rng.random()
    if op < cuts[0] or not running:
        t = (other if rng.random() < 0.2 else study).ask()
        t.suggest_float("x", 0, 1)
        running.append(t)
    elif op < cuts[1]:
        t = rng.choice(running)
        t.report(rng.random(), len(storage.get_trial(t._trial_id).intermediate_values))
    elif op < cuts[2]:
        rng.choice(running).set_user_attr("k", step)
    elif op < cuts[3]:
        study.enqueue_trial({"x": 0.25})
    elif op < cuts[4]:
        t = running.pop(rng.randrange(len(running)))
        storage.set_trial_state_values(t._trial_id, TrialState.WAITING)
    else:
        t = running.pop(rng.randrange(len(running)))
        (other if rng.random() < 0.2 else study).tell(t, rng.random())
