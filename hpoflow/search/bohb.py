"""``search.algorithm: bohb``: BOHB's model (Falkner et al. 2018) on Optuna's TPE, asynchronous.

BOHB is Hyperband whose new configurations come from a kernel density model fitted at one budget: the
largest budget at which at least ``min_points_in_model`` configurations have been evaluated; a fraction
``random_fraction`` of configurations is drawn at random. hpoflow's Hyperband (the ``hyperband`` pruner,
or ``search.scheduler: hyperband`` where trials pause and resume) does the scheduling; this sampler is
the model: Optuna's ``TPESampler`` (a Parzen-estimator density ratio, the same model family as BOHB's
KDE, multivariate) run on a view of the study in which every trial with a report at that budget is a
finished trial whose value is that report. Trials that have not reached the budget are left out (BOHB's
model at budget ``b`` holds only evaluations at ``b``); running trials stay visible, so constant liar
still spreads concurrent proposals.

A budget is a report step (``trial.report(value, step)``); a trial that finished without reports counts
at the largest budget. Which budget holds enough points is kept as counts updated from the trials that are
new or unfinished since the last proposal, and the view at a budget is a ``History``
(``hpoflow.search.history``): each finished trial's form computed once, at most ``max_history`` of them
(the best 25, TPE's good set, and a uniform sample of the others), so a proposal costs what changed, not a
pass over every trial.

``search.algorithm: tpe`` with a pruner or a promotion scheduler is this sampler without the random third
(``hpoflow.search.models.tpe``).

Why not a library: DEHB (``dehb``) pins numpy<2 and its ask/tell runs its own brackets; SMAC3's
multi-fidelity facade needs ``pyrfr`` built with SWIG and drives its own intensifier; Syne Tune's MOBSTER
and BOHB searchers come with their own scheduler and trial backend (and pandas, statsmodels, scikit-learn
and xgboost). Each would replace hpoflow's scheduler and storage rather than sit behind them. Optuna's TPE
is the model; what is written here is only BOHB's rule for which observations it sees.
"""

from __future__ import annotations

import copy
import math
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import optuna
from optuna.distributions import BaseDistribution
from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.feed import TrialFeed
from hpoflow.run.ledger import ATTR_PAUSED
from hpoflow.search.history import History, search_space_view
from hpoflow.search.samplers import StudyView

__all__ = ["BOHBSampler"]

_FINAL = math.inf  # the budget of a trial that finished without reports


class _Budgets:
    """How many trials have a report at each budget, kept from the trials that changed."""

    def __init__(self) -> None:
        self.count: Counter[float] = Counter()
        self._seen: dict[int, tuple[set[int], bool]] = {}  # number -> (steps counted, counted as final)
        self._scanned = 0
        self._open: set[int] = set()
        self._parked: dict[int, FrozenTrial] = {}  # paused trials: number -> their record, looked at when it changes

    def update(self, trials: Sequence[FrozenTrial]) -> None:
        seen = self._seen
        for t in trials:
            values = t.intermediate_values
            known = seen.get(t.number)
            if known is None:
                known = seen[t.number] = (set(), False)
            steps, was_final = known
            final = not values and t.state == TrialState.COMPLETE
            if len(values) != len(steps):  # reports only ever add steps, in any order
                for step in t.intermediate_values.keys() - steps:
                    self.count[float(step)] += 1
                    steps.add(step)
            if final and not was_final:
                self.count[_FINAL] += 1
                self._seen[t.number] = (steps, True)

    def changed(self, every: list[FrozenTrial], touched: list[int] | None = None) -> list[FrozenTrial]:
        """Of the study's trials (by number), those new or unfinished since the last call: the only ones
        whose reports can have changed; a paused trial only when its record changed (it reports nothing
        while paused). ``touched``: the trials whose record changed since the last call, where the storage
        says (``hpoflow.run.feed``): of the unfinished ones, only those are looked at."""
        if len(every) < self._scanned:
            self._scanned, self._open, self._parked = 0, set(), {}
            touched = None
        new = range(self._scanned, len(every))
        self._scanned = len(every)
        parked = self._parked
        if touched is None:
            moved = [n for n, record in parked.items() if every[n] is not record]  # (pointer comparisons)
            look = self._open.union(new)
        else:
            moved = [n for n in set(touched) if n in parked and every[n] is not parked[n]]
            look = {n for n in touched if n in self._open}.union(new)
        for n in moved:
            del parked[n]
        look.update(moved)
        out = [every[n] for n in sorted(look)]
        for t in out:
            if t.state.is_finished():
                self._open.discard(t.number)
            elif t.user_attrs.get(ATTR_PAUSED) is not None:
                self._open.discard(t.number)
                parked[t.number] = t
            else:
                self._open.add(t.number)
        return out

    def largest(self, at_least: int) -> float | None:
        """The largest budget with ``at_least`` trials reported at it, or None."""
        full = [b for b, n in self.count.items() if n >= at_least]
        return max(full) if full else None


