"""Where a study lives: an Optuna journal file in the run directory by default, or any Optuna URL.

The journal file is Optuna's own format: plain Optuna, optuna-dashboard and other processes open it;
appends are locked, so it also works on a shared file system. ``hpoflow.run.journal`` keeps it whole
(a torn last record is cut off on open, damage elsewhere refused) and says how durable it is. A
database URL is opened with Optuna's ``RDBStorage``, its pooled connections checked before use
(``pool_pre_ping``: a connection a server restart killed is replaced instead of failing the next
call) and a 10 s connect timeout. ``hpoflow.run.retry`` wraps either so a run waits out outages.
"""

from __future__ import annotations

import copy
import logging
import os
import stat
import time
from collections.abc import Container
from pathlib import Path
from typing import Any

import optuna
from optuna.storages import JournalStorage
from optuna.trial import FrozenTrial, TrialState

from hpoflow.errors import RunDirError
from hpoflow.run.journal import JournalFile, check_journal, find_damage
from hpoflow.run.rundir import disk_why

__all__ = ["DEFAULT_JOURNAL", "check_storage_path", "open_storage", "storage_label"]

DEFAULT_JOURNAL = "study.journal"


class _Journal(JournalStorage):
    """Optuna's ``JournalStorage`` whose "which trials are WAITING?" query does not scan the study.

    ``study.ask()`` asks that on every call; Optuna answers by walking all trials, so a 10,000-trial
    study paid ~5 ms per ask at the end. Only an unfinished trial can be WAITING (created so by
    ``enqueue_trial``, or put back by a driver that asked it but did not run it), so per study we keep
    the ids of the trials that were unfinished at the last query, and look at those and at trials
    added since. Reads Optuna's replay state; if that changes shape, the parent's scan is used.
    """

    def __init__(self, backend: JournalFile) -> None:
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


def _file_kind(mode: int) -> str:
    """What a file that is not a regular file is, in a few words."""
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
             (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))
    return next((what for test, what in kinds if test(mode)), "not a regular file")


def _journal_error(path: Path, why: str) -> RunDirError:
    return RunDirError(f"storage: cannot use {path} as the study's journal: {why}. Fix: point storage: at "
                       "a file in a directory you can write to, or leave storage: out (the run directory's "
                       f"{DEFAULT_JOURNAL})")


def check_storage_path(storage: str | None, run_dir: Path | None) -> None:
    """``RunDirError`` naming the file at fault when the study's storage file can be seen not to work
    before it is opened: a journal path that is a directory, a device, a pipe or a socket; an SQLite
    database path that is a directory, or (when opening it) in a directory that does not exist. A path
    relative to the run directory is checked only when ``run_dir`` is given (``hpoflow validate`` has
    none)."""
    if run_dir is not None:
        label = storage_label(storage, run_dir)
    elif storage is not None:
        label = storage if "://" in storage else str(Path(storage).expanduser())
    else:
        return
    if "://" not in label:
        path = Path(label)
        try:
            mode = path.stat().st_mode if path.is_absolute() else None
        except FileNotFoundError:
            mode = None
        except OSError as exc:
            raise _journal_error(path, disk_why(exc)) from None
        if mode is not None and not stat.S_ISREG(mode):
            raise _journal_error(path, f"it is {_file_kind(mode)}, and a journal is a file")
        return
    if not label.startswith("sqlite:///"):
        return
    db = Path(label.removeprefix("sqlite:///").split("?", 1)[0])  # (SQLite says "unable to open database file")
    if not db.is_absolute():  # relative to a run directory not given, or no file (:memory:)
        return
    if db.is_dir():
        raise RunDirError(f"storage: cannot open the study's storage {label}: {db} is a directory, not an SQLite "
                          f"database file. Fix: name a file, such as sqlite:///{db / 'study.db'}")
    if run_dir is not None and not db.parent.is_dir():  # (not at validate: it may be made before the run)
        what = "is not a directory" if os.path.lexists(db.parent) else "does not exist"
        raise RunDirError(f"storage: cannot open the study's storage {label}: {db.parent} {what} (SQLite creates the "
                          "database file, not its directory). Fix: create the directory, or correct the path")


def _open_journal(path: Path, create: bool) -> _Journal:
    """The journal at ``path``, its tail checked first (repaired only by a writer, ``create``) and
    replayed: ``JournalDamaged`` (a ``RunDirError``) names the first damaged line. A writer's journal
    that cannot be created, read, locked or written is a ``RunDirError`` naming it and why."""
    try:
        if create:
            path.parent.mkdir(parents=True, exist_ok=True)
        check_journal(path, repair=create)
        return _Journal(JournalFile(str(path), fsync_always=os.environ.get("HPOFLOW_JOURNAL_FSYNC") == "1",
                                    recover=create))
    except OSError as exc:
        if not create:
            raise
        where = ""  # the file the error is about, when not the journal itself (its lock file, its directory)
        if exc.filename and str(exc.filename) != str(path):
            where = f"{'its lock file ' if str(exc.filename) == f'{path}.lock' else ''}{exc.filename}: "
        raise _journal_error(path, f"{where}{disk_why(exc)}") from None
    except RunDirError:
        raise
    except Exception as exc:  # Optuna's replay met a line that is not JSON, or JSON that is no record of it
        damage = find_damage(path)
        if damage is not None:
            raise damage from None
        raise RunDirError(f"{path} cannot be replayed as an Optuna journal ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}): a record in it is damaged. Fix: restore "
                          "it from a backup") from None


class _NoFallbackNoise(logging.Filter):
    """Drop the warning Optuna's RDBStorage logs when a trial query fails and it retries it another way
    (meant for SQLite's variable limit): during an outage it is a second traceback-like line for what
    ``hpoflow.run.retry`` already says once."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Caught an error from sqlalchemy")


_RDB_LOGGER = "optuna.storages._rdb.storage"


def _engine_kwargs(url: str) -> dict[str, Any]:
    """SQLAlchemy engine options for a database URL: pooled connections checked before use, a bounded
    connect (SQLite: wait up to 60 s for another writer's lock instead)."""
    if url.startswith("sqlite"):
        return {"connect_args": {"timeout": 60}}
    kwargs: dict[str, Any] = {"pool_pre_ping": True}
    if url.startswith(("postgresql", "mysql")) and "connect_timeout" not in url:
        kwargs["connect_args"] = {"connect_timeout": 10}
    return kwargs


def open_storage(storage: str | None, run_dir: Path, *, create: bool = True) -> optuna.storages.BaseStorage:
    """Open the study's storage. ``None`` or a path is a journal file (relative to the run
    directory); anything else is an Optuna storage URL. ``create=False`` (readers such as
    ``status``) refuses to create a journal or SQLite file that is not there, and changes nothing
    (a torn journal tail is reported, not cut)."""
    label = storage_label(storage, run_dir)
    if create:
        check_storage_path(storage, run_dir)
    if "://" not in label:
        path = Path(label)
        if not create and not path.is_file():
            raise FileNotFoundError(f"no study storage at {path}")
        return _open_journal(path, create)
    if label.startswith("sqlite") and not create and not Path(label.removeprefix("sqlite:///")).is_file():
        raise FileNotFoundError(f"no study storage at {label}")
    rdb_log = logging.getLogger(_RDB_LOGGER)
    if not any(isinstance(f, _NoFallbackNoise) for f in rdb_log.filters):
        rdb_log.addFilter(_NoFallbackNoise())
    return _rdb(label, engine_kwargs=_engine_kwargs(label))


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
