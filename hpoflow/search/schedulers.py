"""Schedulers that reuse training: a trial pauses at a rung with a checkpoint and is resumed later.

``search.scheduler: {type: asha, ...}`` (promotion-type ASHA, Li et al. 2020, "A System for Massively
Parallel Hyperparameter Tuning", Algorithm 2) and ``{type: hyperband, ...}`` (the same per bracket).
Rungs are the steps ``min_resource * reduction_factor**k`` below ``max_resource`` (default: the trial's
``training.epochs``); a Hyperband trial's bracket ``s`` (trial number modulo the number of brackets)
starts its rungs at ``min_resource * reduction_factor**s``.

- A trial reaches a rung at its first report whose step is at or past it (``step >= rung``, as Ray
  Tune's and Optuna's ASHA): a trial that reports steps 2, 4, 6 reaches rung 3 at step 4, and a step
  counted in another unit than the rungs still meets them. Each rung is reached once; a report past
  several rungs the trial has not reached reaches the highest of them only (the lower ones are skipped
  for good, as in Ray Tune: the value belongs to the furthest point it stands for), and a report below a
  rung it reached already reaches nothing (``at_rung``).
- At a rung report, the trial's value joins the rung. If it is in the top ``1/reduction_factor`` of
  the rung's values it goes on at once (a promotion without a pause); otherwise the driver answers
  "pause": the trial checkpoints at that step and stops (``Engine.answer(..., pause=True)``), and its
  slot goes to the next job. It is paused "at the rung" (``ATTR_PAUSED``, where its promotion is
  ranked), whatever step past it the report had.
- The next job (``next_promotion``): a paused trial now in the top ``1/reduction_factor`` of its rung,
  the highest rung first (the rung grew since it paused); else a new configuration. It resumes from its
  checkpoint, with the same config, so it continues bitwise where an unpaused run would be.
- Nothing waits for stragglers: every decision is made from the rung values known at that moment.

The state lives in the Optuna storage (``hpoflow.run.ledger``: ``ATTR_RUNGS``, ``ATTR_PAUSED``,
``ATTR_BRACKET``), so a resumed study, or another driver of the study, continues the brackets: a paused
trial is RUNNING, holds no slot, and any driver may promote it. When no configuration may start
(``n_trials`` reached), nothing runs and none is promotable, the paused trials are told PRUNED.
"""

from __future__ import annotations

import math
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from hpoflow.registry import Options
from hpoflow.run.ledger import ATTR_BRACKET, ATTR_PAUSED, ATTR_RUNGS, interrupted

__all__ = ["PromotionScheduler", "asha", "hyperband", "rungs_of"]

_Pool = list[tuple[float, int]]  # (value, trial number) of the trials that reached one rung


def rungs_of(min_resource: int, eta: int, max_resource: int, bracket: int) -> list[int]:
    """The rung steps of ``bracket``: ``min_resource * eta**(bracket + k)`` below ``max_resource``."""
    out, r = [], min_resource * eta**bracket
    while r < max_resource:
        out.append(r)
        r *= eta
    return out


