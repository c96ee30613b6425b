"""Optuna's stopping pruners, answering from an index of the study kept up to date as trials change.

Optuna's ``PercentilePruner`` and ``MedianPruner`` read every COMPLETE trial at each call, and its
``SuccessiveHalvingPruner`` and ``HyperbandPruner`` every trial's system attrs at each rung: O(N) per
report (measured at 10,000 trials: 14 ms of driver CPU per trial inside ASHA's). The subclasses here take the same
arguments and give the same decisions, from an index fed by ``observe(changed, gone)``:

- percentile, median: per step, the COMPLETE trials' values there, sorted (NaN counted for
  ``n_min_trials`` but left out of the percentile, as ``np.nanpercentile`` leaves it), and the count of
  COMPLETE trials (``n_startup_trials``); the percentile is interpolated as ``np.nanpercentile`` does.
- successive halving: per ``completed_rung_K`` system attr, the values of every trial that has it
  (running ones included, as Optuna reads them), sorted; the values the pruner writes go in at once.
- hyperband: the same per bracket.

So ``prune`` costs a binary search and a sorted insert (O(log N), the insert's move O(rung size)), and
the trial's own curve (its last two steps and best value) is kept per running trial, updated from its
newest report.

The contract of ``observe(changed, gone)`` (the signature of ``hpoflow.run.ledger.Tally.watch``
callbacks): ``changed``, trials of the study whose record is new or changed; ``gone``, numbers of trials
interrupted and rerun, left out of the index from then on. The first call carries every trial of the
study so far (``observe([], set())`` on a study with none). It is idempotent: a record seen again with
the same content changes nothing, one with new content replaces that trial's part. From the first call
on, ``prune`` answers from the index, so its decisions are Optuna's on the study as last observed plus
this pruner's own writes: the caller feeds it every change it reads (hpoflow's driver: the whole study
at its first read, then what each read finds changed, and each trial it tells, at once).
With several drivers on one storage, another driver's completions and rung values count from this
driver's next read of the storage (Optuna's pruner would read them at the call). The one other
difference: a trial interrupted and rerun (``gone``) is left out, where Optuna would count the
interrupted attempt's rung values beside its rerun's.

Never fed (a study run by Optuna's own loop), ``prune`` is the parent's: Optuna's code, O(N) per call.
Indexing from ``study.get_trials()`` at each call instead would cost O(N) too, plus comparing every
record (a database storage hands out new objects at each read) to find what changed; the parent gives
the very decisions at that cost, and shares its state (an estimated ``min_resource``, the brackets)
with the indexed path, so a pruner fed later goes on from it.

One instance indexes one study, from one thread (the driver's loop), as hpoflow builds one per study.
"""

from __future__ import annotations

import binascii
import bisect
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import optuna
from optuna.pruners import HyperbandPruner, MedianPruner, PercentilePruner, SuccessiveHalvingPruner
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

__all__ = ["IndexedHyperbandPruner", "IndexedMedianPruner", "IndexedPercentilePruner",
           "IndexedSuccessiveHalvingPruner", "TrialObserver", "nanpercentile_sorted"]

_RUNG_PREFIX = "completed_rung_"  # Optuna's SuccessiveHalvingPruner: system attr completed_rung_{K}


@runtime_checkable
class TrialObserver(Protocol):
    """A pruner (or any index) fed the study's changed trials (``Tally.watch``'s callbacks)."""

    def observe(self, changed: list[FrozenTrial], gone: set[int]) -> None:
        """Take in ``changed`` (new or changed records) and leave ``gone`` (interrupted and rerun) out."""


def nanpercentile_sorted(values: list[float], percentile: float) -> float:
    """``np.nanpercentile(values, percentile)`` (linear interpolation) of ``values``, sorted ascending and
    without NaN; NaN when empty. The same float operations as NumPy's, so the same result to the bit."""
    n = len(values)
    if n == 0:
        return math.nan
    virtual = (n - 1) * (percentile / 100)
    if virtual >= n - 1:  # NumPy takes the last element twice, with its index as -1 in the weight
        below = above = n - 1
        gamma = virtual + 1
    else:
        below = math.floor(virtual)
        above = below + 1
        gamma = virtual - below
    a, b = values[below], values[above]
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


def _remove(values: list[float], value: float) -> None:
    i = bisect.bisect_left(values, value)
    if i < len(values) and values[i] == value:
        del values[i]


