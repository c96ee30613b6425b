"""Schedulers that reuse training: a trial pauses at a rung with a checkpoint and is resumed later.

``search.scheduler: {type: asha, ...}`` (promotion-type ASHA, Li et al. 2020, "A System for Massively
Parallel Hyperparameter Tuning", Algorithm 2) and ``{type: hyperband, ...}`` (the same per bracket).
Rungs follow Hyperband's geometry (``rungs_of``): ``max_resource / reduction_factor**k`` rounded, down to
``min_resource`` (``max_resource`` defaults to the trial's ``training.epochs``; 52 epochs: 2, 6, 17), or
with ``anchor: min`` the steps ``min_resource * reduction_factor**k`` (1, 3, 9, 27). A Hyperband trial's
bracket ``s`` (trial number modulo the number of brackets) has the ``s`` lowest rungs removed.

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

``Rungs`` keeps those decisions cheap in a long study: each rung's values in rank order and the trials
paused at it, updated from the trials that changed since the driver's last read (``Tally.watch``), so a
decision costs a binary search, not a pass over every trial.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from typing import Any

from optuna.trial import FrozenTrial, TrialState

from hpoflow.registry import Options
from hpoflow.run.ledger import ATTR_BRACKET, ATTR_PAUSED, ATTR_RUNGS, interrupted

__all__ = ["PromotionScheduler", "Rungs", "asha", "first_rung", "hyperband", "rungs_of"]

_Entry = tuple[float, int]  # (rank key: the value, negated when maximizing; trial number): smaller is better
_Key = tuple[int, str]  # (bracket, rung step) of a pool


def rungs_of(min_resource: int, eta: int, max_resource: int, bracket: int, anchor: str = "max") -> list[int]:
    """The rung steps of ``bracket`` (bracket 0 has the most rungs; each bracket after it one fewer).

    ``anchor="max"``, Hyperband's geometry (Li et al. 2018): ``max_resource / eta**k`` for ``k`` from 1
    to ``s_max - bracket``, rounded to the nearest step, ``s_max = floor(log_eta(max_resource /
    min_resource))``: the last rung is 1/eta of the full budget and none is below ``min_resource``
    (52 epochs, eta 3: rungs 2, 6, 17). ``anchor="min"``: ``min_resource * eta**(bracket + k)`` below
    ``max_resource`` (a grace period and its multiples, as Optuna's and Ray Tune's ASHA: 1, 3, 9, 27)."""
    if anchor == "min":
        out, r = [], min_resource * eta**bracket
        while r < max_resource:
            out.append(r)
            r *= eta
        return out
    s_max = math.floor(math.log(max_resource / min_resource, eta) + 1e-9) if max_resource > min_resource else 0
    steps = {max(min_resource, math.floor(max_resource / eta**k + 0.5)) for k in range(1, s_max - bracket + 1)}
    return sorted(r for r in steps if r < max_resource)


def first_rung(max_resource: int, eta: int = 3, min_resource: int = 1) -> int:
    """The lowest rung of Hyperband's geometry (``rungs_of(..., anchor="max")``): where a pruner that is not
    told otherwise first judges a trial (``hpoflow.search.options``: ``min_resource`` and ``warmup_steps``
    ``auto``). ``min_resource`` when there is no rung below ``max_resource``."""
    rungs = rungs_of(min_resource, eta, max_resource, 0)
    return rungs[0] if rungs else min_resource


class PromotionScheduler:
    """Promotion-type ASHA (``brackets=False``) or Hyperband (one ASHA per bracket): see the module
    docstring. Pure decisions over the study's trials; the driver writes what they say."""

    def __init__(self, options: Options, direction: str, *, hyperband: bool = False) -> None:
        self.min_resource = int(getattr(options, "min_resource", 1))
        self.eta = int(getattr(options, "reduction_factor", 3))
        self.max_resource: int | None = getattr(options, "max_resource", None)
        self.base = int(getattr(options, "min_early_stopping_rate", 0))
        self.anchor = str(getattr(options, "anchor", "max"))
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
        return rungs_of(self.min_resource, self.eta, self.max_resource or max_resource, bracket, self.anchor)

    def _better(self, a: float, b: float) -> bool:
        return a > b if self.maximize else a < b

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
        return Rungs.of(self, trials).goes_on(number, bracket, rung, value)

    def next_promotion(self, trials: list[FrozenTrial], busy: set[int]) -> FrozenTrial | None:
        """A paused trial to resume (not in ``busy``): in the top 1/eta of its rung, the highest rung
        first, the best value first; None if none is."""
        return Rungs.of(self, trials).next_promotion(busy)


