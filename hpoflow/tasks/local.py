"""The local engine: trials as process groups on this machine, forked from a warm forkserver.

Start-up: a ``multiprocessing`` forkserver with torch and hpoflow preloaded starts once per engine;
each rank of each trial is a fresh fork of it (milliseconds, no interpreter or torch import).
Placement: CPU cores and GPU ids are slots; a trial takes ``processes * cpus_per_process`` cores
and ``processes * gpus_per_process`` GPUs, each rank pinned to its cores with its own
``CUDA_VISIBLE_DEVICES`` and thread count. Nothing is oversubscribed.
Robustness: each rank leads its own process group; a rank that raises, dies (signal, OOM kill) or
outlives the trial's timeout fails the whole trial, whose other ranks are killed with their children.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from hpoflow.errors import EngineError
from hpoflow.tasks._base import Engine, Event, Placement, TrialReport, TrialRequest, TrialResult, TrialStatus

__all__ = ["LocalEngine", "check_fits", "detect_gpus", "machine_cores", "plan_placement", "tail"]

PRELOAD = ["hpoflow.tasks._worker", "sklearn.datasets", "sklearn.model_selection"]
_KILL_GRACE_S = 2.0


def detect_gpus() -> list[int]:
    """GPU ids usable here, without importing torch: ``CUDA_VISIBLE_DEVICES`` or the NVIDIA driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(v) for v in visible.split(",") if v.strip().isdigit()]
    proc = Path("/proc/driver/nvidia/gpus")
    return list(range(len(list(proc.iterdir())))) if proc.is_dir() else []


def machine_cores() -> list[int]:
    """The CPU cores this process may use (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def check_fits(request: TrialRequest, n_cores: int, n_gpus: int) -> None:
    """Raise ``EngineError`` naming the numbers if a trial of this shape can never run here."""
    need_c = request.processes * request.cpus_per_process
    need_g = request.processes * request.gpus_per_process
    if need_c > n_cores:
        raise EngineError(
            f"resources: a trial needs processes x cpus_per_process = {request.processes} x "
            f"{request.cpus_per_process} = {need_c} cores, but this machine gives {n_cores}. "
            "Fix: lower resources.processes or resources.cpus_per_process"
        )
    if need_g > n_gpus:
        raise EngineError(
            f"resources: a trial needs processes x gpus_per_process = {request.processes} x "
            f"{request.gpus_per_process} = {need_g} GPUs, but {n_gpus} are visible here. Fix: lower "
            "resources.gpus_per_process, or set it to 0 to train on CPUs"
        )


def plan_placement(request: TrialRequest, free_cores: list[int], free_gpus: list[int]
                   ) -> list[Placement] | None:
    """Cores and GPUs for each rank of ``request`` from the free ones, or ``None`` if they don't fit."""
    need_c = request.processes * request.cpus_per_process
    need_g = request.processes * request.gpus_per_process
    if need_c > len(free_cores) or need_g > len(free_gpus):
        return None
    out = []
    for r in range(request.processes):
        c0, g0 = r * request.cpus_per_process, r * request.gpus_per_process
        out.append(Placement(r, tuple(free_cores[c0 : c0 + request.cpus_per_process]),
                             tuple(free_gpus[g0 : g0 + request.gpus_per_process])))
    return out


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


def _free_port(recent: deque[int]) -> int:
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in recent:
            recent.append(port)
            return port
    raise EngineError("could not find a free TCP port on 127.0.0.1 for a trial's rendezvous")