class _BudgetView(StudyView):
    """The study as the model reads it: trials evaluated at ``budget`` as COMPLETE with that value,
    running (not paused) trials as RUNNING, nothing else."""

    def __init__(self, study: optuna.Study, budget: float | None) -> None:
        super().__init__(study)
        self._budget = budget

    def shown(self, t: FrozenTrial) -> FrozenTrial | None:
        value = _value_at(t, self._budget) if self._budget is not None else None
        if value is not None:
            t = copy.copy(t)
            t.state, t.values = TrialState.COMPLETE, [value]
            return t
        return t if t.state == TrialState.RUNNING and t.user_attrs.get(ATTR_PAUSED) is None else None


def _value_at(t: FrozenTrial, budget: float) -> float | None:
    if budget == _FINAL:
        if t.state == TrialState.COMPLETE and not t.intermediate_values and t.values:
            return float(t.values[0])
        return None
    v = t.intermediate_values.get(int(budget))
    return None if v is None or not math.isfinite(v) else float(v)


class BOHBSampler(optuna.samplers.BaseSampler):
    """BOHB's model (module docstring). ``min_points_in_model``: evaluations a budget needs before the
    model is fitted there (default: the number of parameters + 1, as BOHB); until some budget has them
    (+ 2; or exactly ``min_evaluations``, where given), configurations are random. ``random_fraction``:
    configurations drawn at random (BOHB: 1/3). The good evaluations are TPE's top 10 % (at most 25;
    BOHB's are the top 15 %: Optuna 4.9 deprecated setting TPE's split). ``max_history``: the most
    evaluations the model reads at a budget (``hpoflow.search.history``; None: all), of which the ``keep_top``
    best always. ``model``: the sampler fitted at the budget instead of Optuna's TPE (``search.algorithm: gp``
    per budget: a GP; the TPE options are then unused)."""

    def __init__(self, *, seed: int | None = None, min_points_in_model: int | None = None,
                 random_fraction: float = 1 / 3, n_ei_candidates: int = 64,
                 constant_liar: bool = False, min_evaluations: int | None = None, multivariate: bool = True,
                 group: bool = False, max_history: int | None = None,
                 model: optuna.samplers.BaseSampler | None = None, keep_top: int = 25) -> None:
        self._seed = seed
        self._min_points = min_points_in_model
        self._min_evaluations = min_evaluations
        self._random_fraction = random_fraction
        self._keep_top = keep_top
        # the model fitted at the budget (another than TPE: ``model``, e.g. a GP, told the same view)
        self._model = model if model is not None else optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=0, n_ei_candidates=n_ei_candidates, multivariate=multivariate, group=group,
            constant_liar=constant_liar)
        self._random = optuna.samplers.RandomSampler(seed=seed)
        self._budgets = _Budgets()
        self._feed = TrialFeed()
        self._budget: dict[int, float | None] = {}  # trial number -> the budget its model used (None: random)
        self._max_history = max_history
        self._histories: dict[float, History] = {}  # budget -> the model's view there
        self._view: tuple[int, optuna.Study] | None = None  # (trial number, the view its model reads)

    def reseed_rng(self) -> None:
        self._model.reseed_rng()
        self._random.reseed_rng()

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, BaseDistribution]:
        budget = self._budget_for(study, trial)
        if budget is None:
            return {}
        return self._model.infer_relative_search_space(search_space_view(self._view_for(study, trial, budget)), trial)

    def _budget_for(self, study: optuna.Study, trial: FrozenTrial) -> float | None:
        """The budget whose evaluations the model of ``trial`` reads; None: ``trial`` is drawn at random."""
        if trial.number in self._budget:
            return self._budget[trial.number]
        budget: float | None = None
        draw = random.Random(f"{self._seed}:{trial.number}").random()
        if draw >= self._random_fraction:
            trials, touched = self._feed.read(study)
            self._budgets.update(self._budgets.changed(trials, touched))
            if self._min_evaluations is not None:
                need = self._min_evaluations
            else:
                n_params = max((len(t.distributions) for t in trials[-8:]), default=0)
                need = (self._min_points if self._min_points is not None else n_params + 1) + 2
            budget = self._budgets.largest(need)
        self._budget = {trial.number: budget}  # only the trial being sampled needs it
        self._view = None
        return budget

    def _view_for(self, study: optuna.Study, trial: FrozenTrial, budget: float) -> optuna.Study:
        """The study as the model of ``trial`` reads it at ``budget`` (read once per trial)."""
        if self._view is None or self._view[0] != trial.number:
            history = self._histories.get(budget)
            if history is None:
                history = self._histories[budget] = History(_BudgetView(study, budget).shown, cap=self._max_history,
                                                            keep_top=self._keep_top, seed=self._seed)
            self._view = (trial.number, history.view(study))
        return self._view[1]

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        budget = self._budget.get(trial.number)
        if not search_space or budget is None:
            return {}
        return self._model.sample_relative(self._view_for(study, trial, budget), trial, search_space)

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        budget = self._budget.get(trial.number)
        if budget is None:
            return self._random.sample_independent(study, trial, param_name, param_distribution)
        return self._model.sample_independent(self._view_for(study, trial, budget), trial, param_name,
                                              param_distribution)

    def before_trial(self, study: optuna.Study, trial: FrozenTrial) -> None:
        self._model.before_trial(study, trial)

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState,
                    values: Sequence[float] | None) -> None:
        self._model.after_trial(study, trial, state, values)
