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

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Candidate", "fifo", "longest_remaining", "most_promising", "speedup"]


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