class Rungs:
    """The rungs of a study's trials for ``policy``'s decisions (``goes_on``, ``next_promotion``), kept up to
    date by ``update`` with the trials that changed (``hpoflow.run.ledger.Tally.watch``): per (bracket,
    rung) the values in rank order, and the trials paused there in the same order. A trial interrupted
    and rerun is left out (its rerun stands for it)."""

    def __init__(self, policy: PromotionScheduler) -> None:
        self.policy = policy
        self._pools: dict[_Key, list[_Entry]] = {}  # every value at the rung, best first
        self._paused: dict[_Key, list[_Entry]] = {}  # the entries of the trials paused at the rung, best first
        self._of: dict[int, dict[_Key, _Entry]] = {}  # trial number -> its entries
        self._paused_at: dict[int, tuple[_Key, _Entry]] = {}  # paused trial -> its rung and entry
        self._trials: dict[int, FrozenTrial] = {}  # paused trial -> its record
        self._gone: set[int] = set()

    @classmethod
    def of(cls, policy: PromotionScheduler, trials: list[FrozenTrial]) -> Rungs:
        """The rungs of ``trials`` (a whole study, read once)."""
        made = cls(policy)
        made.update(trials, interrupted(trials))
        return made

    def update(self, changed: list[FrozenTrial], gone: set[int]) -> None:
        """Take in the trials new or changed since the last update, and those interrupted and rerun."""
        for n in gone:
            self._gone.add(n)
            self._drop(n)
        for t in changed:
            self._drop(t.number)
            if t.number not in self._gone:
                self._add(t)

    def goes_on(self, number: int, bracket: int, rung: int, value: float) -> bool:
        """``PromotionScheduler.goes_on``: the rung's values, trial ``number``'s own replaced by ``value``."""
        key = (bracket, str(rung))
        pool = self._pools.get(key, [])
        entry = (self._rank_key(value), number)
        own = self._of.get(number, {}).get(key)
        better = bisect_left(pool, entry) - (1 if own is not None and own < entry else 0)
        size = len(pool) - (1 if own is not None else 0) + 1
        return better < size // self.policy.eta

    def next_promotion(self, busy: set[int]) -> FrozenTrial | None:
        """``PromotionScheduler.next_promotion``. In each rung the paused trials are ranked as the rung's
        values are, so the best of them that is in the rung's top is that rung's candidate, and once one is
        out of the top every paused trial after it is too."""
        best: tuple[tuple[float, ...], FrozenTrial] | None = None
        for key, paused in self._paused.items():
            pool = self._pools[key]
            top = len(pool) // self.policy.eta
            for entry in paused:
                if bisect_left(pool, entry) >= top:
                    break
                if entry[1] in busy:
                    continue
                rank = (float(key[1]), -entry[0], -entry[1])  # the highest rung, the best value, the oldest
                if best is None or rank > best[0]:
                    best = (rank, self._trials[entry[1]])
                break
        return best[1] if best is not None else None

    # -- internals --------------------------------------------------------------------------------
    def _rank_key(self, value: float) -> float:
        return -value if self.policy.maximize else value

    def _add(self, t: FrozenTrial) -> None:
        attrs = t.user_attrs
        rungs = attrs.get(ATTR_RUNGS)
        if not isinstance(rungs, dict):
            return
        b = int(attrs.get(ATTR_BRACKET, 0))
        mine: dict[_Key, _Entry] = {}
        for step, v in rungs.items():
            if isinstance(v, int | float) and math.isfinite(v):
                key, entry = (b, str(step)), (self._rank_key(float(v)), t.number)
                insort(self._pools.setdefault(key, []), entry)
                mine[key] = entry
        self._of[t.number] = mine
        step = attrs.get(ATTR_PAUSED)
        if t.state == TrialState.RUNNING and step is not None:
            key = (b, str(step))
            if key in mine:  # (a trial paused where it has no value is in no top: never promoted)
                insort(self._paused.setdefault(key, []), mine[key])
                self._paused_at[t.number] = (key, mine[key])
                self._trials[t.number] = t

    def _drop(self, number: int) -> None:
        for key, entry in self._of.pop(number, {}).items():
            _remove(self._pools[key], entry)
        at = self._paused_at.pop(number, None)
        if at is not None:
            _remove(self._paused[at[0]], at[1])
            del self._trials[number]


def _remove(entries: list[_Entry], entry: _Entry) -> None:
    i = bisect_left(entries, entry)
    if i < len(entries) and entries[i] == entry:
        del entries[i]


def asha(options: Options, direction: str) -> PromotionScheduler:
    """``search.scheduler: {type: asha}``: promotion-type ASHA."""
    return PromotionScheduler(options, direction)


def hyperband(options: Options, direction: str) -> PromotionScheduler:
    """``search.scheduler: {type: hyperband}``: promotion-type ASHA in each Hyperband bracket."""
    return PromotionScheduler(options, direction, hyperband=True)
