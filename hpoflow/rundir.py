"""A run directory is one thing, however it is spelled.

``resolve(path)`` turns any spelling (relative, absolute, ``.``, ``~``, through a symlink) into one
absolute path, checked usable (a directory, writable), and every file of the run is located from that
path. ``RunLock`` keeps a second ``hpoflow run`` off a directory that one is using. ``redact`` keeps
passwords of storage URLs out of everything hpoflow writes or prints.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from hpoflow.errors import RunDirError

__all__ = ["LOCK_FILE", "RunLock", "redact", "resolve"]

LOCK_FILE = ".hpoflow.lock"


def resolve(path: str | os.PathLike[str], *, create: bool) -> Path:
    """The one absolute path of a run directory; ``RunDirError`` (one line, with the fix) when it is
    a file, cannot be created, or is not writable. ``create=False`` (readers) never creates it."""
    rd = Path(path).expanduser().resolve()
    if rd.exists() and not rd.is_dir():
        raise RunDirError(f"run directory {rd} is a file, not a directory. Fix: pass a directory as --run-dir")
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


def disk_error(exc: OSError, rd: Path) -> RunDirError:
    """A write into the run directory failed: the one-line error for it (full disk, read-only fs)."""
    what = {errno.ENOSPC: "the disk is full", errno.EROFS: "the file system is read-only",
            errno.EDQUOT: "the disk quota is exceeded", errno.EACCES: "permission denied"}
    why = what.get(exc.errno or 0, exc.strerror or str(exc))
    return RunDirError(f"cannot write to run directory {rd}: {why}. Fix: free space or choose another --run-dir")


class RunLock:
    """An exclusive lock on a run directory for as long as a study runs there (``flock`` on
    ``.hpoflow.lock``: released by the kernel when the process ends, even by SIGKILL)."""

    def __init__(self, rd: Path) -> None:
        self.path = rd / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> RunLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RunDirError(f"another hpoflow run (pid {holder}) is using {self.path.parent}. Fix: wait for it "
                              "to finish, stop it, or choose another --run-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

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
