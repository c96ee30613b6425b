"""multiprocessing's forkserver (one per process), as the local engine starts, checks and stops it.

- ``ensure_forkserver`` starts it with SIGINT blocked (``hpoflow.engines.proc.sigint_blocked``): a
  terminal's Ctrl-C never kills it in the middle of its torch preload, nor anything it forks (the
  workers, the oracle service). Call it before every ``start()`` of a forkserver process.
- ``stop_forkserver`` kills it and reaps it, holding multiprocessing's own lock, so the process it
  waits for is the one it killed. (Killing the pid read first and then calling the server's ``_stop``
  could wait for a forkserver that another thread started meanwhile, which exits only once every
  process it forked has: that hung ``hpoflow run`` for good on a Ctrl-C during start-up.)
- ``kill_forkserver`` only sends SIGKILL: safe in a signal handler, which must take no lock. A fork
  request waiting on the preload then fails at once.
- ``use_preload`` sets what it imports before it forks.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import threading
from typing import Any

from hpoflow.engines.proc import sigint_blocked

__all__ = ["ensure_forkserver", "forkserver_stopped", "kill_forkserver", "running_with", "stop_forkserver",
           "use_preload"]


def _server() -> Any:
    from multiprocessing import forkserver

    return getattr(forkserver, "_forkserver", None)


def ensure_forkserver() -> bool:
    """Start the forkserver if none runs, with SIGINT blocked (see the module docstring); True if this
    call started it."""
    from multiprocessing import forkserver

    before = getattr(_server(), "_forkserver_pid", None)
    with sigint_blocked():
        forkserver.ensure_running()
    pid = getattr(_server(), "_forkserver_pid", None)
    return pid is not None and pid != before


def kill_forkserver() -> None:
    """SIGKILL the forkserver if one runs; nothing else (no lock, no wait: a signal handler may call it).
    The next ``ensure_forkserver`` reaps it and starts another."""
    pid = getattr(_server(), "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def stop_forkserver() -> None:
    """Kill the forkserver and reap it (it is dead, answers nothing, preloads what nobody needs any more,
    or preloads the wrong modules); the next ``ensure_forkserver`` starts a new one."""
    server = _server()
    lock = getattr(server, "_lock", None)
    if server is None or lock is None:
        return
    with lock:  # the forkserver this kills is the one reaped below (see the module docstring)
        pid = getattr(server, "_forkserver_pid", None)
        if not pid:
            return
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        stop = getattr(server, "_stop_unlocked", None)
        if callable(stop):
            with contextlib.suppress(OSError, ChildProcessError):
                stop()


def forkserver_stopped() -> bool:
    """Whether the forkserver was stopped under a fork in progress (another engine of this process closed
    while its forkserver preloaded): the fork then fails with a TypeError (no fd)."""
    return getattr(_server(), "_forkserver_alive_fd", 0) is None


def running_with(preload: list[str]) -> bool:
    """Whether this process's forkserver runs, started with ``preload`` (an earlier engine's, which a closed
    engine leaves once it has preloaded: the next engine's workers fork from it in milliseconds)."""
    server = _server()
    return (getattr(server, "_forkserver_pid", None) is not None and not forkserver_stopped()
            and list(getattr(server, "_preload_modules", ())) == preload)


_PRELOAD_LOCK = threading.Lock()


def use_preload(preload: list[str]) -> None:
    """Set the forkserver's preload. One that runs already with another preload (started by other code
    of this process first, e.g. a ``forkserver`` context's ``Process`` in a notebook or a test, with
    multiprocessing's default) would fork "warm" workers without torch: it is stopped, and the next fork
    starts one with ``preload`` (the processes the old one forked go on). One started with this preload
    (by an engine, or by anything forking after an engine set it) is kept."""
    with _PRELOAD_LOCK:
        server = _server()
        running = getattr(server, "_forkserver_pid", None) is not None
        if running and list(getattr(server, "_preload_modules", preload)) != preload:
            stop_forkserver()
        mp.get_context("forkserver").set_forkserver_preload(preload)
