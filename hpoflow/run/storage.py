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
_CHANGES_KEPT = 1 << 20  # the most entries of a study's change log (``_Journal._changes``), 8 MiB

try:  # the records of an intermediate value and of a state, as Optuna's journal writes them (private: None
    # where they moved)
    from optuna.storages.journal._storage import JournalOperation

    _INTERMEDIATE: int | None = int(JournalOperation.SET_TRIAL_INTERMEDIATE_VALUE)
    _STATE: int | None = int(JournalOperation.SET_TRIAL_STATE_VALUES)
except (ImportError, AttributeError):
    _INTERMEDIATE = _STATE = None


class _Journal(JournalStorage):
    """Optuna's ``JournalStorage`` whose "which trials are WAITING?" query does not scan the study, and
    whose intermediate values cost the same however many the trial has.

    ``study.ask()`` asks that on every call; Optuna answers by walking all trials, so a 10,000-trial
    study paid ~5 ms per ask at the end. A trial is WAITING only if it was created so (``enqueue_trial``)
    or put back so (a driver that asked it but did not run it): the replay of the records notes those
    trials (``_maybe_waiting``), and the query looks at them alone, however many trials run or are
    paused. (Where the replay is Optuna's own, the fallback keeps per study the trials that were
    unfinished at the last query and looks at those and at the trials added since.)

    Optuna's replay applies each intermediate value by copying the trial's earlier ones (a trial handed
    out must not change under its holder), so a trial's n-th report cost O(n): 100,000 reports of one
    trial took minutes, and so did replaying them when a run reopens its journal. Here a trial's values
    are copied only where its record may have been handed out (``get_trial``, ``get_all_trials`` without
    ``deepcopy``) since it was made (``_handouts``, ``_made``); otherwise the value is added in place.
    Reads Optuna's replay state; if that changes shape, the parent's ways are used.
    """

    def __init__(self, backend: JournalFile) -> None:
        # A trial's record may be held by whoever it was handed out to since it was made. Each hand-out of
        # records (get_all_trials without deepcopy) counts one; each record this storage made by a copy
        # is stamped with that count: a value for a record stamped below the count (or not stamped: made
        # by Optuna's replay, or handed out alone by get_trial) copies it first. O(1) a read and a write.
        # (Set before the first replay.)
        self._handouts = 0
        self._made: dict[int, int] = {}
        self._maybe_waiting: set[int] | None = set()  # trials created or set WAITING (None: not tracked)
        # per study, the list of its trials' records as the last read handed it out, and the trials whose
        # record the replay has replaced since (None: not kept, Optuna's walk instead)
        self._lists: dict[int, list[FrozenTrial]] | None = {}
        self._replaced: dict[int, set[int]] = {}
        # per study, the numbers of the trials whose record a read swapped in, in order, for readers that ask
        # what changed since their last read (``trials_and_changes``): (the position of its first entry, them)
        self._changes: dict[int, tuple[int, list[int]]] = {}
        super().__init__(backend)
        self._waiting: dict[int, tuple[int, set[int]]] = {}  # study -> (trials seen, unfinished ones)

    def __setstate__(self, state: dict[Any, Any]) -> None:
        """A pickled copy (Optuna's: the backend, then a new replay and lock; the backend's
        ``JournalFile.__setstate__`` opens the file anew) starts its WAITING index anew with its replay, and
        has lent no trial of it."""
        self._maybe_waiting = None  # (the parent's replay has run: nothing was noted)
        self._lists, self._replaced, self._changes = None, {}, {}
        super().__setstate__(state)
        self._waiting = {}
        self._handouts, self._made = 0, {}

    def _sync_with_backend(self) -> None:
        """Optuna's replay of the records appended since the last one, an intermediate value of a trial whose
        record was not handed out since it was made added in place (class docstring)."""
        replay = self._replay_result
        trials = getattr(replay, "_trials", None)
        updatable = getattr(replay, "_trial_exists_and_updatable", None)
        made = getattr(self, "_made", None)
        if not isinstance(trials, dict) or updatable is None or not isinstance(made, dict) or _INTERMEDIATE is None:
            self._maybe_waiting = None
            self._lists = None
            super()._sync_with_backend()
            return
        run: list[dict[str, Any]] = []  # records for Optuna's replay, in order
        for log in self._backend.read_logs(replay.log_number_read):
            if log.get("op_code") != _INTERMEDIATE:
                run.append(log)
                continue
            if run:
                self._apply(run)
                run = []
            trial_id = log["trial_id"]
            if made.get(trial_id, -1) < self._handouts:
                self._apply([log])  # a copy: a FrozenTrial handed out keeps what it held
                made[trial_id] = self._handouts
                continue
            replay.log_number_read += 1  # (counted first, as Optuna does: a record that raises is read)
            if updatable(trial_id, log):
                trials[trial_id].intermediate_values[log["step"]] = log["intermediate_value"]
        if run:
            self._apply(run)

    def _apply(self, logs: list[dict[str, Any]]) -> None:
        """Optuna's replay of ``logs``, noting the trials whose record it replaces, and those it creates
        WAITING or sets WAITING."""
        replay = self._replay_result
        trials = replay._trials
        first = len(trials)  # (a created trial's id is the number of trials before it)
        try:
            replay.apply_logs(logs)  # (a record issued by this process may raise, the ones before it applied)
        finally:
            self._note(logs, first)

    def _note(self, logs: list[dict[str, Any]], first: int) -> None:
        """After ``logs`` were applied (all, or those before one that raised): the trials whose record may be
        new, and those created or set WAITING (``first``: the number of trials before them)."""
        replay = self._replay_result
        trials = replay._trials
        owner = getattr(replay, "_trial_id_to_study_id", None)
        if self._lists is not None and isinstance(owner, dict):
            for log in logs:
                trial_id = log.get("trial_id")
                if trial_id is not None and owner.get(trial_id) in self._lists:
                    self._replaced.setdefault(owner[trial_id], set()).add(trial_id)
        elif self._lists is not None:
            self._lists = None
        maybe = self._maybe_waiting
        if maybe is None:
            return
        maybe.update(t for t in range(first, len(trials)) if trials[t].state == TrialState.WAITING)
        for log in logs:
            if log.get("op_code") == _STATE and log.get("state") == TrialState.WAITING.value:
                maybe.add(int(log["trial_id"]))

    def _listed(self, lists: dict[int, list[FrozenTrial]], study_id: int, ids: list[int],
                trials: dict[int, FrozenTrial]) -> list[FrozenTrial]:
        """The study's records in trial order, kept in ``lists`` from the last read: the records replaced since
        swapped in, the trials created since added (a read costs what changed, not a walk over every trial)."""
        listed = lists.get(study_id)
        if listed is None:
            listed = lists[study_id] = [trials[t] for t in ids]
            self._replaced.pop(study_id, None)
            return listed
        if len(listed) < len(ids):
            listed.extend(trials[t] for t in ids[len(listed):])
        replaced = self._replaced.pop(study_id, None)
        if replaced:
            base, log = self._changes.setdefault(study_id, (0, []))
            for t in replaced:
                record = trials[t]
                listed[record.number] = record
                log.append(record.number)
            if len(log) > _CHANGES_KEPT:  # a reader further behind than the half kept reads every trial again
                drop = len(log) - _CHANGES_KEPT // 2
                del log[:drop]
                self._changes[study_id] = (base + drop, log)
        return listed

    def _maps(self) -> tuple[dict[int, list[int]], dict[int, FrozenTrial]] | None:
        """Optuna's replay's trial ids per study and records per id; None if its layout is not the one known."""
        replay = self._replay_result
        ids_by_study = getattr(replay, "_study_id_to_trial_ids", None)
        trials = getattr(replay, "_trials", None)
        return None if ids_by_study is None or trials is None else (ids_by_study, trials)

    def _kept(self, study_id: int, maps: tuple[dict[int, list[int]], dict[int, FrozenTrial]]
              ) -> list[FrozenTrial] | None:
        """Under the lock, after the sync: the study's kept list (a copy of the list, not of its records), or
        None where it is not kept."""
        ids = maps[0].get(study_id)
        lists = self._lists
        return None if ids is None or lists is None else list(self._listed(lists, study_id, ids, maps[1]))

    def trials_and_changes(self, study_id: int, since: int | None
                           ) -> tuple[list[FrozenTrial], int, list[int] | None] | None:
        """``get_all_trials(study_id, deepcopy=False)``, the cursor to give next time, and the numbers of the
        trials whose record changed since the read that gave ``since`` (``hpoflow.run.feed``); None where
        the study's list is not kept (Optuna's ways in use: the caller reads as it would without)."""
        maps = self._maps()
        if maps is None:
            return None
        with self._thread_lock:
            self._sync_with_backend()
            out = self._kept(study_id, maps)
            if out is None:
                return None
            self._handouts += 1  # handed out as they are: each one's next value copies it
            base, log = self._changes.get(study_id, (0, []))
            cursor = base + len(log)
            changed = log[since - base:] if since is not None and base <= since <= cursor else None
            return out, cursor, changed

    def get_trial(self, trial_id: int) -> FrozenTrial:
        with self._thread_lock:
            self._sync_with_backend()
            trial = self._replay_result.get_trial(trial_id)
            self._made.pop(trial_id, None)  # handed out as it is: its next value copies it
            return trial

    def get_all_trials(self, study_id: int, deepcopy: bool = True,
                       states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        maps = self._maps()
        if maps is None:
            return super().get_all_trials(study_id, deepcopy, states)
        ids_by_study, trials = maps
        replay = self._replay_result
        waiting_only = isinstance(states, tuple | list) and list(states) == [TrialState.WAITING]
        owner = getattr(replay, "_trial_id_to_study_id", None)
        with self._thread_lock:
            self._sync_with_backend()
            ids = ids_by_study.get(study_id)
            maybe = self._maybe_waiting
            kept = self._kept(study_id, maps) if states is None else None
            if kept is not None:
                out = kept
            elif not waiting_only or ids is None:
                out = replay.get_all_trials(study_id, states)  # (KeyError for a study that is not there)
            elif maybe is not None and isinstance(owner, dict):
                maybe.difference_update([t for t in maybe if trials[t].state != TrialState.WAITING])
                out = [trials[t] for t in sorted(maybe) if owner.get(t) == study_id]
            else:
                seen, candidates = self._waiting.get(study_id, (0, set()))
                candidates.update(t for t in ids[seen:] if not trials[t].state.is_finished())
                candidates = {t for t in candidates if not trials[t].state.is_finished()}
                self._waiting[study_id] = (len(ids), candidates)
                out = [trials[t] for t in sorted(candidates) if trials[t].state == TrialState.WAITING]
            if deepcopy:
                return copy.deepcopy(out)
            self._handouts += 1  # handed out as they are: each one's next value copies it
            return out


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