def _signal_name(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


@dataclass
class _Trial:
    request: TrialRequest
    placement: list[Placement]
    procs: list[BaseProcess]
    conns: list[Connection]
    submitted: float
    deadline: float | None
    outcomes: dict[int, dict[str, Any]] = field(default_factory=dict)
    exited: set[int] = field(default_factory=set)
    open_conns: set[int] = field(default_factory=set)
    first_report: float | None = None
    cancel_reason: str | None = None
    failure: str | None = None
    retryable: bool = False


class LocalEngine(Engine):
    """Runs trials as processes on this machine; see the module docstring."""

    name = "local"

    def __init__(self, cores: list[int] | None = None, gpus: list[int] | None = None,
                 preload: list[str] | None = None, pg_timeout_s: float = 120.0) -> None:
        self.cores = machine_cores() if cores is None else list(cores)
        self.gpus = detect_gpus() if gpus is None else list(gpus)
        self.free_cores = list(self.cores)
        self.free_gpus = list(self.gpus)
        self.pg_timeout_s = pg_timeout_s
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(PRELOAD if preload is None else preload)
        self._trials: dict[int, _Trial] = {}
        self._events: list[Event] = []
        self._ports: deque[int] = deque(maxlen=256)
        self._closed = False
        # Start the forkserver (and its torch import) now, in the background, while the driver
        # sets up the study; the first submit waits for it only if it is not ready yet.
        self._warm = threading.Thread(target=self._start_forkserver, daemon=True)
        self._warm.start()

    def _start_forkserver(self) -> None:
        from multiprocessing import forkserver

        forkserver.ensure_running()

    # -- contract -------------------------------------------------------------------------------
    def capacity(self, request: TrialRequest) -> int:
        need_c = request.processes * request.cpus_per_process
        need_g = request.processes * request.gpus_per_process
        by_cpu = len(self.cores) // need_c
        by_gpu = len(self.gpus) // need_g if need_g else by_cpu
        return min(by_cpu, by_gpu)

    def check_fits(self, request: TrialRequest) -> None:
        check_fits(request, len(self.cores), len(self.gpus))

    def submit(self, request: TrialRequest) -> None:
        if self._closed:
            raise EngineError("the engine is closed")
        self.check_fits(request)
        placement = plan_placement(request, self.free_cores, self.free_gpus)
        if placement is None:
            raise EngineError(
                f"trial {request.number} submitted while its resources are taken; the driver must "
                "not submit more than capacity() trials at once"
            )
        for p in placement:
            for c in p.cores:
                self.free_cores.remove(c)
            for g in p.gpus:
                self.free_gpus.remove(g)
        trial_dir = Path(request.trial_dir)
        trial_dir.mkdir(parents=True, exist_ok=True)
        port = _free_port(self._ports) if request.processes > 1 else 0
        from hpoflow.tasks._worker import rank_process  # light: only the entry point's module
        from hpoflow.train.runner import RankJob

        now = time.monotonic()
        trial = _Trial(request, placement, [], [], now,
                       now + request.timeout if request.timeout else None)
        for p in placement:
            parent, child = self._ctx.Pipe(duplex=True)
            threads = max(1, len(p.cores))
            env = {
                "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "HPOFLOW_TRIAL": str(request.number), "HPOFLOW_RANK": str(p.rank),
                "LOCAL_RANK": str(p.rank), "LOCAL_WORLD_SIZE": str(request.processes),
            }
            if self.gpus:  # only touch CUDA_VISIBLE_DEVICES where GPUs exist
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in p.gpus)
            job = RankJob(request, p.rank, request.processes, p.rank, "127.0.0.1", port, threads,
                          self.pg_timeout_s)
            proc = self._ctx.Process(
                target=rank_process, name=f"hpoflow-trial{request.number}-rank{p.rank}",
                args=(job, child, env, p.cores, str(trial_dir / f"rank{p.rank}.log")), daemon=True,
            )
            proc.start()
            child.close()
            trial.procs.append(proc)
            trial.conns.append(parent)
            trial.open_conns.add(p.rank)
        self._trials[request.number] = trial

    def poll(self, timeout: float | None) -> list[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._check_deadlines()
            self._finish_ready()
            if self._events:
                out, self._events = self._events, []
                return out
            if not self._trials:
                return []
            now = time.monotonic()
            wait_for = self._next_wakeup(now, deadline)
            if wait_for is not None and wait_for <= 0:
                if deadline is not None and now >= deadline:
                    return []
                continue
            objs: list[Any] = []
            owner: dict[int, tuple[_Trial, int, str]] = {}
            for t in self._trials.values():
                for r, conn in enumerate(t.conns):
                    if r in t.open_conns:
                        objs.append(conn)
                        owner[id(conn)] = (t, r, "conn")
                for r, proc in enumerate(t.procs):
                    if r not in t.exited:
                        objs.append(proc.sentinel)
                        owner[id(proc.sentinel)] = (t, r, "proc")
            ready = wait(objs, timeout=wait_for)
            for obj in ready:
                key = id(obj)
                if key not in owner:  # sentinels are ints: look them up by value
                    for t in self._trials.values():
                        for r, proc in enumerate(t.procs):
                            if proc.sentinel == obj:
                                self._on_exit(t, r)
                    continue
                t, r, kind = owner[key]
                if kind == "conn":
                    self._drain(t, r)
                else:
                    self._on_exit(t, r)

    def _next_wakeup(self, now: float, deadline: float | None) -> float | None:
        times = [t.deadline for t in self._trials.values() if t.deadline is not None]
        if deadline is not None:
            times.append(deadline)
        return max(0.0, min(times) - now) if times else None

    def answer(self, number: int, prune: bool) -> None:
        t = self._trials.get(number)
        if t is None or 0 not in t.open_conns:
            return
        try:
            t.conns[0].send(("prune", prune))
        except (BrokenPipeError, OSError):
            pass

    def cancel(self, number: int, reason: str) -> None:
        t = self._trials.get(number)
        if t is not None and t.cancel_reason is None:
            t.cancel_reason = reason
            self._kill(t)

    def running(self) -> list[int]:
        return sorted(self._trials)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for t in list(self._trials.values()):
            t.cancel_reason = t.cancel_reason or "engine closed"
            self._kill(t)
        for t in list(self._trials.values()):
            self._release(t)
        self._trials.clear()

    # -- internals ------------------------------------------------------------------------------
    def _drain(self, t: _Trial, rank: int) -> None:
        conn = t.conns[rank]
        try:
            while conn.poll():
                kind, payload = conn.recv()
                if kind == "report":
                    step, metrics, wants = payload
                    if t.first_report is None:
                        t.first_report = time.monotonic()
                    self._events.append(TrialReport(t.request.number, step, metrics, wants))
                elif kind == "outcome":
                    t.outcomes[rank] = payload
                    if payload["status"] == "error" and t.failure is None:
                        t.failure = f"rank {rank}: {payload['error']}"
                        t.retryable = bool(payload.get("retryable"))
                        self._kill(t)
        except (EOFError, OSError):
            t.open_conns.discard(rank)

    def _on_exit(self, t: _Trial, rank: int) -> None:
        if rank in t.exited:
            return
        t.exited.add(rank)
        if rank in t.open_conns:
            self._drain(t, rank)
        proc = t.procs[rank]
        proc.join(0.5)
        if rank not in t.outcomes and t.failure is None and t.cancel_reason is None:
            t.failure = f"rank {rank} {_signal_name(proc.exitcode)} before it finished"
            t.retryable = True
            self._kill(t)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for t in self._trials.values():
            if t.deadline is not None and now >= t.deadline and t.failure is None and t.cancel_reason is None:
                t.failure = f"timed out after {t.request.timeout:g} s (resources.timeout)"
                t.retryable = True
                t.deadline = None
                self._kill(t)

    def _kill(self, t: _Trial) -> None:
        for proc in t.procs:
            pid = proc.pid
            if pid is None or proc.exitcode is not None:
                continue
            try:
                os.killpg(pid, signal.SIGKILL)  # the rank and everything it started
            except (ProcessLookupError, PermissionError):
                try:
                    proc.kill()
                except (ProcessLookupError, OSError):
                    pass

    def _finish_ready(self) -> None:
        for number, t in list(self._trials.items()):
            if len(t.exited) < len(t.procs):
                if t.failure is None and t.cancel_reason is None:
                    continue
                # killed: wait for the ranks to be reaped
                for r, proc in enumerate(t.procs):
                    proc.join(_KILL_GRACE_S)
                    self._on_exit(t, r)
                if len(t.exited) < len(t.procs):
                    continue
            for r in range(len(t.procs)):
                if r in t.open_conns:
                    self._drain(t, r)
            self._events.append(self._result(t))
            self._release(t)
            del self._trials[number]

    def _result(self, t: _Trial) -> TrialResult:
        req = t.request
        now = time.monotonic()
        timings = {"duration_s": now - t.submitted}
        if t.first_report is not None:
            timings["to_first_report_s"] = t.first_report - t.submitted
        trial_dir = Path(req.trial_dir)
        if t.failure is not None or t.cancel_reason is not None:
            logs = [tail(trial_dir / f"rank{r}.log", 2000) for r in range(len(t.procs))]
            stderr = "\n".join(f"--- rank {r} ---\n{text}" for r, text in enumerate(logs) if text.strip())
            if t.failure is None:
                return TrialResult(req.number, "cancelled", error=t.cancel_reason, stderr_tail=stderr,
                                   timings=timings)
            return TrialResult(req.number, "failed", error=t.failure, stderr_tail=stderr, timings=timings,
                               retryable=t.retryable)
        chief = t.outcomes.get(0, {})
        metrics = chief.get("metrics", {})
        status: TrialStatus = "pruned" if chief.get("status") == "pruned" else "complete"
        return TrialResult(req.number, status, value=metrics.get(req.metric), metrics=metrics,
                           timings=timings)

    def _release(self, t: _Trial) -> None:
        for p in t.placement:
            self.free_cores.extend(c for c in p.cores if c not in self.free_cores)
            self.free_gpus.extend(g for g in p.gpus if g not in self.free_gpus)
        self.free_cores.sort()
        self.free_gpus.sort()
        for conn in t.conns:
            conn.close()
        for proc in t.procs:
            if proc.exitcode is None:
                proc.join(_KILL_GRACE_S)
            try:
                proc.close()
            except ValueError:
                pass
