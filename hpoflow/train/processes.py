"""A trial's process as a program's main process: what a trial may start, and how a warm program ends.

A trial's rank runs in a process that is not a fresh interpreter: a local engine's worker (a
``multiprocessing`` child, daemonic, forked from the engine's forkserver or spawned) or the warm
zygote of a command trial (``hpoflow.train.command``: an ``os.fork`` of such a worker). Training code
starts processes of its own: ``DataLoader(num_workers=N)``, ``torch.multiprocessing.spawn``,
``multiprocessing.Pool``, ``mp.Process``. ``multiprocessing`` refuses that in a daemonic process
("daemonic processes are not allowed to have children") and keeps the parent's resource tracker and
forkserver descriptors, which the zygote closes (the first spawn-context primitive then fails with
``EBADF``, or writes into whatever the program opened under that number).

``become_main_process`` gives the process multiprocessing's state as ``python`` gives a program's main
process: a main process object (not daemonic, no parent, its own authkey), no children, no resource
tracker and no forkserver yet (the first use starts its own, below this process, so it ends with the
trial: the local engine's worker reaps every descendant of a trial, and the zygote's program runs in a
process group that is killed with the rank), the default start method not yet chosen (a trial may call
``set_start_method``), and in the zygote none of the worker's finalizers. The worker calls it before
each trial, the zygote before the program.

``end_like_an_interpreter`` ends a warm program as ``python`` ends one once its main code is done:
non-daemon threads are joined (at most ``EXIT_THREADS_S`` seconds in all: a fresh interpreter would
wait for ever, a trial must end), then the ``atexit`` handlers run (the program's and those of the
libraries it uses, registered when they were imported), and the standard streams are flushed. Module
globals are never torn down (the caller ends with ``os._exit``), as an interpreter's finalisation
leaves a program's objects alone until its threads and handlers are done.

``keep_process_groups`` keeps every process group the program destroys referenced until the process
ends. A ``DistributedDataParallel`` wrapper that outlives ``destroy_process_group()`` holds the group;
when the wrapper is freed (its function returns, ``del net``), the group's last reference goes with it,
and gloo's destructor joins its worker threads with the GIL held (pybind11 frees the reducer without
releasing it), while a worker thread that is still dropping the last collective's work needs the GIL to
free a tensor: a deadlock (torch 2.13; native stacks ``Reducer::~Reducer`` -> ``~ProcessGroupGloo`` ->
``thread::join`` against ``AsyncWork::~AsyncWork`` -> ``gil_scoped_acquire``), about one warm trial in
three of such a script on 2 loaded cores. With the group still referenced, freeing the wrapper destroys
no group; the process ends with ``os._exit``, which runs no destructor.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import multiprocessing.process
import os
import sys
import threading
import time
from typing import Any

__all__ = ["EXIT_THREADS_S", "become_main_process", "end_like_an_interpreter", "forget_finalizers",
           "keep_process_groups"]

EXIT_THREADS_S = 60.0  # the longest a warm program's non-daemon threads are waited for at its end


class _MainProcess(multiprocessing.process.BaseProcess):
    """The object ``multiprocessing.current_process()`` is in a program's main process (multiprocessing's
    own class of it is deleted once its module made the one it needs)."""

    def __init__(self) -> None:  # (BaseProcess.__init__ is for a child to start: not called)
        self._identity = ()
        self._name = "MainProcess"
        self._parent_pid = None
        self._popen = None
        self._closed = False
        self._config = {"authkey": getattr(multiprocessing.process, "AuthenticationString")(os.urandom(32)),  # noqa: B009
                        "semprefix": "/mp"}

    def close(self) -> None:
        pass


def become_main_process(*, inherited_fds_closed: bool = False) -> None:
    """Reset ``multiprocessing``'s per-process state to a fresh main process's (see the module docstring).
    ``inherited_fds_closed``: the process closed the descriptors it inherited (the zygote did): the old
    resource tracker's is not closed again (its number may be the program's by now). Otherwise the
    resource tracker descriptor of an earlier trial or of the engine is closed here."""
    import multiprocessing.context as mp_context
    import multiprocessing.process as mp_process
    from multiprocessing import forkserver, resource_tracker

    mp_process._current_process = _MainProcess()  # type: ignore[attr-defined]
    mp_process._parent_process = None  # type: ignore[attr-defined]
    mp_process._process_counter = itertools.count(1)  # type: ignore[attr-defined]
    mp_process._children = set()  # type: ignore[attr-defined]
    tracker: Any = getattr(resource_tracker, "_resource_tracker")  # noqa: B009
    fd = getattr(tracker, "_fd", None)
    if fd is not None and not inherited_fds_closed:
        with contextlib.suppress(OSError):
            os.close(fd)
    tracker._fd = None
    tracker._pid = None
    server: Any = getattr(forkserver, "_forkserver")  # noqa: B009
    # The engine's forkserver's alive descriptor stays open in a worker (multiprocessing keeps it in every
    # process that forkserver forked); forgetting it here only makes this process start its own.
    server._forkserver_address = None
    server._forkserver_alive_fd = None
    server._forkserver_pid = None
    server._inherited_fds = None
    server._preload_modules = ["__main__"]
    mp_context._default_context._actual_context = None  # type: ignore[attr-defined]


def forget_finalizers() -> None:
    """Drop ``multiprocessing``'s finalizers this process inherited (the worker's objects: not the
    program's, and never to run in its process)."""
    from multiprocessing import util

    util._finalizer_registry.clear()  # type: ignore[attr-defined]  # (cleared, not rebound: Finalize holds it)


def end_like_an_interpreter(wait_s: float = EXIT_THREADS_S) -> None:
    """Join the non-daemon threads (``wait_s`` in all), run the ``atexit`` handlers, flush the standard
    streams (see the module docstring). A thread still running after ``wait_s`` is named on stderr."""
    end = time.monotonic() + wait_s
    me = threading.current_thread()
    for t in threading.enumerate():
        if t is me or t.daemon:
            continue
        t.join(max(0.0, end - time.monotonic()))
    left = [t.name for t in threading.enumerate() if t is not me and not t.daemon and t.is_alive()]
    if left:
        print(f"hpoflow: the program's main code has returned, but {len(left)} non-daemon thread(s) still ran "
              f"{wait_s:g} s later ({', '.join(left)}); the program ends without them (a fresh interpreter would "
              "wait for them)", file=sys.stderr)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


_KEPT: list[object] = []  # process groups the program destroyed, referenced until the process ends


def keep_process_groups() -> None:
    """Make ``torch.distributed.destroy_process_group`` keep a reference to each group it destroys (see
    the module docstring); it does all it did before. Call once, before the program runs, in a process
    that ends with ``os._exit``. Nothing where torch.distributed is not available."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
    except ImportError:
        return
    if not dist.is_available():
        return
    original = c10d.destroy_process_group
    if getattr(original, "__hpoflow_keeps__", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> None:
        world = getattr(c10d, "_world", None)
        groups = list(getattr(world, "pg_map", {})) if group is None or group is c10d.GroupMember.WORLD \
            else [group]
        _KEPT.extend(groups)
        original(group)

    destroy_process_group.__hpoflow_keeps__ = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group
    dist.destroy_process_group = destroy_process_group
