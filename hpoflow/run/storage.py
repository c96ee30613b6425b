"""Where a study lives: an Optuna journal file in the run directory by default, or any Optuna URL.

The journal file is Optuna's own format (``JournalFileBackend``): plain Optuna, optuna-dashboard
and other processes open it; appends are locked, so it also works on a shared file system.

Durability: Optuna fsyncs every append (~1-3 ms each, several per trial). hpoflow's default journal
fsyncs only the append that finishes a trial (its final state and value), so a trial the driver
counts as finished is on disk before the driver moves on; the other appends (creation, parameters,
intermediate reports, attributes) are written with ``write()`` under the same lock: in the kernel
once the call returns, so any process crash loses nothing, and a machine crash can lose only
intermediate records of unfinished trials, which a resume reruns. ``HPOFLOW_JOURNAL_FSYNC=1``
restores Optuna's fsync per append; a database URL gives the database's guarantees.
"""

from __future__ import annotations

import copy
import json
import os
import time
from collections.abc import Container
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.trial import FrozenTrial, TrialState

__all__ = ["DEFAULT_JOURNAL", "open_storage", "storage_label"]

DEFAULT_JOURNAL = "study.journal"


_FINISHED_STATES = {TrialState.COMPLETE.value, TrialState.PRUNED.value, TrialState.FAIL.value}


class _JournalFileNoFsync(JournalFileBackend):
    """Optuna's journal file, appended without fsync except when an append finishes a trial (see
    the module docstring): a trial the driver counts as finished is on disk."""

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        path = getattr(self, "_file_path", None)
        lock = getattr(self, "_lock", None)
        if path is None or lock is None:  # Optuna's internals changed: keep its own behaviour
            super().append_logs(logs)
            return
        from optuna.storages.journal._file import get_lock_file

        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode("utf-8")
        durable = any(log.get("state") in _FINISHED_STATES and "values" in log for log in logs)
        with get_lock_file(lock), open(path, "ab") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())


class _Journal(JournalStorage):
    """Optuna's ``JournalStorage`` whose "which trials are WAITING?" query does not scan the study.

    ``study.ask()`` asks that on every call; Optuna answers by walking all trials, so a 10,000-trial
    study paid ~5 ms per ask at the end. Only an unfinished trial can be WAITING (created so by
    ``enqueue_trial``, or put back by a driver that asked it but did not run it), so per study we keep
    the ids of the trials that were unfinished at the last query, and look at those and at trials
    added since. Reads Optuna's replay state; if that changes shape, the parent's scan is used.
    """

    def __init__(self, backend: JournalFileBackend) -> None:
        super().__init__(backend)
        self._waiting: dict[int, tuple[int, set[int]]] = {}  # study -> (trials seen, unfinished ones)

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        replay = getattr(self, "_replay_result", None)
        ids_by_study = getattr(replay, "_study_id_to_trial_ids", None)
        trials = getattr(replay, "_trials", None)
        lock = getattr(self, "_thread_lock", None)
        waiting_only = isinstance(states, tuple | list) and list(states) == [TrialState.WAITING]
        if (not waiting_only or ids_by_study is None
                or trials is None or lock is None):
            return super().get_all_trials(study_id, deepcopy, states)
        with lock:
            self._sync_with_backend()
            ids = ids_by_study.get(study_id)
            if ids is None:
                return super().get_all_trials(study_id, deepcopy, states)  # raises as Optuna does
            seen, candidates = self._waiting.get(study_id, (0, set()))
            candidates.update(t for t in ids[seen:] if not trials[t].state.is_finished())
            candidates = {t for t in candidates if not trials[t].state.is_finished()}
            self._waiting[study_id] = (len(ids), candidates)
            out = [trials[t] for t in sorted(candidates) if trials[t].state == TrialState.WAITING]
        return copy.deepcopy(out) if deepcopy else out


def storage_label(storage: str | None, run_dir: Path) -> str:
    """Where the study lives, as a user would name it: a URL (``sqlite:///`` made absolute), or the
    journal file's absolute path. Relative journal paths and SQLite files are in the run directory."""
    run_dir = run_dir.expanduser().resolve()
    if storage is None:
        return str(run_dir / DEFAULT_JOURNAL)
    if "://" not in storage:
        path = Path(storage).expanduser()
        return str(path if path.is_absolute() else run_dir / path)
    if storage.startswith("sqlite:///") and not storage.startswith("sqlite:////"):
        rel = storage.removeprefix("sqlite:///")
        if not Path(rel).is_absolute():
            return f"sqlite:///{run_dir / rel}"
    return storage


def open_storage(storage: str | None, run_dir: Path, *, create: bool = True) -> optuna.storages.BaseStorage:
    """Open the study's storage. ``None`` or a path is a journal file (relative to the run
    directory); anything else is an Optuna storage URL. ``create=False`` (readers such as
    ``status``) refuses to create a journal or SQLite file that is not there."""
    label = storage_label(storage, run_dir)
    if "://" not in label:
        path = Path(label)
        if not create and not path.is_file():
            raise FileNotFoundError(f"no study storage at {path}")
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = JournalFileBackend if os.environ.get("HPOFLOW_JOURNAL_FSYNC") == "1" else _JournalFileNoFsync
        return _Journal(backend(str(path), lock_obj=JournalFileOpenLock(str(path))))
    if label.startswith("sqlite"):
        if not create and not Path(label.removeprefix("sqlite:///")).is_file():
            raise FileNotFoundError(f"no study storage at {label}")
        return _rdb(label, engine_kwargs={"connect_args": {"timeout": 60}})
    return _rdb(label)


_SCHEMA_RACE = ("already exists", "UNIQUE constraint failed", "duplicate key value")


def _rdb(url: str, **kwargs: Any) -> optuna.storages.RDBStorage:
    """Optuna's ``RDBStorage``. Several drivers started at once on a new database race to create its
    tables (``table ... already exists``, a duplicate version row): the losers try again, and find
    the tables there."""
    import sqlalchemy.exc

    for attempt in range(4):
        try:
            return optuna.storages.RDBStorage(url, **kwargs)
        except sqlalchemy.exc.SQLAlchemyError as exc:
            if not any(s in str(exc) for s in _SCHEMA_RACE):
                raise
            time.sleep(0.1 * (attempt + 1))
    return optuna.storages.RDBStorage(url, **kwargs)
