"""Where a trial's ranks meet (standard library only).

- A single-host trial meets through a file store (``store_path``) in a directory only this user can
  read (``private_dir``): no socket listens for the rendezvous at all, so nothing on another address
  can reach it and there is no port to race for; its gloo/NCCL pairs are bound to loopback
  (``LOOPBACK_ENV``). The creating process holds a ``flock`` on the directory while it uses it; the
  kernel drops the lock when that process dies, even by SIGKILL, so ``sweep_private_dirs`` (run by
  every ``private_dir`` call) removes the directories of dead processes instead of leaving them in
  /dev/shm.
- A multi-node trial meets over TCP at ``master_addr:master_port``; ranks other than 0 wait here for
  rank 0's store before joining, so none falls into the store client's retry back-off.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import time

__all__ = ["LOOPBACK_ENV", "free_port", "private_dir", "remove_private_dir", "store_path", "sweep_private_dirs",
           "wait_for_master"]

_PREFIX = "hpoflow-rdzv-"
_LOCKED = "flock-"  # after the prefix: a directory whose creator holds its flock (older ones hold none)
_MIN_AGE_S = 60.0  # a directory younger than this may be one another process is about to lock
_LOCKS: dict[str, int] = {}  # private_dir -> the descriptor holding its flock, in this process

# Single-host trials: gloo and NCCL open their pair/bootstrap sockets on loopback only.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def _base() -> str | None:
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None


def private_dir(prefix: str = _PREFIX) -> str:
    """A fresh directory for rendezvous files, readable by this user only (mode 0700), locked by this
    process until ``remove_private_dir``; stale ones of dead processes are swept first."""
    import tempfile

    sweep_private_dirs(prefix=prefix)
    for path in [p for p in _LOCKS if not os.path.isdir(p)]:  # removed by a caller with rmtree
        with contextlib.suppress(OSError):
            os.close(_LOCKS.pop(path))
    path = tempfile.mkdtemp(prefix=prefix + _LOCKED, dir=_base())
    try:
        import fcntl

        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        _LOCKS[path] = fd
    except (ImportError, OSError):  # no flock here: the directory is removed by its engine only
        pass
    return path


def remove_private_dir(path: str) -> None:
    """Remove a ``private_dir`` and release its lock."""
    shutil.rmtree(path, ignore_errors=True)
    fd = _LOCKS.pop(path, None)
    if fd is not None:
        with contextlib.suppress(OSError):
            os.close(fd)


def sweep_private_dirs(prefix: str = _PREFIX, min_age_s: float = _MIN_AGE_S) -> list[str]:
    """Remove this user's locked rendezvous directories that no live process holds any more (their
    creator died without removing them, e.g. a driver killed with SIGKILL) and that are older than
    ``min_age_s``; the paths removed. Directories made without a lock (by older versions) are left
    alone: nothing tells whether their process still uses them."""
    try:
        import fcntl
    except ImportError:
        return []
    base = _base()
    if base is None:
        import tempfile

        base = tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(base) if n.startswith(prefix + _LOCKED)]
    except OSError:
        return []
    now = time.time()
    for name in names:
        path = os.path.join(base, name)
        if path in _LOCKS:
            continue
        try:
            st = os.lstat(path)
            if st.st_uid != os.getuid() or now - st.st_mtime < min_age_s or not os.path.isdir(path):
                continue
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held: its process is alive
            os.close(fd)
            continue
        shutil.rmtree(path, ignore_errors=True)
        os.close(fd)
        removed.append(path)
    return removed


def store_path(directory: str, number: int, attempt: int) -> str:
    """A file store path for one attempt of one trial, never used before (a retry gets its own)."""
    path = os.path.join(directory, f"trial{number}-attempt{attempt}-{os.urandom(4).hex()}.store")
    return path


def wait_for_master(addr: str, port: int, timeout_s: float, poll_s: float = 0.002) -> None:
    """Block until rank 0's store accepts connections (or ``timeout_s`` passes).

    A rank that reaches the store before rank 0 has opened it falls into the store client's retry
    back-off and joins up to ~0.75 s late; polling the port every 2 ms joins within milliseconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=0.5):
                return
        except OSError:
            time.sleep(poll_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
