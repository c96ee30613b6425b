"""Process helpers shared by the engines (stdlib only: safe in any process).

- ``tail``, ``describe_exit``: a log's end, an exit code in words.
- Process trees without scanning the machine: ``descendants`` reads the kernel's list of each
  process's children (``/proc/<pid>/task/<tid>/children``, Linux with ``CONFIG_PROC_CHILDREN``), so
  its cost grows with the tree, not with the number of processes on the machine (psutil's
  ``children()`` reads the stat file of every process; it is the fallback where the list is absent).
- ``become_subreaper``: orphaned descendants (a double fork with ``setsid``) are reparented to this
  process instead of init, so they stay in its tree; ``reap_descendants`` kills and reaps that tree
  (a local worker after every trial); ``kill_tree`` freezes another process's tree, then kills it
  (the engine retiring a worker).
- ``start_without_main``: processes that ``multiprocessing`` starts (spawn, forkserver) under a name
  beginning with ``hpoflow-`` do not run the parent's ``__main__`` first.
- ``sigint_blocked``, ``unblock_sigint``: the helper processes a driver starts (the forkserver, what it
  forks, spawned workers) start with SIGINT blocked, so a terminal's Ctrl-C, sent to the whole process
  group, reaches only the driver, which stops them itself; a worker unblocks it once it leads a session
  of its own.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from hpoflow.trial import describe_exit  # re-exported: an exit code in words, for every process of a trial

__all__ = ["become_subreaper", "descendants", "describe_exit", "kill_tree", "reap_descendants",
           "sigint_blocked", "start_without_main", "tail", "unblock_sigint"]

_PR_SET_CHILD_SUBREAPER = 36
_FREEZE_ROUNDS = 50  # a tree that still grows after this many stop rounds is killed as it is


def tail(path: Path, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


# -- process trees ----------------------------------------------------------------------------------
_children_listed: bool | None = None  # whether this kernel lists children in /proc (checked once)


def _kernel_lists_children() -> bool:
    global _children_listed
    if _children_listed is None:
        _children_listed = os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children")
    return _children_listed


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (zombies included); [] if it is gone."""
    if not _kernel_lists_children():
        try:
            import psutil

            return [c.pid for c in psutil.Process(pid).children()]
        except Exception:  # gone, or psutil missing: nothing to list
            return []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    out: list[int] = []
    for tid in tids:  # each thread lists the children it forked (and the orphans given to it)
        try:
            with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                out.extend(int(x) for x in f.read().split())
        except OSError:  # the thread exited meanwhile
            continue
    return out


def descendants(pid: int) -> list[int]:
    """The pids of every process below ``pid`` (children first; zombies included)."""
    out: list[int] = []
    frontier = [pid]
    while frontier:
        kids = [c for p in frontier for c in children(p)]
        out.extend(kids)
        frontier = kids
    return out


def _alive(pid: int) -> bool:
    """Not gone and not a zombie (the state letter after the command name in ``/proc/<pid>/stat``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[:1]
    except OSError:
        return False
    return state not in ([b"Z"], [b"X"], [])


def become_subreaper() -> bool:
    """Linux: make this process the reaper of its orphaned descendants (``PR_SET_CHILD_SUBREAPER``):
    a process that double-forks and calls ``setsid`` stays below it instead of moving to init. False
    where the kernel or libc refuses."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _reap_children() -> None:
    """Collect the exit status of every child of this process that has ended."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def reap_descendants(timeout_s: float = 5.0) -> int:
    """SIGKILL every process below this one and reap them; the number killed. With
    ``become_subreaper`` every descendant ends up a child of this process when its parent dies, so
    the loop ends with none left (or after ``timeout_s``: a process stuck in the kernel)."""
    me = os.getpid()
    killed: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while True:
        tree = descendants(me)
        if not tree:
            return len(killed)
        live = [p for p in tree if _alive(p)]
        for p in live:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        killed.update(live)
        _reap_children()
        if time.monotonic() > deadline:
            return len(killed)
        if live:
            time.sleep(0.001)  # SIGKILL is delivered; the kernel tears the processes down


def kill_tree(pid: int) -> None:
    """Stop ``pid`` and every process below it (round by round, until a round finds none new), then
    SIGKILL them all and ``pid``'s process group: nothing forks in between, and a descendant that
    left the group with ``setsid`` dies too. The caller reaps ``pid`` if it is its child."""
    stopped: list[int] = []
    seen: set[int] = set()
    for _ in range(_FREEZE_ROUNDS):
        new = [p for p in (pid, *descendants(pid)) if p not in seen]
        if not new:
            break
        for p in new:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGSTOP)
        seen.update(new)
        stopped.extend(new)
    for p in stopped:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)


# -- children that never run __main__ --------------------------------------------------------------
_PREFIX = "hpoflow-"
_MAIN_KEYS = ("init_main_from_name", "init_main_from_path")


def start_without_main() -> None:
    """Processes started by ``multiprocessing`` (spawn and forkserver start methods) whose name begins
    with ``hpoflow-`` skip the parent's ``__main__``: by default each re-runs the main script (or
    module) before its target, which fails for a script on stdin (``FileNotFoundError: '<stdin>'``),
    runs an unguarded script's study again in every worker, and costs the script's imports.
    Their targets (``hpoflow`` functions) never need it. Wraps
    ``multiprocessing.spawn.get_preparation_data`` once, keyed on the process name; processes with
    other names are started as before."""
    from multiprocessing import spawn

    original: Callable[[str], dict[str, Any]] = spawn.get_preparation_data
    if getattr(original, "_hpoflow", False):
        return

    def get_preparation_data(name: str) -> dict[str, Any]:
        data = original(name)
        if str(name).startswith(_PREFIX):
            for key in _MAIN_KEYS:
                data.pop(key, None)
        return data

    get_preparation_data._hpoflow = True  # type: ignore[attr-defined]
    spawn.get_preparation_data = get_preparation_data


# -- Ctrl-C reaches the driver only --------------------------------------------------------------------
@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """Block SIGINT in the calling thread while it starts a process: the process starts with SIGINT
    blocked (a signal mask survives ``fork`` and ``exec``), and so does everything it forks. A terminal's
    Ctrl-C goes to every process of the foreground group; without this the forkserver (importing torch)
    and the oracle service died of it with a ``KeyboardInterrupt`` traceback, and the driver restarted
    them in the middle of its stop. The driver stops its helpers itself. Only the start is wrapped:
    a thread that waits with SIGINT blocked would run the driver's handler late. multiprocessing's
    resource tracker is started first: starting it unblocks SIGINT in the calling thread (it blocks the
    signal around its own start the same way)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, ())  # (already, by the caller)
    try:  # (the block inside the try: a KeyboardInterrupt just after it must not leave SIGINT blocked)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        yield
    finally:
        if not blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def unblock_sigint() -> None:
    """Undo ``sigint_blocked`` in a process that has left the driver's process group (a worker after
    ``setsid``): the trials it runs, and what they start, see SIGINT as any process does. A Ctrl-C that
    came while it was still in the driver's group is discarded (ignoring a signal drops it if pending),
    not delivered now."""
    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    signal.signal(signal.SIGINT, handler)
