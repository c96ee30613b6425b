"""Elastic trials: which running trial takes idle slots, and how fast it then runs.

When slots sit idle and no new trial can start (the budget is spent, or the driver has nothing to
submit), an elastic trial (``resources.processes: {min: 1, max: 8}``, or the simulated engine's
``elastic`` option) may grow onto them at its next epoch boundary, and shrinks back when a new trial
needs a slot. Which trials grow first is a *policy*, a plug-in of ``hpoflow.registry.ELASTIC``: a
callable ``(candidates, direction) -> candidates in the order they should grow``.

Built in (HyperSched's idea, SoCC 2019: give the idle resources to the trial most likely to matter):

- ``longest_remaining``: the trial with the most work left (shortens the drain tail the most);
- ``most_promising``: the trial with the best last reported value of the study metric (ties: the one
  with the most work left);
- ``fifo``: the oldest trial first.

``speedup(k, curve)`` is a trial's speed on ``k`` slots relative to 1 slot: the measured ``curve``
(``curve[k-1]``) where given, extended beyond its end at the efficiency of its last step.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from hpoflow.registry import ELASTIC
from hpoflow.trial import TrialRequest, aggregate_usage

log = logging.getLogger(__name__)

__all__ = ["Candidate", "ElasticBook", "Segments", "fifo", "longest_remaining", "most_promising", "speedup"]


@dataclass(frozen=True)
class Candidate:
    """A running trial that could grow: its number, slots now, the most it may take, the work left
    (in seconds on its current slots), when it started, and its last reported metric value."""

    number: int
    slots: int
    max_slots: int
    remaining_s: float
    started: float
    last_value: float | None = None


def longest_remaining(candidates: Sequence[Candidate], direction: str) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (-c.remaining_s, c.number))


def most_promising(candidates: Sequence[Candidate], direction: str) -> list[Candidate]:
    sign = -1.0 if direction == "maximize" else 1.0

    def key(c: Candidate) -> tuple[int, float, float, int]:
        if c.last_value is None:
            return (1, 0.0, -c.remaining_s, c.number)  # nothing reported yet: after those that have
        return (0, sign * c.last_value, -c.remaining_s, c.number)

    return sorted(candidates, key=key)


def fifo(candidates: Sequence[Candidate], direction: str) -> list[Candidate]:
    return sorted(candidates, key=lambda c: (c.started, c.number))


def speedup(k: int, curve: Sequence[float] | None = None, efficiency: float = 0.9) -> float:
    """Speed on ``k`` slots relative to 1 slot. With a measured ``curve`` (speedups on 1, 2, ...
    slots), its values, and beyond its end each doubling keeps the efficiency of its last step; without
    one, ``k * efficiency ** log2(k)`` (a constant efficiency per doubling)."""
    import math

    if k <= 1:
        return 1.0
    if curve:
        if k <= len(curve):
            return float(curve[k - 1])
        last = len(curve)
        step_eff = (curve[-1] / curve[-2]) / (last / (last - 1)) if last >= 2 else efficiency
        return float(curve[-1] * (k / last) * step_eff ** math.log2(k / last))
    return float(k * efficiency ** math.log2(k))


# -- the real engines' book of elastic trials ------------------------------------------------------
_FASTER = 0.97  # a grown trial must run its epochs at least 3 % faster than before, or it shrinks back
_IGNORED_LIMIT = 2  # answers asking a resize a trial did not act on before it is treated as fixed


@dataclass
class _Tracked:
    number: int
    sizes: tuple[int, ...]
    cores_per_rank: int
    policy: str
    size: int
    epochs: int | None
    started: float
    last_report: float | None = None
    reports: int = 0
    last_value: float | None = None
    epoch_s: dict[int, float] = field(default_factory=dict)  # ranks -> seconds per epoch, last measured
    target: int = 0  # the size asked at the last answer (0: none)
    ignored: int = 0
    cap: int = 0  # no growth above this size (a grow that did not pay); 0: sizes[-1]
    grown_from: int = 0  # the size before the last grow, until its first epoch is measured


class ElasticBook:
    """What an engine that runs real elastic trials (local, compss) needs to decide their sizes.

    The engine tells it when an elastic trial starts (``add``), reports (``on_report``), restarts on
    another number of ranks (``on_restart``) and ends (``remove``). When an elastic trial waits for
    the answer to a report (it is at an epoch boundary), ``decide`` returns the number of ranks it
    should continue with: fewer when submitted trials wait for cores it holds beyond its minimum,
    more when cores are idle and the policy ranks it first among the trials that can use them; 0 for
    no change. Cores promised to a trial not yet restarted count as taken.

    A grow must pay: a trial grows only after one whole epoch at its size was timed (report to report),
    and the first whole epoch after the grow must be at least 3 % faster; if not, the trial shrinks
    back and never grows past that size again. Where the work left is under two epochs, nothing grows.

    ``node_cpus``/``node_gpus``: what one node holds, where the engine's slots span several nodes (the
    compss engine: one COMPSs worker's computing units and GPUs). A size whose share of one node (its
    ranks over the trial's nodes, times the cores and GPUs per rank) exceeds them is never used: a
    one-node trial never grows past one worker, whatever the slots of the whole job.
    """

    def __init__(self, direction: str = "maximize", metric: str = "", *, node_cpus: int | None = None,
                 node_gpus: int | None = None) -> None:
        self.direction = direction
        self.metric = metric
        self.node_cpus = node_cpus
        self.node_gpus = node_gpus
        self._trials: dict[int, _Tracked] = {}

    def __contains__(self, number: object) -> bool:
        return number in self._trials

    def add(self, number: int, sizes: Sequence[int], cores_per_rank: int, policy: str, size: int,
            epochs: int | None, now: float, *, nodes: int = 1, gpus_per_rank: int = 0) -> None:
        """Track an elastic trial on ``size`` ranks that may run on ``sizes`` (those that fit one node's
        ``node_cpus``/``node_gpus`` per node; its first size is always kept)."""
        fits = tuple(k for k in sizes if self.fits_node(k, cores_per_rank, gpus_per_rank, nodes))
        kept = tuple(k for k in sizes if k == size or k in fits)
        self._trials[number] = _Tracked(number, kept or (size,), max(1, cores_per_rank), policy, size, epochs, now)

    def fits_node(self, ranks: int, cores_per_rank: int, gpus_per_rank: int = 0, nodes: int = 1) -> bool:
        """Whether ``ranks`` ranks spread over ``nodes`` nodes fit what one node holds."""
        per_node = -(-ranks // max(1, nodes))
        return ((self.node_cpus is None or per_node * max(1, cores_per_rank) <= self.node_cpus)
                and (self.node_gpus is None or per_node * gpus_per_rank <= self.node_gpus))

    def add_request(self, request: TrialRequest, now: float) -> None:
        """``add`` an elastic trial from its request (the built-in trainer's epochs tell the work left;
        a training function's are unknown); the study's direction and metric come with it."""
        self.direction, self.metric = request.direction, request.metric
        epochs = None if request.train.get("function") else request.train.get("epochs")
        self.add(request.number, request.elastic_sizes, request.cpus_per_process, request.elastic_policy,
                 request.processes, epochs if isinstance(epochs, int) else None, now, nodes=request.nodes,
                 gpus_per_rank=math.ceil(request.gpus_per_process))  # a share of a GPU: a GPU of its own

    def remove(self, number: int) -> None:
        self._trials.pop(number, None)

    def on_report(self, number: int, metrics: dict[str, float], now: float) -> None:
        t = self._trials.get(number)
        if t is None:
            return
        if t.last_report is not None:  # a whole epoch at this size (no start-up)
            t.epoch_s[t.size] = now - t.last_report
        t.last_report = now
        t.reports += 1
        value = metrics.get(self.metric)
        if value is not None:
            t.last_value = float(value)

    def on_restart(self, number: int, size: int, now: float) -> None:
        t = self._trials.get(number)
        if t is None:
            return
        t.grown_from = t.size if size > t.size else 0  # a grow is judged once its first epoch is timed
        t.size, t.target, t.ignored, t.last_report = size, 0, 0, None
        t.epoch_s.pop(size, None)  # measured afresh at this size

    def fit(self, number: int, free_cores: int) -> int:
        """The size to restart ``number`` with: its asked size, or the largest allowed that fits in
        ``free_cores`` (at least its minimum, whose cores the engine always keeps for it)."""
        t = self._trials[number]
        want = t.target or t.size
        fits = [k for k in t.sizes if k <= want and k * t.cores_per_rank <= free_cores]
        return max(fits) if fits else t.sizes[0]

    def promised(self, exclude: int | None = None) -> int:
        """Cores asked for by trials that will grow at their restart (not yet taken)."""
        return sum((t.target - t.size) * t.cores_per_rank for t in self._trials.values()
                   if t.number != exclude and t.target > t.size)

    def decide(self, number: int, free_cores: int, demand_cores: int) -> int:
        """The number of ranks trial ``number`` (at an epoch boundary now) should continue with; 0:
        as it is. ``free_cores``: idle now; ``demand_cores``: cores submitted trials wait for."""
        t = self._trials.get(number)
        if t is None:
            return 0
        if t.target and t.target != t.size:  # asked before, and it reported again without acting on it
            t.ignored += 1
            if t.ignored >= _IGNORED_LIMIT:
                log.warning(
                    "trial %d did not restart when asked to resize (a training function must save a checkpoint "
                    "before should_stop() and return when it is True); it keeps %d ranks", number, t.size)
                t.sizes, t.target = (t.size,), 0
                return 0
        t.target = self._target(t, free_cores, demand_cores)
        return t.target if t.target != t.size else 0

    def _target(self, t: _Tracked, free: int, demand: int) -> int:
        epoch_s = t.epoch_s
        if t.grown_from and t.size in epoch_s and t.grown_from in epoch_s:
            before = t.grown_from
            t.grown_from = 0
            if epoch_s[t.size] > _FASTER * epoch_s[before]:  # it did not pay: back, and no more of it
                t.cap = before
                return before
        if demand > 0 and t.size > t.sizes[0]:
            smaller = [k for k in t.sizes if k < t.size and (t.size - k) * t.cores_per_rank >= demand]
            return max(smaller) if smaller else t.sizes[0]
        if t.cap and t.size > t.cap:
            return t.cap
        if free - self.promised(exclude=t.number) <= 0 or (t.epochs is not None and t.epochs - t.reports < 2):
            return t.size
        # Idle cores: hand them out in the policy's order (re-planning what others were promised); this
        # trial grows by what is left for it.
        ranked = ELASTIC.get(t.policy)([self._candidate(x) for x in self._trials.values() if self._can_grow(x)],
                                       self.direction)
        left = free
        for c in ranked:
            x = self._trials[c.number]
            grow = max((k for k in x.sizes if k <= self._ceiling(x) and (k - x.size) * x.cores_per_rank <= left),
                       default=x.size)
            if x.number == t.number:
                return grow
            left -= (grow - x.size) * x.cores_per_rank
        return t.size

    def _ceiling(self, t: _Tracked) -> int:
        return t.cap or t.sizes[-1]

    def _can_grow(self, t: _Tracked) -> bool:
        """Below its ceiling, with two epochs left, and one whole epoch measured at its size since it
        last started (a grow is judged against it)."""
        return (t.size < self._ceiling(t) and (t.epochs is None or t.epochs - t.reports >= 2)
                and t.size in t.epoch_s)

    def _candidate(self, t: _Tracked) -> Candidate:
        epoch_s = t.epoch_s.get(t.size, 1.0)
        left = (t.epochs - t.reports) if t.epochs is not None else 1
        return Candidate(t.number, t.size, self._ceiling(t), max(0, left) * epoch_s, t.started, t.last_value)


@dataclass
class Segments:
    """An elastic trial's runs, one per size, as its engine sees them: the current one's start and
    size, and what the ended ones add up to (core-seconds, resizes, the most ranks, system usage)."""

    start: float
    ranks: int
    cpus_per_rank: int
    core_s: float = 0.0
    resizes: int = 0
    max_ranks: int = 0
    usage: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.max_ranks = max(self.max_ranks, self.ranks)

    def restart(self, now: float, ranks: int, usage: Sequence[dict[str, float]]) -> None:
        """The current segment ended at ``now`` with this ``usage``; the next one runs on ``ranks``."""
        self.core_s += (now - self.start) * self.ranks * self.cpus_per_rank
        self.usage += [u for u in usage if u]
        self.start, self.ranks = now, ranks
        self.resizes += 1
        self.max_ranks = max(self.max_ranks, ranks)

    def timings(self, now: float) -> dict[str, float]:
        """The result's timings: core-seconds held over every segment, resizes, the most ranks."""
        core_s = self.core_s + (now - self.start) * self.ranks * self.cpus_per_rank
        return {"core_s": core_s, "resizes": float(self.resizes), "max_ranks": float(self.max_ranks)}

    def system(self, last: Sequence[dict[str, float]]) -> dict[str, float] | None:
        """System usage over every segment (the last one's ``last`` included); None when only one ran."""
        return aggregate_usage([*self.usage, *last]) if self.usage else None
