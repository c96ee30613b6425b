"""The local engine's worker pool: warm workers forked from a preloaded forkserver, light workers for
ranks that need no torch, and how each is started, handed out and retired.

A *warm* worker is forked from a ``multiprocessing`` forkserver that preloaded torch and hpoflow
(``PRELOAD``); forking one waits for that preload, which takes seconds, so the pool starts the
forkserver and one warm worker per core in a background thread (``start_warm``). A *light* worker is
a fresh interpreter without torch (spawned, ready in a fraction of a second) for a rank that
``needs_torch`` not, used while no warm worker is up; light workers retire once warm ones are.
``prestart`` starts either kind before any engine exists (``hpoflow run`` does, first thing) and the
next pool adopts them (``discard_prestarted`` stops them where no pool did). Every worker leads its
own process group and is the subreaper of what its trials start; ``retire`` freezes and kills it with
its whole tree (``hpoflow.engines.proc.kill_tree``). No worker runs the parent's ``__main__``
(``start_without_main``): a script on stdin, a notebook, or a script without a ``__main__`` guard
start workers like any other. Workers and the forkserver start with SIGINT blocked
(``hpoflow.engines.proc.sigint_blocked``): a terminal's Ctrl-C is the driver's to handle.
A stop starts nothing: after ``interrupt`` (the driver's stop, maybe from a signal handler) or
``close`` no worker and no forkserver is started, a forkserver still preloading is killed, and
``acquire`` returns None instead of waiting. The pool's state is guarded by ``lock``; the engine calls
it from one thread.
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
from typing import TYPE_CHECKING, Any

from hpoflow.credentials import scrub_environ
from hpoflow.engines.local._forkserver import (
    ensure_forkserver,
    forkserver_stopped,
    kill_forkserver,
    running_with,
    stop_forkserver,
    use_preload,
)
from hpoflow.engines.machine import GpuId
from hpoflow.engines.proc import kill_tree, sigint_blocked, start_without_main
from hpoflow.errors import EngineError

if TYPE_CHECKING:
    from hpoflow.spec import StudySpec

log = logging.getLogger(__name__)

__all__ = ["PRELOAD", "Worker", "WorkerPool", "discard_prestarted", "prestart", "prestart_for"]

PRELOAD = ["hpoflow.engines.local._preload"]  # torch and the trainer (its digits need no scikit-learn)
_PRELOAD_GUARD = "hpoflow.engines.local._preload_guard"  # always imported first: exits if the parent is gone
_PRELOAD_DONE = "hpoflow.engines.local._preload_done"  # always imported last (see that module)


def _preload_list(preload: list[str] | None) -> list[str]:
    return [_PRELOAD_GUARD, *(PRELOAD if preload is None else preload), _PRELOAD_DONE]


KILL_GRACE_S = 2.0
_SPAWN_TRIES = 5  # a forkserver killed (again) while it preloads torch answers EOF: start another

# Processes started by ``prestart`` before any engine exists; the next pool adopts them.
_PRESTARTED: list[tuple[BaseProcess, Connection]] = []
_PRESTARTED_FORKSERVER: list[bool] = []  # [True] while a forkserver prestart started waits for its pool


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
    with sigint_blocked():  # a spawn returns at once: the new interpreter boots on its own
        proc.start()
    child.close()
    return proc, parent


def use_engine_preload() -> None:
    """This process's forkserver preloads what the engine's does (``PRELOAD``: torch, the trainer, their
    warm-up), for processes forked from it outside an engine; one running with another preload is
    replaced on the next fork (``use_preload``)."""
    use_preload(_preload_list(None))


def prestart(light: int, preload: list[str] | None = None) -> None:
    """Start the local engine's processes before the engine itself, so they boot while the caller
    still imports and opens the study: ``light`` light workers for trials that need no torch, or else
    the forkserver (its torch preload takes seconds; started with light workers it would take a core
    from them and the driver just when they are needed). The next ``WorkerPool`` created in this
    process adopts them."""
    scrub_environ()  # a storage URL's variable or password never reaches a worker (hpoflow.credentials)
    if light <= 0:
        use_preload(_preload_list(preload))
        if ensure_forkserver():  # (one that ran already is someone else's: discard_prestarted leaves it)
            _PRESTARTED_FORKSERVER[:] = [True]
        return
    ctx = _light_context()
    for i in range(light):
        _PRESTARTED.append(_start_light(ctx, -1 - i))


def prestart_for(spec: StudySpec, python_path: tuple[str, ...] = ()) -> None:
    """``prestart`` what a local run of ``spec`` needs first: light workers (as many as trials may run at
    once on the engine's cores) when its trials need no torch (``hpoflow.trial.needs_torch``: a single
    CPU rank of a function whose source imports no torch, a command that runs in a fresh interpreter),
    else the forkserver. A function given by a ``${param}`` placeholder is known per trial only: the
    forkserver. A forkserver an earlier engine of this process left preloaded is used whatever the trials
    (forking from it costs less than a light worker's start). Nothing while processes prestarted before
    still wait for their pool (``hpoflow run`` prestarts before it imports ``optimize``, which calls this
    too)."""
    if _PRESTARTED or _PRESTARTED_FORKSERVER or running_with(_preload_list(None)):
        return
    from hpoflow.engines.machine import machine_cores
    from hpoflow.spec import resolve_training, runs_warm
    from hpoflow.trial import needs_torch

    res = spec.resources
    function = spec.training.get("function")
    try:
        argv = resolve_training(spec.training, {}).command  # placeholders left out: the program is what counts
    except ValueError:  # (pydantic's ValidationError) the run says why
        argv = None
    light = 0
    if argv is not None or (isinstance(function, str) and "${" not in function):
        if not needs_torch(function, res.processes, res.gpus_per_process, python_path, command=argv is not None,
                           warm=runs_warm(argv, spec.training.get("isolate"))):
            cores = spec.engine_option_values().get("cores") or machine_cores()
            light = min(spec.search.max_concurrent, len(cores) // (res.processes * res.cpus_per_process))
    prestart(light=light)


def discard_prestarted() -> None:
    """Stop what ``prestart`` started and no pool adopted (the program ended before its engine existed: a
    Ctrl-C, a storage that did not open): the light workers, and the forkserver, which would otherwise
    go on importing torch for seconds after the program's end."""
    while _PRESTARTED:
        proc, conn = _PRESTARTED.pop()
        _killpg(proc)
        proc.join(KILL_GRACE_S)
        conn.close()
    if _PRESTARTED_FORKSERVER:
        _PRESTARTED_FORKSERVER.clear()
        stop_forkserver()


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
        use_preload(_preload_list(preload))
        _PRESTARTED_FORKSERVER.clear()  # this pool's now: close() stops it if it still preloads
        self._light_ctx = _light_context()
        self.lock = threading.RLock()
        self._idle_added = threading.Condition(self.lock)  # a worker the warm thread forked is idle
        self.warm_ready = threading.Event()  # a warm worker has been forked: the preload is done
        self.workers: dict[int, Worker] = {}
        self.idle: list[Worker] = []
        self._next_wid = 0
        self.closed = False
        # a stop has begun (interrupt, close): start nothing from now on. A plain flag, not an Event: a
        # signal handler sets it, and Event.set() takes a lock the interrupted thread may hold
        self.stopping = False
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
        if self._warm.ident is None and not self.stopping:
            self._warm.start()

    def interrupt(self) -> None:
        """A stop has begun: from now on start no worker and no forkserver, and let ``acquire`` return
        None rather than wait; a forkserver still preloading is killed, so nothing waits for its
        preload (a fork request fails at once). Only sets a flag and sends a signal: the driver's
        signal handler calls it, maybe while this thread holds a lock."""
        self.stopping = True
        if not self.warm_ready.is_set():
            kill_forkserver()

    def _prestart(self, n: int) -> None:
        """Start the forkserver and fork ``n`` warm workers (in the background: a fork waits for the
        preload, which must never hold the lock a submit needs); retire idle light workers as warm
        ones come up."""
        if not self.stopping:
            ensure_forkserver()  # its preload begins now, even when no warm worker is wanted yet
        while True:
            with self.lock:
                if self.stopping or sum(not w.light for w in self.workers.values()) >= n:
                    break
            try:
                w = self._spawn(light=False)  # blocks until the forkserver has preloaded
            except EngineError:  # closed meanwhile; or no forkserver would start: submit says so
                break
            self.warm_ready.set()
            with self.lock:
                if self.stopping:
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
        try:
            for attempt in range(_SPAWN_TRIES):
                if self.stopping:  # a stop starts nothing, a forkserver least of all
                    raise EngineError("the engine is stopping")
                proc = self._ctx.Process(target=worker_main, args=(child, wid), name=f"hpoflow-worker{wid}",
                                         daemon=True)
                try:
                    ensure_forkserver()
                    proc.start()
                    break
                except (EOFError, ConnectionError, FileNotFoundError, TypeError) as exc:
                    if isinstance(exc, TypeError) and not forkserver_stopped():
                        raise
                    if self.stopping:  # a stop killed a forkserver still preloading
                        raise EngineError("the engine is stopping") from exc
                    # the forkserver died (an OOM kill, a stray signal) between multiprocessing's
                    # liveness check and the fork request; the next start() launches a new one
                    log.warning("the local engine's forkserver is gone (%s: %s); starting a new one",
                                type(exc).__name__, exc)
                    if attempt == _SPAWN_TRIES - 1:
                        raise EngineError(f"the local engine could not start a worker process: {exc}") from exc
                    stop_forkserver()
                    time.sleep(0.2 * attempt)
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        return proc, parent

    def acquire(self, gpus: tuple[GpuId, ...], needs_torch: bool) -> Worker | None:
        """An idle worker that may use ``gpus`` (same binding, or never bound): a warm one if any; a
        light one for a rank that ``needs_torch`` not, also started anew while no warm worker exists
        yet; else a new warm one. None once a stop has begun (``interrupt``): a stop starts nothing and
        waits for nothing. Call with ``lock`` held."""
        want = gpus or None

        def fits(w: Worker, exact: bool) -> bool:
            if exact:
                return w.gpus == want
            return w.gpus is None or want is None  # unbound; or a CPU rank, which any worker can run

        while True:
            if self.stopping:
                return None
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
            # more beside them (a worker per core, never more: each holds its own memory). The wait
            # wakes up often enough to see a stop (``interrupt``: a signal handler cannot notify).
            if not (self._warm.is_alive() and sum(not w.light for w in self.workers.values()) < self.n_cores):
                break
            self._idle_added.wait(0.2)
        # None fits: retire an idle worker bound elsewhere or light (keep the pool bounded), start anew.
        if self.idle and len(self.workers) >= self.n_cores:
            self.retire(self.idle.pop(0))
        try:
            return self._spawn(light=False)
        except EngineError:
            if self.stopping:  # the stop began while it forked
                return None
            raise

    def put_back(self, w: Worker) -> None:
        """``w`` was acquired but given no rank (its trial could not start): idle again, as it was."""
        with self.lock:
            if self.alive(w):
                self.idle.append(w)

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
            self.stopping = True
        while self._warm.is_alive():
            if not self.warm_ready.is_set():
                # Closed before the forkserver finished its preload (a short study of light trials, a
                # stop): kill it rather than wait seconds for a torch import nothing needs any more; the
                # warm thread's fork then fails, and it ends.
                stop_forkserver()
            self._warm.join(0.2)
        with self.lock:
            for w in list(self.workers.values()):
                with contextlib.suppress(BrokenPipeError, OSError):
                    w.conn.send(("exit", None))
                _killpg(w.proc)  # busy or idle: nothing of a closed engine may run on
            for w in list(self.workers.values()):
                self.retire(w)
            self.idle.clear()


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
