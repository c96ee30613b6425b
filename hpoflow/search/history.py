"""What a model-based sampler is fitted on: the study's trials as a view shows them, kept from what changed,
and at most ``max_history`` of them once the study holds more.

A model-based sampler (TPE, BOHB's model, GP) reads every trial of the study at every ask. With thousands
of trials and hundreds running, that read and the model's fit over it cost more than the rest of the
driver: Optuna's TPE took 282 ms an ask over 10,000 finished and 1,024 running trials (docs/performance.md).
``History`` gives the sampler:

- **the view's form of each trial**, computed once for a finished trial (its record never changes) and
  again for an unfinished one only when it may have changed (a paused trial's record, unchanged, keeps
  the form it had), so an ask costs the trials that are new or unfinished, not every trial;
- **at most ``cap`` finished trials** once there are more (``search.sampler_options.max_history``, as
  Syne Tune's ``max_size_data_for_model``): the ``keep_top`` best of them (the trials TPE's model puts in
  its good set are always there: Optuna's TPE takes the best 10 %, at most 25) and a uniform sample of the
  others (a seeded reservoir over the order they finished in), so the density of the others, and a GP's
  fit, are estimated from a sample instead of from all of them; unfinished trials (running: constant
  liar; paused: shown as the view shows them) are sampled in the same proportion as the finished ones
  (a seeded draw per trial number), so about ``cap`` trials are read in all. Below the cap every trial the
  view shows is there, in trial order, so the sampler proposes what it would over the whole study.

"Best" is the order TPE ranks trials in: complete trials by value, then pruned ones by the last step they
reached (further first) and their value there. With several objectives nothing is kept as best: the
sample is uniform.
"""

from __future__ import annotations

import bisect
import copy
import math
import random
from collections.abc import Callable, Container, Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.feed import TrialFeed
from hpoflow.run.ledger import ATTR_PAUSED

__all__ = ["History", "ViewedSampler", "rank_key", "search_space_view"]

Shown = Callable[[FrozenTrial], "FrozenTrial | None"]
_MASK = (1 << 64) - 1


def rank_key(t: FrozenTrial, maximize: bool) -> tuple[int, float, float] | None:
    """Where TPE ranks ``t`` (lower is better): complete by value, then pruned by the last step reached and the
    value there; None for the others (running, failed, no value)."""
    sign = -1.0 if maximize else 1.0
    if t.state == TrialState.COMPLETE and t.values and len(t.values) == 1 and not math.isnan(t.values[0]):
        return (0, 0.0, sign * float(t.values[0]))
    if t.state == TrialState.PRUNED and t.intermediate_values:
        step = max(t.intermediate_values)
        v = t.intermediate_values[step]
        return (1, -float(step), sign * float(v) if not math.isnan(v) else math.inf)
    return None


def _draw(seed: int, number: int) -> float:
    """A uniform draw in [0, 1) for trial ``number``, fixed by ``seed`` (splitmix64)."""
    z = (number * 0x9E3779B97F4A7C15 + seed * 0xBF58476D1CE4E5B9 + 1) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return ((z ^ (z >> 31)) >> 11) / float(1 << 53)


