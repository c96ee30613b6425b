"""RetryingStorage waits out outages, gives up after storage_retry_s, and never repeats a write that
landed (hpoflow.run.retry). Outages are simulated on a real Optuna storage by raising SQLAlchemy's own
OperationalError around its calls; tests/run/test_faults.py stops a real PostgreSQL server."""

from __future__ import annotations

import errno
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import pytest
import sqlalchemy.exc
from optuna.storages import BaseStorage
from optuna.trial import TrialState

from hpoflow.run.retry import TOKEN_ATTR, RetryingStorage, StorageFull, StorageUnavailable
from hpoflow.run.storage import open_storage


def _outage(message: str = "connection to server failed: Connection refused") -> Exception:
    """What Optuna's RDBStorage raises when the server is down: its StorageInternalError around
    SQLAlchemy's OperationalError."""
    try:
        try:
            raise sqlalchemy.exc.OperationalError("SELECT 1", {}, Exception(message))
        except sqlalchemy.exc.OperationalError as inner:
            raise optuna.exceptions.StorageInternalError("An exception is raised during the commit.") from inner
    except optuna.exceptions.StorageInternalError as exc:
        return exc


class Flaky:
    """A storage that answers through ``inner``, failing the calls it is told to: ``fail[name] = k``
    fails the next k calls of ``name`` before (``after=False``) or after (``after=True``, a reply lost
    once the write landed) doing them."""

    def __init__(self, inner: BaseStorage) -> None:
        self.inner = inner
        self.fail: dict[str, int] = {}
        self.after = False
        self.error: Callable[[], Exception] = _outage

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            if self.fail.get(name, 0) > 0:
                self.fail[name] -= 1
                if self.after:
                    fn(*args, **kwargs)
                raise self.error()
            return fn(*args, **kwargs)

        return call


class Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def sleep(self, s: float) -> None:
        self.sleeps.append(s)
        self.now += s


def _proxy(tmp_path: Path, retry_s: float = 60.0) -> tuple[RetryingStorage, Flaky, Clock, optuna.Study]:
    flaky = Flaky(open_storage(None, tmp_path))
    clock = Clock()
    proxy = RetryingStorage(flaky, "the test storage", retry_s, sleep=clock.sleep,  # type: ignore[arg-type]
                            clock=lambda: clock.now)
    study = optuna.create_study(storage=proxy, study_name="r")
    return proxy, flaky, clock, study


def test_an_outage_is_waited_out_with_one_line_and_backoff(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _, flaky, clock, study = _proxy(tmp_path)
    flaky.fail["get_all_trials"] = 6
    with caplog.at_level(logging.WARNING, logger="hpoflow"):
        trials = study.get_trials()
    assert trials == []
    assert clock.sleeps == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0]  # doubling from 0.25 s, capped at 8 s
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["storage unreachable, retrying for up to 60 s: (builtins.Exception) connection to server "
                     "failed: Connection refused", "storage reachable again after 15.8 s"]


