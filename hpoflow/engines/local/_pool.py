"""The local engine's worker pool: warm workers forked from a preloaded forkserver, light workers for
ranks that need no torch, and how each is started, handed out and retired.

A *warm* worker is forked from a ``multiprocessing`` forkserver that preloaded torch and hpoflow
(``PRELOAD``); forking one waits for that preload, which takes seconds, so the pool starts the
forkserver and one warm worker per core in a background thread (``start_warm``). A *light* worker is
a fresh interpreter without torch (spawned, ready in a fraction of a second) for a rank that
``needs_torch`` not, used while no warm worker is up; light workers retire once warm ones are.
``prestart`` starts either kind before any engine exists (``hpoflow run`` does, first thing) and the
next pool adopts them. Every worker leads its own process group and is the subreaper of what its
trials start; ``retire`` freezes and kills it with its whole tree (``hpoflow.engines.proc.kill_tree``).
No worker runs the parent's ``__main__`` (``start_without_main``): a script on stdin, a notebook, or
a script without a ``__main__`` guard start workers like any other. The pool's state is guarded by
``lock``; the engine calls it from one thread.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from hpoflow.credentials import scrub_environ
from hpoflow.engines.machine import GpuId
from hpoflow.engines.proc import kill_tree, start_without_main
from hpoflow.errors import EngineError

log = logging.getLogger(__name__)

__all__ = ["PRELOAD", "Worker", "WorkerPool", "prestart"]

PRELOAD = ["hpoflow.engines.local._preload"]  # torch and the trainer (its digits need no scikit-learn)
_PRELOAD_DONE = "hpoflow.engines.local._preload_done"  # always imported last (see that module)


def _preload_list(preload: list[str] | None) -> list[str]:
    return [*(PRELOAD if preload is None else preload), _PRELOAD_DONE]
KILL_GRACE_S = 2.0
_SPAWN_TRIES = 5  # a forkserver killed (again) while it preloads torch answers EOF: start another

# Processes started by ``prestart`` before any engine exists; the next pool adopts them.
_PRESTARTED: list[tuple[BaseProcess, Connection]] = []


@dataclass
class Worker:
    """A worker process; ``gpus`` is the GPU set it is bound to once it ran a GPU rank (CUDA cannot
    change devices in a process that initialised it). ``trial``/``rank``: what it runs now."""

    wid: int
    proc: BaseProcess
    conn: Connection
    gpus: tuple[GpuId, ...] | None = None
    trial: int | None = None
    rank: int = -1
    trials_run: int = 0
    light: bool = False  # a fresh interpreter without torch preloaded


def _light_context() -> Any:
    start_without_main()
    return mp.get_context("spawn")


def _start_light(ctx: Any, wid: int) -> tuple[BaseProcess, Connection]:
    from hpoflow.engines.local._worker import worker_main

    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=worker_main, args=(child, wid), name=f"hpoflow-worker{wid}", daemon=True)
    proc.start()
    child.close()
    return proc, parent


def prestart(light: int, preload: list[str] | None = None) -> None:
    """Start the local engine's processes before the engine itself, so they boot while the caller
    still imports and opens the study: ``light`` light workers for trials that need no torch, or else
    the forkserver (its torch preload takes seconds; started with light workers it would take a core
    from them and the driver just when they are needed). The next ``WorkerPool`` created in this
    process adopts them."""
    scrub_environ()  # a storage URL's variable or password never reaches a worker (hpoflow.credentials)
    if light <= 0:
        from multiprocessing import forkserver

        _use_preload(_preload_list(preload))
        forkserver.ensure_running()
        return
    ctx = _light_context()
    for i in range(light):
        _PRESTARTED.append(_start_light(ctx, -1 - i))


class WorkerPool:
    """At most one worker per core, warm or light, handed out by ``acquire`` and given back by
    ``release``; see the module docstring."""

    def __init__(self, n_cores: int, preload: list[str] | None = None, max_trials_per_worker: int = 0,
                 warm: bool = True) -> None:
        scrub_environ()  # the forkserver and spawned workers inherit os.environ: no storage secret in it
        self.n_cores = n_cores
        self.max_trials_per_worker = max_trials_per_worker
        start_without_main()
        self._ctx = mp.get_context("forkserver")
        _use_preload(_preload_list(preload))
        self._light_ctx = _light_context()
        self.lock = threading.RLock()
        self._idle_added = threading.Condition(self.lock)  # a worker the warm thread forked is idle
        self.warm_ready = threading.Event()  # a warm worker has been forked: the preload is done
        self.workers: dict[int, Worker] = {}
        self.idle: list[Worker] = []
        self._next_wid = 0
        self.closed = False
        while _PRESTARTED:  # light workers started by prestart() before this pool existed
            proc, conn = _PRESTARTED.pop()
            w = Worker(self._next_wid, proc, conn, light=True)
            self._next_wid += 1
            self.workers[w.wid] = w
            if len(self.idle) < n_cores:
                self.idle.append(w)
            else:
                self.retire(w)
        # Start the forkserver (its torch import) and one worker per core now, in the background,
        # while the driver sets up the study; the first submit waits only for what is not ready.
        # With light workers prestarted (a study of torch-free trials), only when a trial needs torch.
        self._warm = threading.Thread(target=self._prestart, args=(n_cores if warm else 0,), daemon=True)
        if not self.workers:
            self._warm.start()

    def alive(self, w: Worker) -> bool:
        """Whether ``w`` is still one of the pool's workers (not retired)."""
        return w.wid in self.workers

    def start_warm(self) -> None:
        """Start the forkserver and the warm workers if not started yet (a trial needs torch)."""
        if self._warm.ident is None:
            self._warm.start()

    def _prestart(self, n: int) -> None:
        """Start the forkserver and fork ``n`` warm workers (in the background: a fork waits for the
        preload, which must never hold the lock a submit needs); retire idle light workers as warm
        ones come up."""
        from multiprocessing import forkserver

        forkserver.ensure_running()
        while True:
            with self.lock:
                if self.closed or sum(not w.light for w in self.workers.values()) >= n:
                    break
            try:
                w = self._spawn(light=False)  # blocks until the forkserver has preloaded
            except EngineError:  # closed meanwhile; or no forkserver would start: submit says so
                break
            self.warm_ready.set()
            with self.lock:
                if self.closed:
                    self.retire(w)
                    break
                self.idle.append(w)
                self._idle_added.notify_all()
                light = [x for x in self.idle if x.light]
                if light:
                    self.idle.remove(light[0])
                    self.retire(light[0])
        self.warm_ready.set()

    def _spawn(self, light: bool) -> Worker:
        with self.lock:
            wid = self._next_wid
            self._next_wid += 1
        proc, parent = _start_light(self._light_ctx, wid) if light else self._fork_warm(wid)
        w = Worker(wid, proc, parent, light=light)
        with self.lock:
            self.workers[wid] = w
        return w

    def _fork_warm(self, wid: int) -> tuple[BaseProcess, Connection]:
        from hpoflow.engines.local._worker import worker_main

        parent, child = self._ctx.Pipe(duplex=True)
        for attempt in range(_SPAWN_TRIES):
            proc = self._ctx.Process(target=worker_main, args=(child, wid), name=f"hpoflow-worker{wid}",
                                     daemon=True)
            try:
                proc.start()
                break
            except (EOFError, ConnectionError, FileNotFoundError, TypeError) as exc:
                if isinstance(exc, TypeError) and not _forkserver_stopped():
                    raise
                if self.closed:  # close() stopped a forkserver still preloading: nothing to start
                    raise EngineError("the engine is closed") from exc
                # the forkserver died (an OOM kill, a stray signal) between multiprocessing's liveness
                # check and the fork request; the next start() notices and launches a new one
                log.warning("the local engine's forkserver is gone (%s: %s); starting a new one",
                            type(exc).__name__, exc)
                if attempt == _SPAWN_TRIES - 1:
                    raise EngineError(f"the local engine could not start a worker process: {exc}") from exc
                _restart_forkserver()
                time.sleep(0.2 * attempt)
        child.close()
        return proc, parent

    def acquire(self, gpus: tuple[GpuId, ...], needs_torch: bool) -> Worker:
        """An idle worker that may use ``gpus`` (same binding, or never bound): a warm one if any; a
        light one for a rank that ``needs_torch`` not, also started anew while no warm worker exists
        yet; else a new warm one. Call with ``lock`` held."""
        want = gpus or None

        def fits(w: Worker, exact: bool) -> bool:
            if exact:
                return w.gpus == want
            return w.gpus is None or want is None  # unbound; or a CPU rank, which any worker can run

        while True:
            for w in [w for w in self.idle if w.proc.exitcode is not None]:  # died while idle (killed)
                self.idle.remove(w)
                self.retire(w)
            for light in (False, True) if not needs_torch else (False,):
                for exact in (True, False):
                    for i, w in enumerate(self.idle):
                        if w.light == light and fits(w, exact):
                            return self.idle.pop(i)
            if not needs_torch and not self.warm_ready.is_set():
                return self._spawn(light=True)
            # The warm thread is forking the workers of the cores: wait for one rather than fork one
            # more beside them (a worker per core, never more: each holds its own memory).
            if not (self._warm.is_alive() and not self.closed
                    and sum(not w.light for w in self.workers.values()) < self.n_cores):
                break
            self._idle_added.wait(1.0)
        # None fits: retire an idle worker bound elsewhere or light (keep the pool bounded), start anew.
        if self.idle and len(self.workers) >= self.n_cores:
            self.retire(self.idle.pop(0))
        return self._spawn(light=False)

    def release(self, w: Worker) -> None:
        """``w`` finished its rank: back to the idle list, or retired (recycled after
        ``max_trials_per_worker`` trials; a light worker once warm ones are up)."""
        with self.lock:
            if not self.alive(w):
                return  # killed: already retired
            w.trial, w.rank = None, -1
            w.trials_run += 1
            recycle = self.max_trials_per_worker and w.trials_run >= self.max_trials_per_worker
            if recycle or (w.light and self.warm_ready.is_set()):
                self.retire(w)
            else:
                self.idle.append(w)

    def retire(self, w: Worker) -> None:
        """Kill ``w`` and everything it started, and forget it."""
        self.workers.pop(w.wid, None)
        _killpg(w.proc)
        w.proc.join(KILL_GRACE_S)
        w.conn.close()
        with contextlib.suppress(ValueError):
            w.proc.close()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until the warm workers are up (the forkserver has preloaded and forked one per core);
        True if they are."""
        self.start_warm()
        self._warm.join(timeout)
        return not self._warm.is_alive()

    def close(self) -> None:
        """Stop every worker, busy or idle, and the forkserver if it is still preloading."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        if self._warm.ident is not None and not self.warm_ready.is_set():
            # Closed before the forkserver finished its preload (a short study of light trials): stop
            # it rather than wait seconds for a torch import nothing needs any more.
            _restart_forkserver()
        if self._warm.ident is not None:
            self._warm.join()
        with self.lock:
            for w in list(self.workers.values()):
                with contextlib.suppress(BrokenPipeError, OSError):
                    w.conn.send(("exit", None))
                _killpg(w.proc)  # busy or idle: nothing of a closed engine may run on
            for w in list(self.workers.values()):
                self.retire(w)
            self.idle.clear()


