"""Storage credentials out of reach of trial code (standard library only).

Trial code runs as the same user as the driver, in processes the driver starts (workers, the
forkserver, the oracle's service, ``srun``), which inherit its environment; and every process of that
user can read the driver's *initial* environment and command line in ``/proc/PID/environ`` and
``/proc/PID/cmdline`` (``ps`` shows the command line to every user). So:

- ``take_env(name)`` reads a variable that holds a storage URL (``storage_env``), removes it from
  ``os.environ`` and overwrites its value in the process's initial environment block, and keeps the
  value in this process's memory: later calls answer from there, so the driver can reopen its
  storage (after an outage) while no process started afterwards ever sees it.
- ``hold(url)`` keeps a URL's password known (a ``storage:`` URL written in a spec, a ``--storage`` argument),
  ``scrub(env)`` removes from an environment every variable taken, and any other whose value holds a
  kept password or URL; ``scrub_environ()`` does that to ``os.environ`` (before processes start).
- ``wipe_argv(text)`` overwrites ``text`` (a password given on the command line) in the process's
  initial command line, so ``ps`` shows ``***`` from then on (not before: say so to the user).
- ``scrub(env, any_database_url=True)`` also removes variables holding a database URL with a password
  (``postgresql://user:pw@host/db``, ``mysql://...``): for rank processes started where nothing was
  taken (a COMPSs worker inherits the batch job's environment, not the driver's).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from collections.abc import MutableMapping
from pathlib import Path
from urllib.parse import urlsplit

__all__ = ["hold", "password_of", "scrub", "scrub_environ", "take_env", "wipe_argv"]

_lock = threading.Lock()
_TAKEN: dict[str, str] = {}  # variable name -> value, taken out of os.environ
_KEPT: set[str] = set()  # URLs and passwords that no variable of a trial's environment may hold
_MIN_SECRET = 4  # shorter passwords would match unrelated values; their URLs still match whole
_DB_URL = re.compile(r"\b(postgres(ql)?|mysql|mariadb|oracle|mssql|cockroachdb|redis)(\+[\w.-]+)?://[^/\s:@]*:[^/\s@]+@",
                     re.IGNORECASE)


def password_of(url: str | None) -> str | None:
    """The password in a URL (``scheme://user:PASSWORD@host``), or None."""
    if not url or "://" not in url:
        return None
    try:
        return urlsplit(url).password or None
    except ValueError:
        return None


def hold(url: str | None) -> None:
    """Keep a URL with a password known, so ``scrub`` removes any variable holding it or its password
    (anything else, a journal path or a URL without a password, is no secret: ignored)."""
    pw = password_of(url)
    if not url or pw is None:
        return
    with _lock:
        _KEPT.add(url)
        if len(pw) >= _MIN_SECRET:
            _KEPT.add(pw)


def take_env(name: str) -> str | None:
    """The value of environment variable ``name`` (None when unset or empty), taken out of the
    environment on first read and kept in memory (module docstring)."""
    value = os.environ.get(name)
    with _lock:
        if value:
            _TAKEN[name] = value
        value = _TAKEN.get(name)
    if value:
        hold(value)
        scrub_environ()
    return value


def _secret_holders(env: MutableMapping[str, str], any_database_url: bool) -> list[str]:
    with _lock:
        names, kept = set(_TAKEN), tuple(_KEPT)
    out = []
    for key, value in list(env.items()):
        if key in names or any(s in value for s in kept) or (any_database_url and _DB_URL.search(value)):
            out.append(key)
    return out


def scrub(env: MutableMapping[str, str], *, any_database_url: bool = False) -> list[str]:
    """Remove from ``env`` every variable taken by ``take_env`` and every one whose value holds a kept URL
    or password (``any_database_url``: or any database URL with a password); the names removed."""
    names = _secret_holders(env, any_database_url)
    for key in names:
        env.pop(key, None)
    return names


def scrub_environ() -> list[str]:
    """``scrub(os.environ)``, and the removed values overwritten in the initial environment block."""
    values = [os.environ[k] for k in _secret_holders(os.environ, False) if k in os.environ]
    names = scrub(os.environ)
    for value in values:
        _overwrite(value, env=True)
    return names


def wipe_argv(text: str) -> bool:
    """Overwrite ``text`` with ``*`` in the process's initial command line (what ``ps`` shows); True if
    it was found there."""
    return _overwrite(text, env=False)


def _overwrite(text: str, *, env: bool) -> bool:
    """Overwrite every copy of ``text`` in this process's initial environment (``env``) or argument
    strings with ``*``: the memory ``/proc/self/stat`` fields 48-51 locate (Linux >= 3.5). Those strings
    are no longer referenced once a variable is unset (CPython keeps its own copies of argv)."""
    needle = text.encode(errors="surrogateescape")
    if not needle:
        return False
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        arg_start, arg_end, env_start, env_end = (int(fields[i - 3]) for i in (48, 49, 50, 51))
    except (OSError, ValueError, IndexError):
        return False
    start, end = (env_start, env_end) if env else (arg_start, arg_end)
    if not 0 < start < end or end - start > 1 << 24:
        return False
    data = ctypes.string_at(start, end - start)
    found = False
    i = data.find(needle)
    while i >= 0:
        ctypes.memset(start + i, ord("*"), len(needle))
        found = True
        i = data.find(needle, i + len(needle))
    return found