def _nan_min(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else min(a, b)


def _nan_max(a: float, b: float) -> float:
    return b if math.isnan(a) else a if math.isnan(b) else max(a, b)


@dataclass(frozen=True, slots=True)
class _Curve:
    """A trial's intermediate values as its pruning needs them: ``n`` values, the last step (-1: none),
    the step before it (-1: none), the least and greatest values (NaN left out; NaN when all are)."""

    n: int
    last: int
    second: int
    low: float
    high: float


def _curve(values: dict[int, float]) -> _Curve:
    last = second = -1
    low = high = math.nan
    for step, v in values.items():
        if step > last:
            last, second = step, last
        elif step > second:
            second = step
        low, high = _nan_min(low, v), _nan_max(high, v)
    return _Curve(len(values), last, second, low, high)


class _Index:
    """What ``observe`` keeps (``_put`` and ``_drop``: each index's part), and the curves of the running
    trials pruned here."""

    def __init__(self) -> None:
        self.fed = False
        self.gone: set[int] = set()
        self._curves: dict[int, _Curve] = {}

    def observe(self, changed: list[FrozenTrial], gone: set[int]) -> None:
        self.fed = True
        for number in gone - self.gone:
            self.gone.add(number)
            self._drop(number)
            self._curves.pop(number, None)
        for t in changed:
            if t.number in self.gone:
                continue
            self._put(t)
            if t.state.is_finished():
                self._curves.pop(t.number, None)

    def curve(self, trial: FrozenTrial) -> _Curve:
        """``trial``'s curve: from the one kept when its only new value is at a step past its last (reports
        come in step order), else from all its values."""
        values = trial.intermediate_values
        n = len(values)
        old = self._curves.get(trial.number)
        if old is not None and old.n == n:  # (Optuna keeps a step's first value: values are only added)
            return old
        if old is not None and n == old.n + 1:
            step = next(reversed(values))  # the newest, where values are added in order
            if step > old.last:  # then it is the one new step, and the greatest
                v = values[step]
                new = _Curve(n, step, old.last, _nan_min(old.low, v), _nan_max(old.high, v))
                self._curves[trial.number] = new
                return new
        new = _curve(values)
        if not trial.state.is_finished() and trial.number not in self.gone:
            self._curves[trial.number] = new
        return new

    def _put(self, t: FrozenTrial) -> None:
        raise NotImplementedError

    def _drop(self, number: int) -> None:
        raise NotImplementedError


@dataclass
class _Column:
    """The COMPLETE trials' values at one step: how many (NaN included), and the others sorted."""

    count: int = 0
    values: list[float] = field(default_factory=list)


class _Percentiles(_Index):
    def __init__(self) -> None:
        super().__init__()
        self.n_complete = 0
        self._of: dict[int, dict[int, float]] = {}  # COMPLETE trial -> its values, as indexed
        self.columns: dict[int, _Column] = {}

    def _put(self, t: FrozenTrial) -> None:
        old = self._of.get(t.number)
        if t.state != TrialState.COMPLETE:
            if old is not None:
                self._drop(t.number)
            return
        if old is not None:
            if old == t.intermediate_values:
                return
            self._drop(t.number)
        values = self._of[t.number] = t.intermediate_values  # (a finished trial's record never changes: not copied)
        self.n_complete += 1
        for step, v in values.items():
            column = self.columns.get(step)
            if column is None:
                column = self.columns[step] = _Column()
            column.count += 1
            if not math.isnan(v):
                bisect.insort(column.values, v)

    def _drop(self, number: int) -> None:
        values = self._of.pop(number, None)
        if values is None:
            return
        self.n_complete -= 1
        for step, v in values.items():
            column = self.columns[step]
            column.count -= 1
            if not math.isnan(v):
                _remove(column.values, v)
            if column.count == 0:
                del self.columns[step]


class IndexedPercentilePruner(PercentilePruner):
    """``optuna.pruners.PercentilePruner`` (same arguments, same decisions) answering from an index of the
    COMPLETE trials' values per step, fed by ``observe`` (module docstring); unfed, Optuna's ``prune``."""

    def __init__(self, percentile: float, n_startup_trials: int = 5, n_warmup_steps: int = 0,
                 interval_steps: int = 1, *, n_min_trials: int = 1) -> None:
        super().__init__(percentile, n_startup_trials, n_warmup_steps, interval_steps, n_min_trials=n_min_trials)
        self._index = _Percentiles()

    def observe(self, changed: list[FrozenTrial], gone: set[int]) -> None:
        """Index ``changed`` and leave ``gone`` out (module docstring); from now on ``prune`` reads the index."""
        self._index.observe(changed, gone)

    def prune(self, study: optuna.study.Study, trial: FrozenTrial) -> bool:
        index = self._index
        if not index.fed:
            return super().prune(study, trial)
        n = index.n_complete
        if n == 0 or n < self._n_startup_trials:
            return False
        curve = index.curve(trial)
        step = curve.last
        if curve.n == 0 or step < self._n_warmup_steps:
            return False
        warmup, interval = self._n_warmup_steps, self._interval_steps
        if curve.second >= (step - warmup) // interval * interval + warmup:  # not the interval's first report
            return False
        maximize = study.direction == StudyDirection.MAXIMIZE
        best = curve.high if maximize else curve.low
        if math.isnan(best):
            return True
        column = index.columns.get(step)
        if column is None or column.count < self._n_min_trials or not column.values:
            return False  # (too few trials at the step, or only NaN there: Optuna's percentile is NaN)
        p = nanpercentile_sorted(column.values, 100 - self._percentile if maximize else self._percentile)
        if math.isnan(p):
            return False
        return best < p if maximize else best > p


class IndexedMedianPruner(MedianPruner, IndexedPercentilePruner):
    """``optuna.pruners.MedianPruner`` (same arguments, same decisions) answering from the index of
    ``IndexedPercentilePruner``."""


def _rung_values(attrs: dict[str, Any]) -> dict[str, float]:
    """A trial's ``completed_rung_K`` system attrs with a number (NaN left out: the pruner never writes one,
    a NaN value prunes first)."""
    return {k: float(v) for k, v in attrs.items() if k.startswith(_RUNG_PREFIX)
            and isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v)}