_PRELOAD_LOCK = threading.Lock()


def _use_preload(preload: list[str]) -> None:
    """Set the preload of multiprocessing's forkserver (one per process). One that runs already with
    another preload (started by other code of this process first, e.g. a ``forkserver`` context's
    ``Process`` in a notebook or a test, with multiprocessing's default) would fork "warm" workers
    without torch: it is stopped, and the next fork starts one with ``preload`` (the processes the old
    one forked go on). One started with this preload (by an engine, or by anything forking after an
    engine set it) is kept."""
    from multiprocessing import forkserver

    with _PRELOAD_LOCK:
        server = getattr(forkserver, "_forkserver", None)
        running = getattr(server, "_forkserver_pid", None) is not None
        if running and list(getattr(server, "_preload_modules", preload)) != preload:
            _restart_forkserver()
        mp.get_context("forkserver").set_forkserver_preload(preload)


def _forkserver_stopped() -> bool:
    """Whether multiprocessing's forkserver was stopped under a fork in progress (another engine of this
    process closed while its forkserver preloaded): the fork then fails with a TypeError (no fd)."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    return getattr(server, "_forkserver_alive_fd", 0) is None


def _restart_forkserver() -> None:
    """Stop multiprocessing's forkserver for good (it is dead or answers nothing), so the next
    ``start()`` launches a new one with the same preload."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    pid = getattr(server, "_forkserver_pid", None)
    if pid:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    stop = getattr(server, "_stop", None)
    if callable(stop):
        with contextlib.suppress(OSError, ChildProcessError):
            stop()


def _killpg(proc: BaseProcess) -> None:
    """SIGKILL a worker and everything below it: its process group, and descendants that left the
    group with ``setsid`` (frozen first, so none forks away meanwhile). A worker that is already gone
    has its group killed (what it started and left there)."""
    pid = proc.pid
    if pid is None:
        return
    if proc.exitcode is None:
        kill_tree(pid)
    else:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