class History:
    """The trials of one study as ``shown`` shows them (None: left out; default: as they are), read
    incrementally, at most ``cap`` finished ones (None: all) of which the ``keep_top`` best (module
    docstring). One History reads one study."""

    def __init__(self, shown: Shown | None = None, *, cap: int | None = None, keep_top: int = 25,
                 seed: int | None = None) -> None:
        if cap is not None and cap < 1:
            raise ValueError(f"max_history must be at least 1, got {cap}")
        self._shown: Shown = shown if shown is not None else (lambda t: t)
        self.cap = cap
        self._keep = 0 if cap is None else min(keep_top, cap)
        self._seed = 0 if seed is None else int(seed)
        self._feed = TrialFeed()
        self._reset()

    def _reset(self) -> None:
        self._scanned = 0
        # unfinished trials, not paused: number -> (record, its values then, its form)
        self._open: dict[int, tuple[FrozenTrial | None, int, FrozenTrial | None]] = {}
        self._unread: set[int] = set()  # those of them not looked at yet (no record)
        self._parked: dict[int, FrozenTrial] = {}  # paused: number -> its record
        self._parked_forms: dict[int, FrozenTrial] = {}  # the paused ones the view shows: number -> its form
        self._parked_shown: list[tuple[float, int]] = []  # those, by (draw, number)
        self._final: dict[int, FrozenTrial] = {}  # the finished trials the view shows, by number
        self._order: list[int] = []  # their numbers, sorted
        self._top: list[tuple[tuple[int, float, float], int]] = []  # the best finished: (rank key, number), sorted
        self._reservoir: list[int] = []
        self._n_final = 0
        self._rng = random.Random(self._seed)
        self._maximize: bool | None = None
        self._capped = False
        self._draws: dict[int, float] = {}  # an unfinished trial's draw (module docstring)

    def trials(self, study: optuna.Study) -> list[FrozenTrial]:
        """The trials the sampler reads now, in trial order."""
        every, touched = self._feed.read(study)  # (touched: the records changed since the last read, if known)
        if len(every) < self._scanned or (every and every[-1].number != len(every) - 1):
            self._reset()  # another study, or a storage whose list is not by number: read afresh
            touched = None
            if every and every[-1].number != len(every) - 1:
                every = sorted(every, key=lambda t: t.number)
        if self._maximize is None:
            self._maximize = (len(study.directions) == 1 and study.direction == optuna.study.StudyDirection.MAXIMIZE)
            if len(study.directions) > 1:
                self._keep = 0
        opened, unread = self._open, self._unread
        for n in range(self._scanned, len(every)):
            opened[n] = (None, -1, None)
            unread.add(n)
        self._scanned = len(every)
        parked = self._parked
        if touched is None:
            moved = [n for n, record in parked.items() if every[n] is not record]  # (pointer comparisons)
        else:
            moved = [n for n in set(touched) if n in parked and every[n] is not parked[n]]
        for n in moved:
            self._unpark(n)
            opened[n] = (None, -1, None)
            unread.add(n)
        look = sorted(opened if touched is None else unread.union(n for n in touched if n in opened))
        for n in look:
            record, n_values, form = opened[n]
            t = every[n]
            if t is not record or len(t.intermediate_values) != n_values:  # (a running record gains values in place)
                unread.discard(n)
                if t.state.is_finished():
                    del opened[n]
                    self._draws.pop(n, None)
                    seen = self._shown(t)
                    if seen is not None:
                        self._settle(n, seen)
                    continue
                form = self._shown(t)
                if t.user_attrs.get(ATTR_PAUSED) is not None:  # paused: looked at again when its record changes
                    del opened[n]
                    self._park(n, t, form)
                    continue
                opened[n] = (t, len(t.intermediate_values), form)
        live = [(n, form) for n, (_, _, form) in opened.items() if form is not None]
        cap = self.cap
        n_live = len(live) + len(self._parked_shown)
        self._capped = cap is not None and len(self._final) + n_live > cap
        if cap is None or not self._capped:
            chosen: Sequence[int] = self._order
            live.extend((n, self._parked_forms[n]) for _, n in self._parked_shown)
        else:
            # the rest, finished or not, in one proportion: the first r slots of the reservoir are a uniform
            # sample of the finished trials too; the paused ones are kept by their draw, the lowest first
            rate = (cap - self._keep) / max(1, self._n_final + n_live)
            r = min(len(self._reservoir), round(rate * self._n_final))
            chosen = sorted({n for _, n in self._top} | set(self._reservoir[:r]))
            live = [(n, t) for n, t in live if self._draw(n) < rate]
            for d, n in self._parked_shown:
                if d >= rate:
                    break
                live.append((n, self._parked_forms[n]))
        if not live:
            return [self._final[n] for n in chosen]
        return [t for _, t in sorted([(n, self._final[n]) for n in chosen] + live, key=lambda x: x[0])]

    def _park(self, n: int, record: FrozenTrial, form: FrozenTrial | None) -> None:
        self._parked[n] = record
        if form is not None:
            self._parked_forms[n] = form
            bisect.insort(self._parked_shown, (self._draw(n), n))

    def _unpark(self, n: int) -> None:
        del self._parked[n]
        if self._parked_forms.pop(n, None) is not None:
            i = bisect.bisect_left(self._parked_shown, (self._draw(n), n))
            del self._parked_shown[i]

    def _draw(self, n: int) -> float:
        d = self._draws.get(n)
        if d is None:
            d = self._draws[n] = _draw(self._seed, n)
        return d

    def _settle(self, n: int, t: FrozenTrial) -> None:
        self._final[n] = t
        if not self._order or n > self._order[-1]:
            self._order.append(n)
        else:
            bisect.insort(self._order, n)
        if self.cap is None:
            return
        key = rank_key(t, bool(self._maximize)) if self._keep else None
        if key is not None:
            if len(self._top) < self._keep or key < self._top[-1][0]:
                bisect.insort(self._top, (key, n))
                del self._top[self._keep:]
        m = self.cap - self._keep
        if m > 0:
            if len(self._reservoir) < m:
                self._reservoir.append(n)
            else:
                j = self._rng.randrange(self._n_final + 1)
                if j < m:
                    self._reservoir[j] = n
        self._n_final += 1

    @property
    def capped(self) -> bool:
        """Whether the last read left trials out (the study holds more than ``cap``)."""
        return self._capped

    def view(self, study: optuna.Study) -> optuna.Study:
        """``study`` as the sampler reads it: these trials (read at the sampler's first read: a sampler
        that reads none, as random search, costs nothing); everything else the study's."""
        view: optuna.Study = _Viewed(study, self)  # type: ignore[assignment]  # duck-typed
        return view