class _Rungs(_Index):
    """The rung values of every trial, sorted per (bracket, rung key) once ``bracket_of`` is known; the last
    step of each COMPLETE trial (for an ``auto`` resource)."""

    def __init__(self, bracket_of: Callable[[int], int] | None) -> None:
        super().__init__()
        self._bracket_of = bracket_of
        self._of: dict[int, dict[str, float]] = {}
        self._sorted: dict[tuple[int, str], list[float]] = {}
        self.complete_steps: dict[int, int] = {}

    def rebracket(self, bracket_of: Callable[[int], int]) -> None:
        """Sort the values per bracket as ``bracket_of`` assigns trials (once, when the brackets are known)."""
        self._bracket_of = bracket_of
        self._sorted = {}
        for number, attrs in self._of.items():
            b = bracket_of(number)
            for key, v in attrs.items():
                self._sorted.setdefault((b, key), []).append(v)
        for values in self._sorted.values():
            values.sort()

    def values(self, bracket: int, key: str) -> Sequence[float]:
        """The values at rung ``key`` of the trials of ``bracket``, ascending."""
        return self._sorted.get((bracket, key), ())

    def add(self, number: int, key: str, value: float) -> None:
        """Trial ``number`` reached rung ``key`` with ``value`` (this pruner wrote it)."""
        if number not in self.gone:
            self._set(number, {**self._of.get(number, {}), key: value})

    def _put(self, t: FrozenTrial) -> None:
        self._set(t.number, _rung_values(t.system_attrs))
        step = t.last_step if t.state == TrialState.COMPLETE else None
        if step is None:
            self.complete_steps.pop(t.number, None)
        else:
            self.complete_steps[t.number] = step

    def _drop(self, number: int) -> None:
        self._set(number, {})
        self.complete_steps.pop(number, None)

    def _set(self, number: int, attrs: dict[str, float]) -> None:
        old = self._of.get(number, {})
        if old == attrs:
            return
        if self._bracket_of is not None:
            b = self._bracket_of(number)
            for key, v in old.items():
                if attrs.get(key) != v:
                    _remove(self._sorted[(b, key)], v)
            for key, v in attrs.items():
                if old.get(key) != v:
                    bisect.insort(self._sorted.setdefault((b, key), []), v)
        if attrs:
            self._of[number] = attrs
        else:
            self._of.pop(number, None)


def _one_bracket(number: int) -> int:
    """Successive halving's one bracket (a function, not a lambda: the pruner pickles with its study)."""
    return 0


