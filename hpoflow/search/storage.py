"""Where a study lives: an Optuna journal file in the run directory by default, or any Optuna URL.

The journal file is Optuna's own format (``JournalFileBackend``): plain Optuna, optuna-dashboard
and other processes open it; appends are locked, so it also works on a shared file system.
"""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock

__all__ = ["DEFAULT_JOURNAL", "open_storage", "storage_label"]

DEFAULT_JOURNAL = "study.journal"


def storage_label(storage: str | None, run_dir: Path) -> str:
    """The storage as a user would name it: a URL, or the journal file's path."""
    if storage is None:
        return str(run_dir / DEFAULT_JOURNAL)
    if storage.startswith("sqlite:///") and not storage.startswith("sqlite:////"):
        rel = storage.removeprefix("sqlite:///")
        if not Path(rel).is_absolute():
            return f"sqlite:///{(run_dir / rel).resolve()}"
    return storage


def open_storage(storage: str | None, run_dir: Path) -> optuna.storages.BaseStorage:
    """Open the study's storage. ``None`` or a ``*.journal``/``*.log`` path is a journal file
    (relative to the run directory); anything else is an Optuna storage URL."""
    label = storage_label(storage, run_dir)
    if "://" not in label:
        path = Path(label)
        if not path.is_absolute():
            path = run_dir / path
        path.parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(str(path), lock_obj=JournalFileOpenLock(str(path))))
    if label.startswith("sqlite"):
        return optuna.storages.RDBStorage(label, engine_kwargs={"connect_args": {"timeout": 60}})
    return optuna.storages.RDBStorage(label)