def search_space_view(view: optuna.Study) -> optuna.Study:
    """The view (``History.view``) a sampler's search space is inferred from: the same trials, but once the
    history is capped, the finished ones only. Optuna's ``IntersectionSearchSpace`` reads back from the last
    trial to the first unfinished one at every ask, so with hundreds running it read hundreds of trials an
    ask; unfinished trials add nothing to the intersection, and only move where the next ask starts. (So
    that a trial finishing after later ones is not intersected, as Optuna would: for a space whose
    parameters are all always there, the same space; below the cap the view is Optuna's exactly.)"""
    if isinstance(view, _Viewed):
        finished: optuna.Study = _Viewed(view._study, view._history, source=view)  # type: ignore[assignment]
        return finished
    return view


class _Viewed:
    def __init__(self, study: optuna.Study, history: History, source: _Viewed | None = None) -> None:
        self._study = study
        self._history = history
        self._source = source  # (a search-space view: the trials of ``source``, finished ones once capped)
        self._trials: list[FrozenTrial] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def _read(self) -> list[FrozenTrial]:
        if self._trials is None:
            if self._source is None:
                self._trials = self._history.trials(self._study)
            else:
                trials = self._source._read()
                self._trials = [t for t in trials if t.state.is_finished()] if self._history.capped else trials
        return self._trials

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        trials = self._read()
        out = trials if states is None else [t for t in trials if t.state in states]
        if deepcopy:
            return copy.deepcopy(out)
        return list(out)

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)


class ViewedSampler(optuna.samplers.BaseSampler):
    """``inner`` reading the study through ``history`` (``History``); told about trials by the study itself."""

    def __init__(self, inner: optuna.samplers.BaseSampler, history: History) -> None:
        self.inner = inner
        self.history = history
        self._view: tuple[int, optuna.Study] | None = None  # the view of the trial being sampled

    def _of(self, study: optuna.Study, trial: FrozenTrial) -> optuna.Study:
        if self._view is None or self._view[0] != trial.number:
            self._view = (trial.number, self.history.view(study))
        return self._view[1]

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        self._view = None  # a new ask: read the study again
        return self.inner.infer_relative_search_space(search_space_view(self._of(study, trial)), trial)

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return self.inner.sample_relative(self._of(study, trial), trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        return self.inner.sample_independent(self._of(study, trial), trial, param_name, param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._view = None
        self.inner.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self.inner.after_trial(study, trial, state, values)

    def reseed_rng(self) -> None:
        self.inner.reseed_rng()
