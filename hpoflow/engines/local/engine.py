"""The local engine: trials as ranks on warm worker processes of this machine.

Workers come from the engine's ``WorkerPool`` (``_pool``): warm workers forked from a forkserver
with torch and hpoflow preloaded, which run trial after trial (no interpreter start, no torch import,
no fork per trial) and reset what a trial may change in between (see ``_worker``), and light workers
for trials that need no torch while the preload is not done yet.
Placement: CPU cores and GPU ids are slots; a trial takes ``processes * cpus_per_process`` cores
and ``processes * gpus_per_process`` GPUs, each rank pinned to its cores with its own
``CUDA_VISIBLE_DEVICES`` and thread count. Nothing is oversubscribed. A share ``1/k`` of a GPU per rank
(``gpus_per_process: 0.25``) is a slot too: ``k`` ranks of different trials share one GPU, each capped to
its share (``hpoflow.engines.gpushare``); the ranks of one trial are on different GPUs, and MIG
instances are never shared.
Robustness: each worker leads its own process group; a rank that raises, dies (signal, OOM kill) or
outlives the trial's timeout fails the whole trial; workers of ranks that did not finish are killed
with their whole tree and replaced.
Rank logs: each rank writes into a pipe whose bytes this process moves into ``rank<r>.log`` with a
cap (``hpoflow.engines.logcap``); a trial's result waits until its ranks' pipes are drained.
Several hosts: a node agent (``hpoflow.engines.agent``) is this engine driven over TCP; ``start`` with a
``RankShare`` runs this host's ranks of a trial whose other ranks run on other agents (global rank
numbers, the TCP store the trial's rank 0 announces), and ``poll(wake=...)`` returns when the agent's
connection has something to say.
Stopping: after ``interrupt`` nothing new starts (no worker, no forkserver); a trial submitted then, or
waiting for a worker then, ends ``cancelled`` without having run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.reduction import send_handle
from pathlib import Path
from typing import Any

from hpoflow.engines.base import Engine, Event, Placement, TrialReport, TrialRequest, TrialResult
from hpoflow.engines.elastic import ElasticBook, Segments
from hpoflow.engines.gpushare import MEMORY_FRACTION_ENV, is_mig, mps_running, share_env
from hpoflow.engines.local._pool import Worker, WorkerPool
from hpoflow.engines.local._slots import RankShare, all_free, give_back, plan_placement, take
from hpoflow.engines.local._slots import RunningTrial as _Trial
from hpoflow.engines.local.options import LocalOptions
from hpoflow.engines.logcap import LogPump, cap_bytes
from hpoflow.engines.machine import GpuId, check_fits, detect_gpus, gpus_needed, machine_cores
from hpoflow.engines.proc import tail
from hpoflow.errors import EngineError
from hpoflow.fileio import append_jsonl
from hpoflow.spec import runs_warm, shares_per_gpu
from hpoflow.train.rendezvous import private_dir, remove_private_dir, store_path, sweep_private_dirs
from hpoflow.trial import RankJob, RankOutcome, gpu_reserve_mib, needs_torch, rank_died, result_from_ranks

log = logging.getLogger(__name__)

PAUSE_GRACE_S = 120.0  # a paused trial that has not stopped at a step by then is stopped (killed)

__all__ = ["LocalEngine", "plan_placement"]

_LOG_DRAIN_S = 5.0  # how long a result waits for its rank logs' pipes to drain (normally milliseconds)
# how long a rank's error waits for an unfinished peer's end, which may be its cause (normally there already)
_PEER_END_GRACE_S = 1.0


def _ids(ids: Sequence[GpuId]) -> str:
    """Ids for a message: consecutive whole numbers as a range (``0-3,8``), others as they are."""
    runs: list[list[GpuId]] = []
    for i in ids:
        last = runs[-1][-1] if runs else None
        if isinstance(i, int) and isinstance(last, int) and i == last + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return ",".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _check_ids(key: str, given: list[int] | None, usable: Sequence[GpuId], what: str, where: str) -> None:
    """``EngineError`` naming ``engine_options.<key>.<i>`` when a listed id is not one this machine gives."""
    for i, x in enumerate(given or ()):
        if x not in usable:
            fix = (f"list {key} among those, or leave engine_options.{key} out to use them all" if usable else
                   f"leave engine_options.{key} out, or run where there are some")
            raise EngineError(f"engine_options.{key}.{i}: {what} {x} is not one the local engine can use on this "
                              f"machine ({where}: {_ids(usable) or 'none'}). Fix: {fix}")


def _rank_of(t: _Trial, w: Worker) -> int:
    """The trial's rank number of what ``w`` runs (a node agent's share numbers its ranks from its first)."""
    return w.rank + (t.share.first_rank if t.share is not None else 0)


class LocalEngine(Engine):
    """Runs trials as ranks on warm worker processes of this machine; see the module docstring.

    ``max_trials_per_worker``: recycle a worker after that many trials (0: never; 1: a fresh
    process for every trial, for training code that leaks state hpoflow cannot reset).
    """

    name = "local"

    @classmethod
    def from_options(cls, options: LocalOptions, run_dir: Path | None = None) -> LocalEngine:
        """The registry's constructor (``hpoflow.registry.ENGINES``): from a ``LocalOptions``."""
        return cls(cores=options.cores, gpus=options.gpus, pg_timeout_s=options.pg_timeout_s,
                   max_trials_per_worker=options.max_trials_per_worker)

    def __init__(self, cores: list[int] | None = None, gpus: Sequence[GpuId] | None = None,
                 preload: list[str] | None = None, pg_timeout_s: float = 120.0,
                 max_trials_per_worker: int = 0, prestart: bool = True) -> None:
        self.cores = machine_cores() if cores is None else list(cores)
        self.gpus: list[GpuId] = detect_gpus() if gpus is None else list(gpus)
        self.free_cores = list(self.cores)
        self.free_gpus = all_free(self.gpus)  # how much of each GPU is free (shares of a GPU: fractions)
        self.pg_timeout_s = pg_timeout_s
        try:
            cap = cap_bytes()
            self._reserve_mib = gpu_reserve_mib(os.environ)  # each GPU sharer's memory outside its cap
        except ValueError as exc:
            raise EngineError(str(exc)) from None
        self._warned_uncapped = False  # a command trial given a share without MPS: said once
        self._pool = WorkerPool(len(self.cores), preload, max_trials_per_worker, warm=prestart)
        self._logs = LogPump(cap)
        self._trials: dict[int, _Trial] = {}
        self._events: list[Event] = []
        sweep_private_dirs()  # left by a driver killed with SIGKILL
        self._rendezvous = ""  # file stores of multi-rank trials (no rendezvous socket), made on first use
        self._book = ElasticBook()  # elastic trials' sizes (hpoflow.engines.elastic)
        self._queued: list[TrialRequest] = []  # submitted, waiting for cores lent to elastic trials
        self._prepared: dict[int, list[Path]] = {}  # trial -> the files ``prepare`` made for it, not started yet
        self._closed = False
        # user functions that imported torch on a light worker (cold_start_s): warm workers from then on
        self._torch_functions: set[str] = set()

    # -- contract -------------------------------------------------------------------------------
    def capacity(self, request: TrialRequest) -> int:
        if request.nodes > 1:  # one machine
            return 0
        need_c = request.processes * request.cpus_per_process
        need_g = gpus_needed(request)
        by_cpu = len(self.cores) // need_c
        k = shares_per_gpu(request.gpus_per_process)
        if k:  # each rank a share of a different GPU: k shares of each GPU, spread over the trials
            shareable = sum(1 for g in self.gpus if not is_mig(g))
            by_gpu = shareable * k // request.processes if shareable >= request.processes else 0
        else:
            by_gpu = len(self.gpus) // need_g if need_g else by_cpu
        return min(by_cpu, by_gpu)

    @classmethod
    def check_fit(cls, options: LocalOptions, request: TrialRequest) -> None:
        """A trial runs on this machine's cores and GPUs (``engine_options.cores``/``gpus`` if given);
        ``HPOFLOW_RANK_LOG_MB``, if set, is a whole number."""
        if request.nodes > 1:
            raise EngineError(f"resources.nodes={request.nodes}: the local engine runs a trial on this machine only. "
                              "Fix: set resources.nodes to 1, or use a cluster engine (engine: compss)")
        usable = machine_cores()
        visible = detect_gpus()
        _check_ids("cores", options.cores, usable, "core", "this process's CPU affinity")
        if all(isinstance(g, int) for g in visible):  # (UUIDs in CUDA_VISIBLE_DEVICES: no index to compare)
            _check_ids("gpus", options.gpus, visible, "GPU",
                       "visible GPUs, from CUDA_VISIBLE_DEVICES or else the NVIDIA driver")
        cores = options.cores if options.cores is not None else usable
        gpus = options.gpus if options.gpus is not None else visible
        check_fits(request, len(cores), len(gpus), sum(1 for g in gpus if is_mig(g)))
        try:
            cap_bytes()  # the engine refuses to start with a rank log cap it cannot read
            gpu_reserve_mib(os.environ)  # nor with a GPU share reserve it cannot read
        except ValueError as exc:
            raise EngineError(str(exc)) from None

    def submit(self, request: TrialRequest) -> None:
        self.start(request)

    def prepare(self, request: TrialRequest) -> None:
        """The trial directory and its ranks' log files, made while the slots are busy (on a slow file
        system, a file's creation in a new directory takes ~0.5 ms, on the path to the trial's start)."""
        if self._closed or request.number in self._prepared:
            return
        trial_dir = Path(request.trial_dir)
        made: list[Path] = [] if trial_dir.exists() else [trial_dir]
        try:
            trial_dir.mkdir(parents=True, exist_ok=True)
            for rank in range(request.processes):
                log_path = trial_dir / f"rank{rank}.log"
                if not log_path.exists():
                    os.close(os.open(log_path, os.O_WRONLY | os.O_CREAT, 0o644))
                    made.insert(0, log_path)
        except OSError:  # (the start says what is wrong with the directory, where it happens again)
            pass
        self._prepared[request.number] = made

    def start(self, request: TrialRequest, share: RankShare | None = None) -> None:
        """``submit``, or with ``share`` (a node agent): start this host's ranks of a multi-host trial."""
        if self._closed:
            raise EngineError("the engine is closed")
        if share is not None:  # the driver reserved the slots: they are free, or it is a bug
            here = replace(request, processes=share.ranks, nodes=1)
            check_fits(here, len(self.cores), len(self.gpus), sum(1 for g in self.gpus if is_mig(g)))
            placement = plan_placement(here, self.free_cores, self.free_gpus)
            if placement is None:
                raise EngineError(f"trial {request.number}: ranks {share.first_rank}-"
                                  f"{share.first_rank + share.ranks - 1} sent to a host whose slots are taken")
            self._launch(request, placement, share=share)
            return
        check_fits(request, len(self.cores), len(self.gpus), sum(1 for g in self.gpus if is_mig(g)))
        placement = plan_placement(request, self.free_cores, self.free_gpus)
        if placement is None:
            if request.processes * request.cpus_per_process <= len(self.free_cores) + self._lent_cores() \
                    and plan_placement(replace(request, cpus_per_process=0), [], self.free_gpus) is not None:
                self._queued.append(request)  # elastic trials give the cores back at their next epoch end
                return
            raise EngineError(
                f"trial {request.number} submitted while its resources are taken; the driver must "
                "not submit more than capacity() trials at once"
            )
        self._launch(request, placement)

    def _lent_cores(self) -> int:
        """Cores elastic trials hold beyond their minimum (they give them back when asked)."""
        return sum((t.request.processes - t.request.base_processes) * t.request.cpus_per_process
                   for t in self._trials.values() if t.request.elastic)

    def _launch(self, request: TrialRequest, placement: list[Placement], prior: _Trial | None = None,
                share: RankShare | None = None) -> bool:
        """Start the ranks of ``request`` on ``placement``: a new trial, or (``prior``) the next segment
        of an elastic trial, restarted with ``request.processes`` ranks, or (``share``) this host's ranks
        of a multi-host trial. False when a stop began first: the trial ends ``cancelled`` at once, its
        resources free."""
        for p in placement:
            for c in p.cores:
                self.free_cores.remove(c)
        take(self.free_gpus, placement)
        trial_dir = Path(request.trial_dir)
        self._prepared.pop(request.number, None)
        trial_dir.mkdir(parents=True, exist_ok=True)
        if request.processes > 1 and share is None and not self._rendezvous:
            self._rendezvous = private_dir()
        store = store_path(self._rendezvous, request.number, request.attempt) \
            if request.processes > 1 and share is None else ""
        now = time.monotonic()
        if prior is None:
            trial = _Trial(request, placement, [], now, now + request.timeout if request.timeout else None,
                           submitted_wall=time.time(), store=store, share=share)
            if request.elastic:
                trial.segments = Segments(now, request.processes, request.cpus_per_process)
                self._book.add_request(request, now)
        else:
            # the deadline stays: resources.timeout bounds an elastic trial from its first start, over every size
            trial = replace(prior, request=request, placement=placement, workers=[], outcomes={}, store=store,
                            deferred=None, logs=[])
        function = request.train.get("function")
        command = request.train.get("command")
        torch_first = function in self._torch_functions or needs_torch(
            function, request.processes, request.gpus_per_process, request.python_path, command=command is not None,
            warm=runs_warm(command, request.train.get("isolate")))
        if torch_first:  # light so far: now a trial needs the preload
            self._pool.start_warm()
        with self._pool.lock:
            acquired = [self._pool.acquire(p.gpus, torch_first) for p in placement]
            workers = [w for w in acquired if w is not None]
            if len(workers) < len(placement):  # a stop began: no worker is started or waited for now
                for w in workers:
                    self._pool.put_back(w)
                self.free_cores, self.free_gpus = give_back(self.free_cores, self.free_gpus, placement,
                                                            self.cores, self.gpus)
                self._book.remove(request.number)
                self._events.append(TrialResult(request.number, "cancelled", error="study stopped before it started"))
                return False
            first, world = (share.first_rank, share.world) if share is not None else (0, request.processes)
            for p, w in zip(placement, workers, strict=True):
                threads = max(1, len(p.cores))
                env = {
                    **(share.env if share is not None else {}),
                    "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                    "HPOFLOW_TRIAL": str(request.number), "HPOFLOW_RANK": str(first + p.rank),
                    "LOCAL_RANK": str(p.rank), "LOCAL_WORLD_SIZE": str(len(placement)),
                }
                if self.gpus:  # only touch CUDA_VISIBLE_DEVICES where GPUs exist
                    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in p.gpus)
                    if p.gpus:
                        w.gpus = p.gpus
                    if p.share is not None:  # shared with ranks of other trials: capped to its share
                        env.update(share_env(p.gpus[0], p.share, os.environ, self._reserve_mib))
                        if command is not None and "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in env:
                            self._warn_uncapped(request, p.gpus[0], env)
                job = RankJob(request, first + p.rank, world, p.rank, "127.0.0.1", 0, threads, self.pg_timeout_s,
                              store, share.announce if share is not None else "")
                w.trial, w.rank = request.number, p.rank
                trial.workers.append(w)
                out, stream = self._logs.open(str(trial_dir / f"rank{first + p.rank}.log"))
                trial.logs.append(stream)
                try:
                    w.conn.send(("run", (job, env, p.cores)))
                    send_handle(w.conn, out, w.proc.pid or 0)  # the rank's stdout and stderr
                except (BrokenPipeError, OSError):  # it died between the check and now: the poll
                    pass  # loop sees its sentinel and fails the trial as a lost (retryable) rank
                finally:
                    os.close(out)  # the worker holds it now (or nobody: its log ends at once)
        self._trials[request.number] = trial
        return True

    def _warn_uncapped(self, request: TrialRequest, gpu: GpuId, env: dict[str, str]) -> None:
        """A command trial's program on a share of a GPU with no MPS memory limit has no memory cap (hpoflow
        caps torch's allocator only in a process it runs itself): said once per engine, on the driver's log."""
        if self._warned_uncapped:
            return
        self._warned_uncapped = True
        fraction = env.get(MEMORY_FRACTION_ENV)
        why = ("MPS runs but sets no memory limit (nvidia-smi gave no memory figure for the GPU)"
               if mps_running(os.environ) else
               "no MPS control daemon runs (no control socket in CUDA_MPS_PIPE_DIRECTORY, default /tmp/nvidia-mps)")
        log.warning(
            "trial %d: a command: trial's program gets a %s share of GPU %s with no memory cap: %s, and hpoflow "
            "caps torch's allocator only in processes it runs itself, so the program can take its neighbours' "
            "memory. Fix: start MPS (nvidia-cuda-mps-control -d), or cap the program itself before it allocates: "
            "torch.cuda.set_per_process_memory_fraction(float(os.environ[%r])) (%s; docs/architecture.md)",
            request.number, env.get("HPOFLOW_GPU_SHARE"), gpu, why, MEMORY_FRACTION_ENV,
            f"{fraction} here" if fraction else "set where nvidia-smi gives the GPU's memory")

    def _restart(self, t: _Trial) -> None:
        """An elastic trial left at an epoch boundary (every rank ``resized``, checkpointed): free its
        cores, start the trials waiting for them, and restart it with the size its book asked for,
        or the largest that fits now (its minimum always does)."""
        book = self._book
        number = t.request.number
        now = time.monotonic()
        self._logs.wait(t.logs, _LOG_DRAIN_S)  # the next segment appends to the same logs
        self._release(t)
        del self._trials[number]
        self._start_queued()
        if t.segments is None or number not in book:  # cannot happen: only elastic trials resize
            raise EngineError(f"trial {number} resized but is not elastic")
        size = book.fit(number, len(self.free_cores))
        placement = None
        for k in sorted((k for k in t.request.elastic_sizes if k <= size), reverse=True):
            placement = plan_placement(replace(t.request, processes=k), self.free_cores, self.free_gpus)
            if placement is not None:
                size = k
                break
        if placement is None:  # its minimum's cores were kept for it; a bug if not
            raise EngineError(f"elastic trial {number} cannot be restarted: its minimum does not fit")
        log.info("trial %d: restarting on %d rank(s) (was %d)", number, size, t.request.processes)
        with contextlib.suppress(OSError):
            append_jsonl(Path(t.request.trial_dir) / "elastic.jsonl",
                         {"time": time.time(), "from": t.request.processes, "to": size})
        t.segments.restart(now, size, t.usage())
        if self._launch(replace(t.request, processes=size), placement, prior=t):
            book.on_restart(number, size, now)

    def _start_queued(self) -> None:
        for request in list(self._queued):
            placement = plan_placement(request, self.free_cores, self.free_gpus)
            if placement is not None:
                self._queued.remove(request)
                self._launch(request, placement)

    def _flush_answers(self) -> None:
        """Answer elastic trials' reports now that the driver has submitted what it could: the prune
        decision with the size to continue with (``ElasticBook.decide``)."""
        book = self._book
        waiting = sum(r.processes * r.cpus_per_process for r in self._queued)
        free = len(self.free_cores)
        for t in self._trials.values():
            if t.deferred is None:
                continue
            prune, t.deferred = t.deferred, None
            world = 0 if prune else book.decide(t.request.number, free - waiting, max(0, waiting - free))
            try:
                t.workers[0].conn.send(("prune", {"prune": prune, "world": world}))
            except (BrokenPipeError, OSError):
                pass

    def poll(self, timeout: float | None, wake: Sequence[Any] = ()) -> list[Event]:
        """The contract's ``poll``; it also returns (maybe with nothing) as soon as one of ``wake``
        (objects ``multiprocessing.connection.wait`` takes: a node agent's connection) is readable."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self._flush_answers()
        while True:
            self._check_deadlines()
            self._finish_ready()
            if self._events:
                out, self._events = self._events, []
                return out
            if not self._trials:  # (_finish_ready started what was queued: with nothing running, it fits)
                return []
            now = time.monotonic()
            wait_for = self._next_wakeup(now, deadline)
            if wait_for is not None and wait_for <= 0:
                if deadline is not None and now >= deadline:
                    return []
                continue
            owner: dict[Any, Worker] = {}
            for t in self._trials.values():
                for w in t.workers:
                    if w.rank not in t.outcomes and self._pool.alive(w):
                        owner[w.conn] = w
                        owner[w.proc.sentinel] = w
            ready = wait([*owner, *wake], timeout=wait_for)
            for obj in ready:
                ranked = owner.get(obj)
                if ranked is None:
                    continue
                if obj is ranked.conn:
                    self._drain(ranked)
                else:
                    self._on_worker_exit(ranked)
            if any(obj in wake for obj in ready):
                self._check_deadlines()
                self._finish_ready()
                out, self._events = self._events, []
                return out

    def _next_wakeup(self, now: float, deadline: float | None) -> float | None:
        times = [t.deadline for t in self._trials.values() if t.deadline is not None]
        times += [t.signalled_at + 1.0 for t in self._trials.values() if t.paused_at is not None]
        if deadline is not None:
            times.append(deadline)
        return max(0.0, min(times) - now) if times else None

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        t = self._trials.get(number)
        if t is None or 0 in t.outcomes:
            return
        if t.request.elastic and not pause:  # answered at the next poll, with its size (_flush_answers)
            t.deferred = prune
            return
        try:
            t.workers[0].conn.send(("prune", {"prune": prune, "pause": True} if pause else prune))
        except (BrokenPipeError, OSError):
            pass

    def cancel(self, number: int, reason: str) -> None:
        queued = [r for r in self._queued if r.number == number]
        if queued:
            self._queued.remove(queued[0])
            self._events.append(TrialResult(number, "cancelled", error=reason))
            return
        t = self._trials.get(number)
        if t is not None and t.cancel_reason is None and not t.done:
            t.cancel_reason = reason
            self._kill_unfinished(t)

    def pause(self, number: int, reason: str) -> None:
        """SIGUSR1 to the trial's ranks (again every second, until they stop: a rank that had not
        started its training yet ignores it); cancelled if it has not paused within ``PAUSE_GRACE_S``."""
        t = self._trials.get(number)
        if t is None or t.done or t.cancel_reason is not None or t.failure is not None:
            self.cancel(number, reason)  # queued: it never started
            return
        t.paused_at = t.paused_at or time.monotonic()
        self._signal_pause(t)

    def _signal_pause(self, t: _Trial) -> None:
        t.signalled_at = time.monotonic()
        for w in t.workers:
            if w.rank not in t.outcomes and w.proc.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(w.proc.pid, signal.SIGUSR1)

    def running(self) -> list[int]:
        return sorted([*self._trials, *(r.number for r in self._queued)])

    def private_memory_mb(self, number: int) -> dict[int, float]:
        """Rank -> the private memory (resident, not shared: torch's preloaded pages are the forkserver's)
        of each unfinished rank of trial ``number`` and what it started, in MB; a node agent's watchdog."""
        import psutil

        t = self._trials.get(number)
        if t is None:
            return {}
        out: dict[int, float] = {}
        for w in t.workers:
            if w.rank in t.outcomes or w.proc.pid is None:
                continue
            try:
                top = psutil.Process(w.proc.pid)
                procs = [top, *top.children(recursive=True)]
            except psutil.Error:
                continue
            total = 0
            for p in procs:
                with contextlib.suppress(psutil.Error):
                    info = p.memory_info()
                    total += max(0, info.rss - getattr(info, "shared", 0))
            out[_rank_of(t, w)] = total / 2**20
        return out

    def fail(self, number: int, reason: str, retryable: bool = False) -> None:
        """End trial ``number`` as failed with ``reason`` (a node agent's memory watchdog): its unfinished
        ranks are killed, as for a timeout."""
        t = self._trials.get(number)
        if t is None or t.done or t.failure is not None or t.cancel_reason is not None:
            return
        t.failure, t.retryable = reason, retryable
        self._kill_unfinished(t)

    def interrupt(self) -> None:
        """A stop has begun: start no worker and no forkserver from now on (``WorkerPool.interrupt``)."""
        self._pool.interrupt()

    def wait_warm(self, timeout: float | None = None) -> bool:
        """Block until the warm workers are up (the forkserver has preloaded and forked one per core);
        True if they are. Benchmarks call it to keep the one-time start out of per-trial figures."""
        return self._pool.wait_warm(timeout)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.close()
        self._logs.close()
        self._trials.clear()
        self._queued.clear()
        for made in self._prepared.values():  # prepared for trials that never started: files first, then the
            for path in made:  # directory, each only if still empty
                with contextlib.suppress(OSError):
                    if path.is_dir():
                        path.rmdir()
                    elif path.stat().st_size == 0:
                        path.unlink()
        self._prepared.clear()
        if self._rendezvous:
            remove_private_dir(self._rendezvous)

    # -- internals ------------------------------------------------------------------------------
    def _trial_of(self, w: Worker) -> _Trial | None:
        return self._trials.get(w.trial) if w.trial is not None else None

    def _drain(self, w: Worker) -> None:
        t = self._trial_of(w)
        try:
            while w.conn.poll():
                kind, payload = w.conn.recv()
                if t is None:
                    continue
                if kind == "report":
                    step, metrics, wants = payload
                    if t.first_report is None:
                        t.first_report, t.first_report_wall = time.monotonic(), time.time()
                    self._book.on_report(t.request.number, metrics, time.monotonic())
                    self._events.append(TrialReport(t.request.number, step, metrics, wants))
                elif kind == "outcome":
                    outcome = t.outcomes[w.rank] = RankOutcome.from_dict(payload)
                    if outcome.status == "error" and t.failure is None:
                        self._read_peers(t, w)  # a peer that died first is the failure (rank_died)
                        if t.failure is None:
                            t.failure = f"rank {_rank_of(t, w)}: {outcome.error}"
                            t.retryable = outcome.retryable
                        self._kill_unfinished(t)
        except (EOFError, OSError):
            self._on_worker_exit(w)

    def _read_peers(self, t: _Trial, w: Worker) -> None:
        """Take in what the other unfinished ranks of ``t`` have said or how they ended, before ``w``'s
        error is taken as the trial's failure: a rank killed (SIGKILL, the OOM killer) breaks its peers'
        next collective ("Connection closed by peer"), and its end is the failure, whichever of the two
        ``poll`` would have read first. That end reaches the engine two ways, its pipe's EOF and the
        forkserver's word on its exit, and both may come after the peer's error (the dying rank's CPU
        stalled on a loaded machine; a child of the rank holding its descriptors): up to
        ``_PEER_END_GRACE_S`` is given for either. A peer that neither ends nor speaks meanwhile (alive,
        blocked in a collective) is killed after it, by the caller."""
        deadline = time.monotonic() + _PEER_END_GRACE_S
        while t.failure is None:
            peers = [p for p in t.workers if p is not w and p.rank not in t.outcomes and self._pool.alive(p)]
            if not peers:
                return
            left = deadline - time.monotonic()
            if not wait([x for p in peers for x in (p.conn, p.proc.sentinel)], max(0.0, left)):
                return
            for peer in peers:
                if t.failure is not None or peer.rank in t.outcomes or not self._pool.alive(peer):
                    continue
                if peer.conn.poll():  # a message, or the end of a pipe whose process is gone
                    self._drain(peer)
                elif wait([peer.proc.sentinel], 0):
                    self._on_worker_exit(peer)
            if left <= 0:
                return

    def _on_worker_exit(self, w: Worker) -> None:
        if not self._pool.alive(w):
            return
        t = self._trial_of(w)
        w.proc.join(0.5)
        code = w.proc.exitcode
        self._pool.retire(w)
        if t is not None and w.rank not in t.outcomes:
            t.outcomes[w.rank] = RankOutcome("lost")
            if t.failure is None and t.cancel_reason is None:
                t.failure = rank_died(_rank_of(t, w), code)
                t.retryable = True
                self._kill_unfinished(t)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for t in self._trials.values():
            if t.paused_at is not None and t.failure is None and t.cancel_reason is None and not t.done:
                if now - t.paused_at > PAUSE_GRACE_S:
                    t.cancel_reason = f"did not pause within {PAUSE_GRACE_S:g} s: stopped"
                    self._kill_unfinished(t)
                elif now - t.signalled_at >= 1.0:
                    self._signal_pause(t)
            if t.deadline is not None and now >= t.deadline and t.failure is None and t.cancel_reason is None:
                t.failure = f"timed out after {t.request.timeout:g} s (resources.timeout)"
                t.retryable = False  # the same configuration would run as long again
                t.deadline = None
                self._kill_unfinished(t)

    def _kill_unfinished(self, t: _Trial) -> None:
        """Kill the workers of ``t`` that have not finished their rank (they may hang in a
        collective); they are replaced, never reused."""
        for w in t.workers:
            if w.rank not in t.outcomes and self._pool.alive(w):
                t.outcomes[w.rank] = RankOutcome("killed")
                self._pool.retire(w)

    def _finish_ready(self) -> None:
        for number, t in list(self._trials.items()):
            if not t.done:
                continue
            if t.failure is None and t.cancel_reason is None and t.outcomes and \
                    all(o.status == "resized" for o in t.outcomes.values()):
                self._restart(t)
                continue
            self._logs.wait(t.logs, _LOG_DRAIN_S)  # the error tail is read from the logs
            self._events.append(self._result(t))
            self._release(t)
            del self._trials[number]
            self._book.remove(number)
        self._start_queued()

    def _result(self, t: _Trial) -> TrialResult:
        req = t.request
        now = time.monotonic()
        timings = {"duration_s": now - t.submitted}
        if t.segments is not None:  # the cores it held over its segments, and how often it changed size
            timings.update(t.segments.timings(now))
        if t.first_report is not None:
            timings["to_first_report_s"] = t.first_report - t.submitted
        chief = t.outcomes.get(0)
        cold = max((o.cold_start_s or 0.0 for o in t.outcomes.values()), default=0.0)
        if cold and isinstance(req.train.get("function"), str):
            self._torch_functions.add(req.train["function"])  # it wants torch: warm workers from now on
        if chief is not None and chief.started_at is not None and t.segments is None:
            # The trial's clock starts with the user's code (as on cluster engines; ``engine_duration_s``:
            # from the submit), without a cold torch import (``cold_start_s``): durations compare across
            # trials, whichever worker ran them and whatever it had to wait for.
            wall = time.time()
            timings["engine_duration_s"] = timings["duration_s"]
            timings["duration_s"] = max(0.0, wall - chief.started_at - (chief.cold_start_s or 0.0))
            if t.first_report_wall is not None:
                timings["to_first_report_s"] = max(0.0, t.first_report_wall - chief.started_at
                                                   - (chief.cold_start_s or 0.0))
        trial_dir = Path(req.trial_dir)

        first = t.share.first_rank if t.share is not None else 0
        ranks = range(first, first + len(t.workers))

        def stderr() -> str:
            logs = {r: tail(trial_dir / f"rank{r}.log", 2000) for r in ranks}
            return "\n".join(f"--- rank {r} ---\n{text}" for r, text in logs.items() if text.strip())

        if t.share is not None:  # this host's ranks only (local numbers); the driver joins the hosts' results
            req = replace(req, processes=len(t.workers))
        result = result_from_ranks(req, t.outcomes, timings=timings, failure=t.failure, retryable=t.retryable,
                                   cancelled=t.cancel_reason if t.failure is None else None, stderr_tail=stderr,
                                   submitted_wall=t.submitted_wall)
        system = t.segments.system(t.usage()) if t.segments is not None else None
        return result if system is None else replace(result, system=system)  # every size's usage

    def _release(self, t: _Trial) -> None:
        if t.store:
            with contextlib.suppress(OSError):
                os.unlink(t.store)
        self.free_cores, self.free_gpus = give_back(self.free_cores, self.free_gpus, t.placement, self.cores,
                                                    self.gpus)
        for w in t.workers:
            self._pool.release(w)
