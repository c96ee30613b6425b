"""Unix users for tests of what a node shared by several users does (``useradd``, root only).

``UnixUsers(k)`` makes ``k`` users named ``hpot<pid>u<i>`` (no home directory, a group of their own) and,
where this Python is out of their reach (a pyenv under ``/root``, mode 0700), lets them through the
directories on its way (``o+x`` only: they can reach the files beneath, not list the directory). ``close``
kills what runs as them (by pid), removes them and puts every directory's mode back; it also runs when
``open`` fails half way, and it is idempotent. ``sweep_stale_users`` removes the users of a session that
died without closing (its pid gone), as ``tests/infra/slurm.py`` sweeps clusters. What a user left in
``/dev/shm`` and the temp dir (its GPU lock directory, rendezvous directories) goes with it.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["UnixUsers", "sweep_stale_users", "unavailable_reason"]

_NAME = re.compile(r"hpot(\d+)u\d+")


def unavailable_reason() -> str | None:
    """Why users cannot be made here, or None."""
    if os.geteuid() != 0:
        return "not root (useradd)"
    missing = [tool for tool in ("useradd", "userdel", "setpriv") if shutil.which(tool) is None]
    return f"not installed: {', '.join(missing)}" if missing else None


def _kill_processes_of(uid: int) -> None:
    """SIGKILL every process running as ``uid`` (the test's own user: only what the test started)."""
    for _ in range(50):
        pids = []
        for proc in Path("/proc").iterdir():
            if proc.name.isdigit():
                with contextlib.suppress(OSError):
                    if proc.stat().st_uid == uid:
                        pids.append(int(proc.name))
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove_user(name: str) -> None:
    """Kill the user's processes, remove what it left in the node-local directories (``/dev/shm``, the
    temp dir: GPU lock and rendezvous directories), then the user."""
    try:
        uid = pwd.getpwnam(name).pw_uid
    except KeyError:
        return
    _kill_processes_of(uid)
    for base in {Path("/dev/shm"), Path(tempfile.gettempdir()), Path("/tmp")}:
        with contextlib.suppress(OSError):
            for entry in base.iterdir():
                with contextlib.suppress(OSError):
                    if entry.lstat().st_uid != uid:
                        continue
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry, ignore_errors=True)
                    else:
                        entry.unlink()
    subprocess.run(["userdel", name], capture_output=True, timeout=60, check=False)


def sweep_stale_users() -> list[str]:
    """Remove the users an earlier session made and did not remove (its pid is dead); their names."""
    swept = []
    for entry in pwd.getpwall():
        m = _NAME.fullmatch(entry.pw_name)
        if m and int(m.group(1)) != os.getpid():
            try:
                os.kill(int(m.group(1)), 0)
                continue
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
            _remove_user(entry.pw_name)
            swept.append(entry.pw_name)
    return swept


class UnixUsers:
    """``k`` users for one test; ``names``, ``uids``, ``gids`` once open. See the module docstring."""

    def __init__(self, k: int) -> None:
        self.names = [f"hpot{os.getpid()}u{i}" for i in range(k)]
        self.uids: list[int] = []
        self.gids: list[int] = []
        self._made: list[str] = []
        self._modes: dict[Path, int] = {}  # directory -> its mode before we let the users through

    def open(self, reach: Sequence[Path] = ()) -> UnixUsers:
        """Make the users and let them reach this Python and each of ``reach``; undone if it fails."""
        try:
            sweep_stale_users()
            for name in self.names:
                subprocess.run(["useradd", "--no-create-home", "--user-group", "--shell", "/bin/sh", name],
                               capture_output=True, text=True, timeout=60, check=True)
                self._made.append(name)
                entry = pwd.getpwnam(name)
                self.uids.append(entry.pw_uid)
                self.gids.append(entry.pw_gid)
            for path in [Path(sys.prefix), Path(sys.base_prefix), *reach]:
                for d in [path.resolve(), *path.resolve().parents]:
                    mode = d.stat().st_mode
                    if not mode & 0o001 and d not in self._modes:
                        self._modes[d] = mode & 0o7777
                        d.chmod((mode & 0o7777) | 0o001)
        except BaseException:
            self.close()
            raise
        return self

    def argv(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run as user ``i`` (``setpriv``: the environment passes as it is)."""
        return ["setpriv", f"--reuid={self.uids[i]}", f"--regid={self.gids[i]}", "--init-groups", "--", *argv]

    def own(self, i: int, path: Path) -> Path:
        """``path`` made a directory of user ``i`` (mode 0700)."""
        path.mkdir(parents=True, exist_ok=True)
        os.chown(path, self.uids[i], self.gids[i])
        path.chmod(0o700)
        return path

    def close(self) -> None:
        for d, mode in self._modes.items():
            with contextlib.suppress(OSError):
                d.chmod(mode)
        self._modes.clear()
        for name in self._made:
            _remove_user(name)
        self._made.clear()

    def __enter__(self) -> UnixUsers:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()