def test_one_outage_waited_out_by_two_threads_is_announced_once(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    """The driver's calls and its lease renewals share one storage: both wait, one line each way."""
    flaky = Flaky(open_storage(None, tmp_path))
    both_failed = threading.Barrier(2, timeout=120)  # event order, not time: each waits for the other's failure
    first_waits = []

    def sleep(s: float) -> None:
        first_waits.append(s)
        if len(first_waits) <= 2:
            both_failed.wait()

    proxy = RetryingStorage(flaky, "the test storage", 60, sleep=sleep, clock=lambda: 0.0)  # type: ignore[arg-type]
    study = optuna.create_study(storage=proxy, study_name="r")
    flaky.fail["get_all_trials"] = 2
    results: list[object] = []
    with caplog.at_level(logging.WARNING, logger="hpoflow"):
        threads = [threading.Thread(target=lambda: results.append(study.get_trials())) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    assert results == [[], []]
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["storage unreachable, retrying for up to 60 s: (builtins.Exception) connection to server "
                     "failed: Connection refused", "storage reachable again after 0.0 s"]


def test_past_storage_retry_s_the_call_gives_up_and_later_calls_do_not_wait(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="hpoflow")
    _, flaky, clock, study = _proxy(tmp_path, retry_s=10)
    flaky.fail["get_all_trials"] = 100
    with pytest.raises(StorageUnavailable) as info:
        study.get_trials()
    assert sum(clock.sleeps) == pytest.approx(10.0)  # never past the budget
    assert "did not answer for 10 s (storage_retry_s: 10): (builtins.Exception) connection" in str(info.value)
    assert "rerun the same command to resume" in str(info.value) and info.value.exit_code == 1
    clock.sleeps.clear()
    with pytest.raises(StorageUnavailable) as info:  # still down: one try, no second wait
        study.get_trials()
    assert clock.sleeps == [] and "stopped answering earlier" in str(info.value)
    flaky.fail.clear()
    assert study.get_trials() == []  # a call that succeeds (maybe from a cache) says nothing: still no wait
    flaky.fail["get_all_trials"] = 1
    with pytest.raises(StorageUnavailable):
        study.get_trials()
    clock.now += 10  # storage_retry_s after giving up, outages are waited out again
    flaky.fail["get_all_trials"] = 1
    assert study.get_trials() == [] and clock.sleeps == [0.25]
    lines = [r.getMessage() for r in caplog.records]  # one outage, from the first failure to the success
    assert [line.split(":")[0] for line in lines] == ["storage unreachable, retrying for up to 10 s",
                                                      "storage reachable again after 20.2 s"], lines


def test_a_trial_whose_creation_reply_was_lost_is_not_created_twice(tmp_path: Path) -> None:
    _, flaky, _, study = _proxy(tmp_path)
    flaky.after = True  # the write lands, then the connection drops before the reply
    flaky.fail["create_new_trial"] = 2
    trial = study.ask()
    study.tell(trial, 1.0)
    flaky.fail["create_new_trial"] = 1  # an enqueued trial (a template) too
    study.enqueue_trial({"x": 0.5})
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.COMPLETE, TrialState.WAITING]
    assert len({t.system_attrs[TOKEN_ATTR] for t in trials}) == 2
    assert trials[1].system_attrs["fixed_params"] == {"x": 0.5}


def test_a_finish_whose_reply_was_lost_is_the_first_attempts_success(tmp_path: Path) -> None:
    _, flaky, _, study = _proxy(tmp_path)
    trial = study.ask()
    flaky.after = True
    flaky.fail["set_trial_state_values"] = 1
    study.tell(trial, 2.0)  # the retry finds it finished with this value: no UpdateFinishedTrialError
    assert study.trials[0].state == TrialState.COMPLETE and study.trials[0].value == 2.0
    other = study.ask()
    study.tell(other, 3.0)
    flaky.fail["set_trial_state_values"] = 1  # a different value already there is a real conflict
    with pytest.raises(optuna.exceptions.UpdateFinishedTrialError):
        study._storage.set_trial_state_values(other._trial_id, TrialState.COMPLETE, [4.0])


def test_errors_that_are_not_outages_pass_unchanged_and_a_full_disk_is_not_waited_for(tmp_path: Path) -> None:
    _, flaky, clock, study = _proxy(tmp_path)
    with pytest.raises(KeyError):
        optuna.load_study(study_name="no such study", storage=study._storage)
    flaky.error = lambda: OSError(errno.ENOSPC, "No space left on device")
    flaky.fail["create_new_trial"] = 1
    with pytest.raises(StorageFull) as info:
        study.ask()
    assert "cannot write the study's storage the test storage: the disk is full" in str(info.value)
    assert info.value.exit_code == 2 and clock.sleeps == []
    flaky.error = lambda: ValueError("not an outage")
    flaky.fail["get_all_trials"] = 1
    with pytest.raises(ValueError):
        study.get_trials()
    assert clock.sleeps == []


def test_a_network_file_system_error_is_an_outage(tmp_path: Path) -> None:
    _, flaky, clock, study = _proxy(tmp_path)
    flaky.error = lambda: OSError(errno.ESTALE, "Stale file handle")
    flaky.fail["get_all_trials"] = 2
    assert study.get_trials() == [] and clock.sleeps == [0.25, 0.5]


def test_a_password_never_reaches_the_message(tmp_path: Path) -> None:
    flaky = Flaky(open_storage(None, tmp_path))
    flaky.error = lambda: _outage('password authentication failed for user "u" (password "s3cret!")')
    proxy = RetryingStorage(flaky, "postgresql://u:***@h/db", 0, secret="s3cret!")  # type: ignore[arg-type]
    study = optuna.create_study(storage=proxy, study_name="p")
    flaky.fail["get_all_trials"] = 1
    with pytest.raises(StorageUnavailable) as info:
        study.get_trials()
    assert "s3cret!" not in str(info.value) and '(password "***")' in str(info.value)


# -- the driver and optimize() around it ------------------------------------------------------------
SPEC: dict[str, Any] = {
    "study": {"name": "down", "metric": "score", "direction": "maximize"},
    "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
    "search": {"algorithm": "random", "n_trials": 8, "max_concurrent": 2, "seed": 3},
    "training": {"function": "trainfns:counter"}, "storage_retry_s": 0.5,
}


def test_a_storage_that_stops_answering_stops_the_study_cleanly_and_a_rerun_resumes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from hpoflow.api import optimize
    from hpoflow.engines.threads import ThreadEngine
    from hpoflow.run.journal import JournalFile

    down = {"now": False}
    real_append = JournalFile.append_logs

    def append(self: JournalFile, logs: list[dict[str, Any]]) -> None:
        if down["now"]:  # the journal's network file system stopped answering
            raise OSError(errno.ESTALE, "Stale file handle")
        real_append(self, logs)

    calls: list[float] = []

    def objective(params: dict[str, Any], reporter: Any) -> float:
        calls.append(params["x"])
        if len(calls) == 4:
            down["now"] = True
        return float(params["x"])

    monkeypatch.setattr(JournalFile, "append_logs", append)
    with caplog.at_level(logging.WARNING, logger="hpoflow"):
        r = optimize(SPEC, tmp_path / "run", engine=ThreadEngine(objective, 2))
    s = r.summary
    assert s.stopped_by == "storage" and s.exit_code == 1
    assert s.outcome_message().startswith("stopped: the study's storage ") and "did not answer for" in s.reason
    assert [m.getMessage()[:45] for m in caplog.records] == ["storage unreachable, retrying for up to 0.5 s"]
    assert not (tmp_path / "run" / "trials.csv").exists()  # nothing to write it from
    down["now"] = False
    r = optimize(SPEC, tmp_path / "run", engine=ThreadEngine(lambda p, rep: float(p["x"]), 2))
    assert r.summary.exit_code == 0 and r.summary.n_finished == 8
    assert sum(t.state == TrialState.COMPLETE for t in r.study.trials) == 8


def test_an_outage_before_the_first_trial_is_one_error_not_a_second(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from hpoflow.api import optimize
    from hpoflow.engines.threads import ThreadEngine
    from hpoflow.search.driver import Driver

    def reconcile(self: Driver) -> None:
        raise StorageUnavailable("the study's storage X did not answer for 60 s (storage_retry_s: 60): cause")

    monkeypatch.setattr(Driver, "_reconcile", reconcile)
    result = optimize(SPEC, tmp_path / "run", engine=ThreadEngine(lambda p, rep: 0.0, 2))
    s = result.summary  # a clean stop (exit 1, the one line), with nothing more asked of the storage
    assert s.stopped_by == "storage" and s.exit_code == 1 and "did not answer for 60 s" in s.outcome_message()
    assert not (tmp_path / "run" / "trials.csv").exists()
