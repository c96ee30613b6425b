"""The simulated engine: trials on a virtual clock, so the real driver can be run at cluster scale.

Nothing trains. A trial of the cost model's duration takes ``resources.processes`` of ``slots``
virtual slots; its per-epoch metrics are reported at the ends of its epochs (the cost model's
``epoch_ends``, else evenly spaced points of its work), so pruners
see learning curves and a pruned trial frees its slots early. ``poll`` jumps the clock to the next
event (no waiting), so 10,000 trials on 4,096 slots take as long as the driver's own work.

Elastic (``elastic`` option, or trials with ``resources.processes: {min, max}``, which use its
defaults with their policy and ``max``): at each ``poll`` the driver has submitted everything it could, so idle
slots are lent to running trials chosen by the policy (``hpoflow.engines.elastic``), applied at each
one's next epoch boundary (plus ``resize_s``); a submitted trial that finds no free slot takes lent
ones back at once (the lender pays ``resize_s``). The work left runs at ``speedup(slots)``.

A trial still running ``resources.timeout`` virtual seconds after it started (over every resize of an
elastic trial, as on the real engines) fails, not retryable.
Pause and resume (schedulers, docs/schedulers.md): ``answer(number, False, pause=True)`` stops the
trial at the epoch it reported (result ``cancelled``, "paused ..."), and the engine keeps the epochs
done as if checkpointed; a later ``submit`` of the same trial number goes on from there (its duration
is the remaining epochs' share of the cost model's). A trial with a checkpoint directory
(``TrialRequest.checkpoint_dir``) that completes writes its epochs done there (``virtual.json``, its
"checkpoint"); a trial submitted with a directory holding one starts after those epochs: so a PBT
trial whose directory the driver filled with a copy of its parent's (``hpoflow.search.pbt``) resumes
from the parent's virtual state, as on the real engines.

Results carry virtual timings: ``started_at`` (the engine's epoch plus virtual seconds), ``duration_s``
and ``slot_seconds``; ``stats()`` gives the makespan and busy fraction (slot-seconds used / slots x
makespan).
"""

from __future__ import annotations

import heapq
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from hpoflow.engines.base import Engine, Event, TrialReport, TrialRequest, TrialResult
from hpoflow.engines.elastic import Candidate, speedup
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.errors import EngineError
from hpoflow.fileio import write_atomic

__all__ = ["SimObserver", "SimulatedEngine"]


class SimObserver(Protocol):
    """Sees what a simulated engine's trials do (``SimulatedEngine.observer``), for benchmarks that account
    for every epoch trained (``bench/search_benchmark.py``)."""

    def epoch_ended(self, number: int, epoch: int, clock: float, metrics: dict[str, float]) -> None:
        """Trial ``number`` finished epoch ``epoch`` (1-based) at virtual time ``clock``, with these metrics."""

    def run_ended(self, number: int, status: str, clock: float, epoch: int) -> None:
        """A run of trial ``number`` ended at ``clock`` after epoch ``epoch``: ``complete``, ``pruned``,
        ``paused``, ``failed`` or ``cancelled``."""


@dataclass
class _Sim:
    request: TrialRequest
    cost: TrialCost
    start: float
    base: int  # slots it asked for
    slots: int  # slots it runs on now
    work: float  # seconds on ``base`` slots
    done: float = 0.0  # work done, in the same unit
    at: float = 0.0  # virtual time ``done`` was last brought up to date
    epoch: int = 0  # epochs finished
    version: int = 0  # invalidates queued events when the trial's speed changes
    waiting: bool = False  # a report waits for the driver's pruning answer
    grow_to: int = 0  # lent slots to take at the next epoch boundary (reserved already)
    pause_until: float = 0.0  # a resize in progress
    last_value: float | None = None
    slot_seconds: float = 0.0  # slot-seconds held
    busy: float = 0.0  # slot-seconds used (held, not waiting, not pausing for a resize)

    @property
    def epochs(self) -> int:
        return max(1, len(self.cost.curve))

    def boundary(self, k: int) -> float:
        """Work done at the end of epoch ``k``: the cost model's ``epoch_ends`` (scaled to ``work``), else
        equal shares."""
        ends = self.cost.epoch_ends
        if k <= 0:
            return 0.0
        if len(ends) == self.epochs and ends[-1] > 0:
            return self.work * ends[min(k, self.epochs) - 1] / ends[-1]
        return self.work * k / self.epochs