def _promotable(value: float, competing: Sequence[float], reduction_factor: int, maximize: bool) -> bool:
    """Optuna's ``_is_trial_promotable_to_next_rung`` with ``value`` among ``competing`` (sorted, without it)."""
    n = len(competing) + 1
    idx = max(n // reduction_factor - 1, 0)
    k = n - 1 - idx if maximize else idx  # the threshold's place in the sorted values, ``value`` included
    at = bisect.bisect_left(competing, value)
    threshold = competing[k] if k < at else value if k == at else competing[k - 1]
    return value >= threshold if maximize else value <= threshold


def _halve(sh: SuccessiveHalvingPruner, rungs: _Rungs, bracket: int, study: optuna.study.Study,
           trial: FrozenTrial) -> bool:
    """``SuccessiveHalvingPruner.prune`` (of ``sh``'s arguments) on the trials of ``bracket`` in ``rungs``."""
    curve = rungs.curve(trial)
    if curve.n == 0:
        return False
    step = curve.last
    rung = 0
    attrs = trial.system_attrs  # (Optuna's trial reads them from the storage)
    while f"{_RUNG_PREFIX}{rung}" in attrs:
        rung += 1
    value = trial.intermediate_values[step]
    while True:
        if sh._min_resource is None:  # auto: the longest COMPLETE trial's last step / 100
            if not rungs.complete_steps:
                return False
            sh._min_resource = max(max(rungs.complete_steps.values()) // 100, 1)
        if step < sh._min_resource * sh._reduction_factor ** (sh._min_early_stopping_rate + rung):
            return False
        if math.isnan(value):
            return True
        key = f"{_RUNG_PREFIX}{rung}"
        study._storage.set_trial_system_attr(trial._trial_id, key, value)
        competing = rungs.values(bracket, key)
        prune = len(competing) + 1 <= sh._bootstrap_count or not _promotable(
            value, competing, sh._reduction_factor, study.direction == StudyDirection.MAXIMIZE)
        rungs.add(trial.number, key, value)
        if prune:
            return True
        rung += 1


class IndexedSuccessiveHalvingPruner(SuccessiveHalvingPruner):
    """``optuna.pruners.SuccessiveHalvingPruner`` (same arguments, same decisions, the same
    ``completed_rung_K`` system attrs written) answering from an index of the rung values, fed by
    ``observe`` (module docstring); unfed, Optuna's ``prune``."""

    def __init__(self, min_resource: str | int = "auto", reduction_factor: int = 4,
                 min_early_stopping_rate: int = 0, bootstrap_count: int = 0) -> None:
        super().__init__(min_resource, reduction_factor, min_early_stopping_rate, bootstrap_count)
        self._rungs = _Rungs(_one_bracket)

    def observe(self, changed: list[FrozenTrial], gone: set[int]) -> None:
        """Index ``changed`` and leave ``gone`` out (module docstring); from now on ``prune`` reads the index."""
        self._rungs.observe(changed, gone)

    def prune(self, study: optuna.study.Study, trial: FrozenTrial) -> bool:
        if not self._rungs.fed:
            return super().prune(study, trial)
        return _halve(self, self._rungs, 0, study, trial)


class IndexedHyperbandPruner(HyperbandPruner):
    """``optuna.pruners.HyperbandPruner`` (same arguments, same brackets, same decisions) answering from an
    index of the rung values per bracket, fed by ``observe`` (module docstring); unfed, Optuna's ``prune``.
    A trial's bracket depends on the study's name, known at the first ``prune``: until the brackets are
    made (``max_resource: auto`` waits for a COMPLETE trial), the values are kept per trial only."""

    def __init__(self, min_resource: int = 1, max_resource: str | int = "auto", reduction_factor: int = 3,
                 bootstrap_count: int = 0) -> None:
        super().__init__(min_resource, max_resource, reduction_factor, bootstrap_count)
        self._rungs = _Rungs(None)
        self._indexed_study: str | None = None  # the study whose name the index's brackets were made with

    def observe(self, changed: list[FrozenTrial], gone: set[int]) -> None:
        """Index ``changed`` and leave ``gone`` out (module docstring); from now on ``prune`` reads the index."""
        self._rungs.observe(changed, gone)

    def prune(self, study: optuna.study.Study, trial: FrozenTrial) -> bool:
        if not self._rungs.fed:
            return super().prune(study, trial)
        if not self._pruners:
            if self._max_resource == "auto":  # Optuna's: the longest COMPLETE trial's last step + 1
                if not self._rungs.complete_steps:
                    return False
                self._max_resource = max(self._rungs.complete_steps.values()) + 1
            self._try_initialization(study)  # (max_resource known: reads nothing)
            if not self._pruners:
                return False
        if self._indexed_study != study.study_name:
            self._indexed_study = study.study_name
            self._rungs.rebracket(self._bracket_of)
        bracket = self._bracket_of(trial.number)
        return _halve(self._pruners[bracket], self._rungs, bracket, study, trial)

    def _bracket_of(self, number: int) -> int:
        """``HyperbandPruner._get_bracket_id`` of trial ``number`` of the indexed study (its arithmetic:
        the trial's hash, spread over the brackets in proportion to their trial budgets)."""
        n = binascii.crc32(f"{self._indexed_study}_{number}".encode()) % self._total_trial_allocation_budget
        for bracket, budget in enumerate(self._trial_allocation_budgets):
            n -= budget
            if n < 0:
                return bracket
        raise RuntimeError(f"no bracket for trial {number}: budgets {self._trial_allocation_budgets} "
                           f"(total {self._total_trial_allocation_budget})")