class PromotionScheduler:
    """Promotion-type ASHA (``brackets=False``) or Hyperband (one ASHA per bracket): see the module
    docstring. Pure decisions over the study's trials; the driver writes what they say."""

    def __init__(self, options: Options, direction: str, *, hyperband: bool = False) -> None:
        self.min_resource = int(getattr(options, "min_resource", 1))
        self.eta = int(getattr(options, "reduction_factor", 3))
        self.max_resource: int | None = getattr(options, "max_resource", None)
        self.base = int(getattr(options, "min_early_stopping_rate", 0))
        self.hyperband = hyperband
        self.maximize = direction == "maximize"

    def n_brackets(self, max_resource: int) -> int:
        if not self.hyperband:
            return 1
        return max(1, math.floor(math.log(max_resource / self.min_resource, self.eta) + 1e-9) + 1)

    def bracket(self, number: int, attrs: dict[str, Any], max_resource: int) -> int:
        b = attrs.get(ATTR_BRACKET)
        if isinstance(b, int):
            return b
        return self.base + (number % self.n_brackets(max_resource) if self.hyperband else 0)

    def rungs(self, bracket: int, max_resource: int) -> list[int]:
        return rungs_of(self.min_resource, self.eta, self.max_resource or max_resource, bracket)

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.maximize else a < b

    def _pools(self, trials: list[FrozenTrial], skip: int | None = None) -> dict[tuple[int, str], _Pool]:
        """(bracket, step) -> [(value, number)] of every trial that reached that rung (reruns of an
        interrupted trial stand for it: the interrupted one is left out)."""
        gone = interrupted(trials)
        pools: dict[tuple[int, str], list[tuple[float, int]]] = {}
        for t in trials:
            rungs = t.user_attrs.get(ATTR_RUNGS)
            if t.number in gone or t.number == skip or not isinstance(rungs, dict):
                continue
            b = t.user_attrs.get(ATTR_BRACKET, 0)
            for step, v in rungs.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    pools.setdefault((int(b), str(step)), []).append((float(v), t.number))
        return pools

    def _top(self, pool: list[tuple[float, int]]) -> set[int]:
        ordered = sorted(pool, key=lambda p: (-p[0] if self.maximize else p[0], p[1]))
        return {n for _, n in ordered[: len(pool) // self.eta]}

    def at_rung(self, number: int, attrs: dict[str, Any], step: int, max_resource: int) -> tuple[int, int] | None:
        """``(bracket, rung)`` when a report at ``step`` reaches a rung of the trial, else None: the highest
        rung at or below ``step`` unless the trial reached it (or a higher one) already (``attrs``: its
        ``ATTR_RUNGS``). A step that passes several rungs at once reaches the highest of them only."""
        b = self.bracket(number, attrs, max_resource)
        recorded = attrs.get(ATTR_RUNGS)
        reached = {int(k) for k in recorded} if isinstance(recorded, dict) else set()
        for rung in sorted(self.rungs(b, max_resource), reverse=True):
            if rung in reached:
                return None  # its decision at this rung (or a higher one) was made: the lower ones are past
            if step >= rung:
                return b, rung
        return None

    def goes_on(self, trials: list[FrozenTrial], number: int, bracket: int, rung: int, value: float) -> bool:
        """Whether trial ``number``, reaching ``rung`` with ``value``, is in the top 1/eta of the rung
        (counting itself) and goes on; False: pause it."""
        pool = self._pools(trials, skip=number).get((bracket, str(rung)), [])
        return number in self._top([*pool, (value, number)])

    def next_promotion(self, trials: list[FrozenTrial], busy: set[int]) -> FrozenTrial | None:
        """A paused trial to resume (not in ``busy``): in the top 1/eta of its rung, the highest rung
        first, the best value first; None if none is."""
        pools = self._pools(trials)
        best: tuple[tuple[float, ...], FrozenTrial] | None = None
        for t in trials:
            step = t.user_attrs.get(ATTR_PAUSED)
            if t.state != TrialState.RUNNING or step is None or t.number in busy:
                continue
            b = int(t.user_attrs.get(ATTR_BRACKET, 0))
            pool = pools.get((b, str(step)), [])
            if t.number not in self._top(pool):
                continue
            value = dict((n, v) for v, n in pool)[t.number]
            key = (float(step), value if self.maximize else -value, -t.number)
            if best is None or key > best[0]:
                best = (key, t)
        return best[1] if best is not None else None


def asha(options: Options, direction: str) -> PromotionScheduler:
    """``search.scheduler: {type: asha}``: promotion-type ASHA."""
    return PromotionScheduler(options, direction)


def hyperband(options: Options, direction: str) -> PromotionScheduler:
    """``search.scheduler: {type: hyperband}``: promotion-type ASHA in each Hyperband bracket."""
    return PromotionScheduler(options, direction, hyperband=True)
