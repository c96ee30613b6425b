"""A run directory is one thing, however it is spelled.

``resolve(path)`` turns any spelling (relative, absolute, ``.``, ``~``, through a symlink) into one
absolute path, checked usable (a directory, writable), and every file of the run is located from that
path. ``RunLock`` keeps a second ``hpoflow run`` off a directory that one is using. ``redact`` keeps
passwords of storage URLs out of everything hpoflow writes or prints. ``status.json`` is a snapshot of
``hpoflow status`` written when a run ends: read back while the journal has not changed since, it
answers ``status`` without opening the storage (Optuna's import alone takes longer than the answer).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from hpoflow.errors import RunDirError
from hpoflow.fileio import write_atomic

__all__ = ["LOCK_FILE", "STATUS_FILE", "RunLock", "disk_error", "disk_errors", "disk_why", "locate",
           "read_status_snapshot", "redact", "resolve", "write_status_snapshot"]

LOCK_FILE = ".hpoflow.lock"
STATUS_FILE = "status.json"
_SNAPSHOT_FORMAT = 2  # 2: status holds the interrupted trials


def locate(path: str | os.PathLike[str]) -> Path:
    """The one absolute path of a run directory, touching nothing; ``RunDirError`` (one line, with the
    fix) when it cannot be resolved or is a file. ``resolve`` checks more."""
    try:
        rd = Path(path).expanduser().resolve()
        exists = rd.exists()
    except (OSError, RuntimeError, ValueError) as exc:  # a symlink loop, ~nouser, a NUL, a name too long
        why = "a symlink loop" if "loop" in str(exc).lower() or getattr(exc, "errno", None) == errno.ELOOP \
            else (getattr(exc, "strerror", None) or str(exc))
        raise RunDirError(f"run directory {os.fsdecode(path)!r} cannot be resolved: {why.rstrip('.')}. Fix: pass a "
                          "directory path that exists or can be created (check its symlinks)") from None
    if exists and not rd.is_dir():
        raise RunDirError(f"run directory {rd} is a file, not a directory. Fix: pass a directory as --run-dir")
    return rd


def resolve(path: str | os.PathLike[str], *, create: bool) -> Path:
    """The one absolute path of a run directory (``locate``); ``RunDirError`` (one line, with the fix)
    also when it cannot be created or is not writable. ``create=False`` (readers) never creates it."""
    rd = locate(path)
    if not create:
        if not rd.is_dir():
            raise RunDirError(f"{rd} does not exist. Fix: pass the --run-dir of a run")
        return rd
    try:
        rd.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create run directory {rd}: {exc.strerror or exc}. Fix: choose a --run-dir "
                          "you can write to") from None
    if not os.access(rd, os.W_OK | os.X_OK):
        raise RunDirError(f"run directory {rd} is not writable. Fix: choose a --run-dir you can write to, or "
                          "fix its permissions")
    return rd


def disk_why(exc: OSError) -> str:
    """Why a write failed, in a few words (the disk is full, ...)."""
    what = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
            errno.EDQUOT: "the disk quota is exceeded", errno.EACCES: "permission denied"}
    return what.get(exc.errno or 0, exc.strerror or str(exc))


def disk_error(exc: OSError, rd: Path) -> RunDirError:
    """A write into the run directory failed: the one-line error for it (full disk, read-only fs)."""
    return RunDirError(f"cannot write to run directory {rd}: {disk_why(exc)}. Fix: free space or choose another "
                       "--run-dir")


@contextlib.contextmanager
def disk_errors(rd: Path) -> Iterator[None]:
    """A failed write into ``rd`` (``OSError``) becomes ``disk_error``'s one line (exit code 2)."""
    try:
        yield
    except OSError as exc:
        raise disk_error(exc, rd) from None


class RunLock:
    """An exclusive lock on a run directory for as long as a study runs there (``flock`` on
    ``.hpoflow.lock``: released by the kernel when the process ends, even by SIGKILL)."""

    def __init__(self, rd: Path) -> None:
        self.path = rd / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError as exc:
            raise disk_error(exc, self.path.parent) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(f"another hpoflow run (pid {holder}) is using {self.path.parent}. Fix: wait for it "
                              "to finish, stop it, or choose another --run-dir") from None
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError as exc:  # a full disk: say so now, before anything else is written
            os.close(fd)
            raise disk_error(exc, self.path.parent) from None
        self._fd = fd
        return self

    def remove_dir(self) -> None:
        """Remove the lock file and the run directory if nothing else is in it (a run that stopped before
        writing anything, in a directory it created); held, so no other run is using it."""
        with contextlib.suppress(OSError):
            if all(p == self.path for p in self.path.parent.iterdir()):
                self.path.unlink()
                self.path.parent.rmdir()

    def __exit__(self, *exc: object) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def redact(url: str | None) -> str | None:
    """A storage URL with its password replaced by ``***`` (``user:***@host``); anything else as is."""
    if url is None or "://" not in url:
        return url
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def write_status_snapshot(rd: Path, journal: Path, status: dict[str, Any], table: dict[str, Any]) -> None:
    """Record what ``hpoflow status`` shows (``status``: its JSON; ``table``: title, columns, rows of
    strings) with the size of the study's ``journal`` file now; nothing for other storages."""
    try:
        size = journal.stat().st_size
    except OSError:
        return
    doc = {"format": _SNAPSHOT_FORMAT, "journal": journal.name, "journal_bytes": size, "status": status,
           "table": table}
    write_atomic(rd / STATUS_FILE, json.dumps(doc))


def read_status_snapshot(rd: Path) -> dict[str, Any] | None:
    """The run's status snapshot if it is current (the journal it names has exactly the size it had
    when the snapshot was written: no trial has started, reported or ended since), else None."""
    try:
        doc = json.loads((rd / STATUS_FILE).read_text())
        journal = rd / str(doc["journal"])
        if (doc.get("format") != _SNAPSHOT_FORMAT or Path(doc["journal"]).name != doc["journal"]
                or journal.stat().st_size != doc["journal_bytes"]):
            return None
        status, table = doc["status"], doc["table"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"status": status, "table": table} if isinstance(status, dict) and isinstance(table, dict) else None