class SimulatedEngine(Engine):
    """See the module docstring. ``cost(request) -> TrialCost`` overrides the options' cost model."""

    name = "simulated"

    @classmethod
    def from_options(cls, options: SimulatedOptions, run_dir: Path | None = None) -> SimulatedEngine:
        """The registry's constructor (``hpoflow.registry.ENGINES``): from a ``SimulatedOptions``."""
        return cls(options)

    def __init__(self, options: SimulatedOptions | None = None,
                 cost: Callable[[TrialRequest], TrialCost] | None = None) -> None:
        self.options = options or SimulatedOptions(lognormal={})
        self.slots = self.options.slots
        self._cost = cost or _cost_model(self.options)
        self.clock = 0.0
        self.epoch_wall = time.time()  # virtual t=0 as a wall-clock time (for started_at)
        self._running: dict[int, _Sim] = {}
        self._heap: list[tuple[float, int, int, int]] = []
        self._deadlines: list[tuple[float, int, _Sim]] = []  # resources.timeout, virtual: over every resize
        self._seq = 0
        self._ready: list[Event] = []
        self._busy_slot_s = 0.0  # of finished trials
        self._held_total = 0  # slots held (or reserved to grow into) by running trials
        self._resizes = 0
        self._finished = 0
        self._paused: dict[int, int] = {}  # trial number -> epochs done when it paused (its "checkpoint")
        elastic = self.options.elastic
        if elastic is not None:
            from hpoflow.registry import ELASTIC

            self._policy: Callable[..., list[Candidate]] | None = ELASTIC.get(elastic.policy)
        else:
            self._policy = None
        self.direction = "minimize"
        self.observer: SimObserver | None = None  # told of every epoch and every run's end
        self.epochs_trained = 0  # over every trial and run: what a budget in epochs counts

    @classmethod
    def check_fit(cls, options: SimulatedOptions, request: TrialRequest) -> None:
        """A trial takes ``resources.processes`` of the simulated ``slots``; the cost model builds (a replay
        run that holds no finished trial is refused here, before the study starts)."""
        if request.processes > options.slots:
            raise EngineError(f"a trial of {request.processes} processes cannot fit {options.slots} simulated slots. "
                              "Fix: raise engine_options.slots or lower resources.processes")
        _cost_model(options)

    # -- contract -------------------------------------------------------------------------------
    def capacity(self, request: TrialRequest) -> int:
        return self.slots // max(1, request.processes)

    def submit(self, request: TrialRequest) -> None:
        need = max(1, request.processes)
        if need > self.slots:
            raise EngineError(f"a trial of {need} processes cannot fit {self.slots} simulated slots. Fix: raise "
                              "engine_options.slots or lower resources.processes")
        self.direction = request.direction or self.direction
        if request.elastic and self.options.elastic is None:  # resources.processes: {min, max}: the same
            from hpoflow.engines.simulated.options import ElasticOptions  # lending, at 0.9 per doubling
            from hpoflow.registry import ELASTIC

            self.options = self.options.model_copy(update={"elastic": ElasticOptions(
                policy=request.elastic_policy, max_slots=request.elastic_sizes[-1] * max(1, request.cpus_per_process))})
            self._policy = ELASTIC.get(request.elastic_policy)
        self._reclaim(need)
        try:
            cost = self._cost(request)
        except Exception as exc:  # a cost function that raises: the trial fails, as in any engine
            cost = TrialCost(0.0, {}, error=f"cost model: {type(exc).__name__}: {exc}")
        sim = _Sim(request, cost, self.clock, need, need, max(0.0, cost.duration_s), at=self.clock)
        resumed = self._paused.pop(request.number, 0) or _virtual_checkpoint(request.checkpoint_dir)
        if resumed and cost.error is None:  # resumed from its pause: the epochs done are not trained again
            sim.epoch = min(resumed, sim.epochs - 1)
            sim.done = sim.boundary(sim.epoch)
        self._running[request.number] = sim
        self._held_total += need
        self._schedule(sim)
        if request.timeout:
            self._seq += 1
            heapq.heappush(self._deadlines, (self.clock + request.timeout, self._seq, sim))

    def poll(self, timeout: float | None) -> list[Event]:
        if self._ready:
            out, self._ready = self._ready, []
            return out
        self._lend_idle()
        while self._heap:
            if self._deadlines and self._deadlines[0][0] < self._heap[0][0]:
                d, _, late = heapq.heappop(self._deadlines)
                if self._running.get(late.request.number) is late:
                    self.clock = max(self.clock, d)
                    return self._finish(late, "failed", error=f"timed out after {late.request.timeout:g} s "
                                        "(resources.timeout)", now=True)
                continue
            t, _, number, version = heapq.heappop(self._heap)
            sim = self._running.get(number)
            if sim is None or version != sim.version:
                continue
            self.clock = max(self.clock, t)
            self._progress(sim, self.clock)
            events = self._on_boundary(sim)
            if events:
                return events
        return []

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        sim = self._running.get(number)
        if sim is None or not sim.waiting:
            return
        self._progress(sim, self.clock)
        sim.waiting = False
        if prune:
            self._finish(sim, "pruned")
        elif pause:
            self._paused[number] = sim.epoch
            self._finish(sim, "cancelled", error=f"paused (scheduler) at epoch {sim.epoch}: checkpointed, "
                         "resumes from there")
        else:
            self._schedule(sim)

    def cancel(self, number: int, reason: str) -> None:
        sim = self._running.get(number)
        if sim is not None:
            self._finish(sim, "cancelled", error=reason)

    def running(self) -> list[int]:
        return sorted(self._running)

    def close(self) -> None:
        for n in list(self._running):
            self.cancel(n, "engine closed")

    # -- figures --------------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Virtual makespan, busy fraction (slot-seconds of running trials / slots x makespan) and
        the number of resizes of elastic trials."""
        span = self.clock
        busy = self._busy_slot_s + sum(s.busy for s in self._running.values())
        return {"makespan_s": span, "busy": busy / (self.slots * span) if span > 0 else 0.0,
                "resizes": float(self._resizes), "finished": float(self._finished)}

    # -- internals ------------------------------------------------------------------------------
    def _speed(self, sim: _Sim) -> float:
        """Work (seconds on the base slots) done per virtual second on the current slots."""
        e = self.options.elastic
        if e is None or sim.slots == sim.base:
            return 1.0
        return speedup(sim.slots, e.scaling, e.efficiency) / speedup(sim.base, e.scaling, e.efficiency)

    def _progress(self, sim: _Sim, t: float) -> None:
        """Bring one trial up to virtual time ``t`` (trials are updated only at their own events: a
        clock step costs nothing per running trial)."""
        if t <= sim.at:
            return
        sim.slot_seconds += (t - sim.at) * sim.slots
        if not sim.waiting:
            begin = max(sim.at, min(t, sim.pause_until))  # a resize pause holds slots without using them
            sim.done = min(sim.work, sim.done + (t - begin) * self._speed(sim))
            sim.busy += (t - begin) * sim.slots
        sim.at = t

    def _hold(self, sim: _Sim, slots: int | None = None, grow_to: int | None = None) -> None:
        before = max(sim.slots, sim.grow_to)
        if slots is not None:
            sim.slots = slots
        if grow_to is not None:
            sim.grow_to = grow_to
        self._held_total += max(sim.slots, sim.grow_to) - before

    def _schedule(self, sim: _Sim) -> None:
        """Queue the trial's next epoch boundary at its current speed."""
        sim.version += 1
        target = sim.boundary(sim.epoch + 1)
        begin = max(self.clock, sim.pause_until)
        t = begin + max(0.0, target - sim.done) / self._speed(sim)
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, sim.request.number, sim.version))

    def _on_boundary(self, sim: _Sim) -> list[Event]:
        sim.done = sim.boundary(sim.epoch + 1)
        sim.epoch += 1
        req = sim.request
        if sim.cost.error is None:
            self.epochs_trained += 1
            if self.observer is not None:
                self.observer.epoch_ended(req.number, sim.epoch, self.clock,
                                          dict(sim.cost.curve[sim.epoch - 1]) if sim.epoch <= len(sim.cost.curve)
                                          else dict(sim.cost.metrics))
        if sim.cost.error is not None:
            return self._finish(sim, "failed", error=sim.cost.error, now=True)
        if sim.epoch >= sim.epochs:
            return self._finish(sim, "complete", now=True)
        metrics = dict(sim.cost.curve[sim.epoch - 1]) if sim.cost.curve else {}
        if req.metric in metrics:
            sim.last_value = metrics[req.metric]
        if sim.grow_to:  # lent slots reserved earlier: taken now, at the epoch boundary
            self._resize(sim, sim.grow_to)
            self._hold(sim, grow_to=0)
        if not metrics:
            self._schedule(sim)
            return []
        wants = req.pruning and req.metric in metrics
        if wants:
            sim.waiting = True
        else:
            self._schedule(sim)
        return [TrialReport(req.number, sim.epoch, metrics, wants)]

    def _resize(self, sim: _Sim, slots: int) -> None:
        if slots == sim.slots:
            return
        self._progress(sim, self.clock)
        self._hold(sim, slots=slots)
        self._resizes += 1
        e = self.options.elastic
        if e is not None and e.resize_s:
            sim.pause_until = max(sim.pause_until, self.clock) + e.resize_s

    def _finish(self, sim: _Sim, status: str, error: str | None = None, now: bool = False) -> list[Event]:
        req = sim.request
        self._progress(sim, self.clock)
        del self._running[req.number]
        if self.observer is not None:
            self.observer.run_ended(req.number, "paused" if (error or "").startswith("paused") else status,
                                    self.clock, sim.epoch)
        self._held_total -= max(sim.slots, sim.grow_to)
        self._busy_slot_s += sim.busy
        self._finished += 1
        duration = self.clock - sim.start
        timings = {"duration_s": duration, "started_at": self.epoch_wall + sim.start, "launch_s": 0.0,
                   "run_s": duration, "slot_seconds": sim.slot_seconds}
        if status == "complete":
            if req.checkpoint_dir:  # its virtual checkpoint, that a PBT trial copied from it resumes from
                _write_virtual_checkpoint(req.checkpoint_dir, sim.epoch)
            metrics = dict(sim.cost.metrics)
            res = TrialResult(req.number, "complete", value=metrics.get(req.metric), metrics=metrics, timings=timings)
            if res.value is None or not math.isfinite(res.value):
                res = TrialResult(req.number, "failed", error=f"the cost model gave no finite {req.metric!r}",
                                  timings=timings)
        elif status == "pruned":
            res = TrialResult(req.number, "pruned", metrics=dict(sim.cost.curve[sim.epoch - 1])
                              if sim.cost.curve and sim.epoch else {}, timings=timings)
        else:
            res = TrialResult(req.number, status, error=error, timings=timings)  # type: ignore[arg-type]
        if now:
            return [res]
        self._ready.append(res)
        return []

    def _held(self, sim: _Sim) -> int:
        return max(sim.slots, sim.grow_to)

    def _lend_idle(self) -> None:
        """Idle slots at a poll (the driver submitted all it could) go to trials the policy picks."""
        e = self.options.elastic
        if e is None or self._policy is None:
            return
        free = self.slots - self._held_total
        if free <= 0:
            return
        cands = [Candidate(s.request.number, self._held(s), max(e.max_slots, s.base),
                           max(0.0, s.work - s.done) / self._speed(s), s.start, s.last_value)
                 for s in self._running.values() if self._held(s) < max(e.max_slots, s.base)
                 and s.epoch + 1 < s.epochs]
        for c in self._policy(cands, self.direction):
            if free <= 0:
                break
            sim = self._running[c.number]
            extra = min(free, c.max_slots - c.slots)
            if speedup(c.slots + extra, e.scaling, e.efficiency) <= 1.01 * speedup(c.slots, e.scaling, e.efficiency):
                continue  # more slots would not make it faster (a flat or falling scaling curve)
            self._hold(sim, grow_to=c.slots + extra)
            free -= extra

    def _reclaim(self, need: int) -> None:
        """Free ``need`` slots for a new trial: first lent slots not yet taken, then grown trials."""
        free = self.slots - self._held_total
        if free >= need:
            return
        for sim in sorted(self._running.values(), key=lambda s: -(self._held(s) - s.base)):
            if free >= need:
                break
            if sim.grow_to:
                free += sim.grow_to - sim.slots
                self._hold(sim, grow_to=0)
            if free < need and sim.slots > sim.base:
                give = min(sim.slots - sim.base, need - free)
                self._resize(sim, sim.slots - give)
                free += give
                if not sim.waiting:
                    self._schedule(sim)
        if free < need:  # pragma: no cover - the driver submits within capacity()
            raise EngineError(f"trial submitted with {free} of the {need} simulated slots it needs free; the "
                              "driver must not submit more than capacity() trials at once")


_VIRTUAL = "virtual.json"


def _virtual_checkpoint(directory: str) -> int:
    """The epochs done recorded in a checkpoint directory by a simulated trial (0: none)."""
    if not directory:
        return 0
    try:
        return int(json.loads((Path(directory) / _VIRTUAL).read_text())["epoch"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _write_virtual_checkpoint(directory: str, epoch: int) -> None:
    try:  # a new file renamed into place, as every checkpoint: never written through a hard link (PBT's copy)
        write_atomic(Path(directory) / _VIRTUAL, json.dumps({"epoch": epoch}), durable=False)
    except OSError:  # a virtual checkpoint is a convenience: the trial's result stands without it
        pass


def _cost_model(options: SimulatedOptions) -> Callable[[TrialRequest], TrialCost]:
    """The options' cost model, built by its ``COST_MODELS`` entry."""
    from hpoflow.registry import COST_MODELS

    name, values = options.cost_model()
    return COST_MODELS.get(name)(COST_MODELS.options(name, values))
