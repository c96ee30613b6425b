"""The model-based samplers as hpoflow builds them: ``search.algorithm: tpe | gp | bohb``.

Each reads the study through a ``History`` (``hpoflow.search.history``): every trial's form computed once
it is finished, at most ``max_history`` finished trials; with a scheduler that pauses trials, paused
trials read as pruned (``hpoflow.search.samplers.PausedAsPruned``), as trials a pruner stopped. TPE runs
with SciPy's ``log_ndtr`` (``hpoflow.search.fast_tpe``).

``tpe`` with ``per_budget`` (by default where trials stop early: a pruner, or a promotion scheduler) is
BOHB's model without BOHB's random third (``hpoflow.search.bohb.BOHBSampler`` with ``random_fraction: 0``):
Optuna's TPE ranks a stopped trial by the last step it reached and puts it among the bad trials, so with
trials stopped at every rung it learns little about the configurations that would end well; per budget,
it is fitted on the trials' reports at the largest budget that holds ``n_startup_trials`` of them
(docs/search.md has the figures).
"""

from __future__ import annotations

import optuna

from hpoflow.search import fast_tpe
from hpoflow.search.bohb import BOHBSampler
from hpoflow.search.gp_parallel import ThompsonGPSampler, default_refit_every
from hpoflow.search.history import History, ViewedSampler
from hpoflow.search.options import GPOptions
from hpoflow.search.samplers import PausedAsPruned

__all__ = ["bohb", "gp", "tpe"]

TPE_GOOD = 25  # the most trials Optuna's TPE puts in its good set (10 % of them, at most 25)


def _viewed(inner: optuna.samplers.BaseSampler, *, paused: bool, max_history: int | None, keep_top: int,
            seed: int | None) -> optuna.samplers.BaseSampler:
    if paused:
        return PausedAsPruned(inner, cap=max_history, keep_top=keep_top, seed=seed)
    return ViewedSampler(inner, History(cap=max_history, keep_top=keep_top, seed=seed))


def tpe(*, seed: int | None = None, n_startup_trials: int = 10, n_ei_candidates: int = 24,
        multivariate: bool = True, group: bool = False, constant_liar: bool = False, per_budget: bool = False,
        max_history: int | None = 300, paused: bool = False) -> optuna.samplers.BaseSampler:
    """Optuna's ``TPESampler`` with these options, reading a bounded history; ``per_budget``: fitted per
    budget (module docstring)."""
    fast_tpe.install()
    if per_budget:
        return BOHBSampler(seed=seed, random_fraction=0.0, min_evaluations=max(1, n_startup_trials),
                           n_ei_candidates=n_ei_candidates, multivariate=multivariate, group=group,
                           constant_liar=constant_liar, max_history=max_history)
    inner = optuna.samplers.TPESampler(seed=seed, n_startup_trials=n_startup_trials,
                                       n_ei_candidates=n_ei_candidates, multivariate=multivariate, group=group,
                                       constant_liar=constant_liar)
    return _viewed(inner, paused=paused, max_history=max_history, keep_top=TPE_GOOD, seed=seed)


def gp(*, seed: int | None = None, n_startup_trials: int = 10, deterministic_objective: bool = False,
       warn_independent_sampling: bool = True, max_history: int | None = 500, acquisition: str = "auto",
       refit_every: int | None = None, max_concurrent: int = 1, per_budget: bool = False,
       paused: bool = False) -> optuna.samplers.BaseSampler:
    """Optuna's ``GPSampler`` with these options (``acquisition: ei``), or batched Thompson sampling on its GP
    (``thompson``: ``hpoflow.search.gp_parallel``, a fit every ``refit_every`` completed trials, by default
    ``default_refit_every(max_concurrent)``), fitted on at most ``max_history`` finished trials: the best
    quarter and a uniform sample of the others (Syne Tune's ``max_size_data_for_model``). ``auto``: ``ei`` up
    to ``GPOptions.EI_UP_TO`` trials at once, ``thompson`` above and per budget. ``per_budget``: fitted on
    the reports at one budget, as BOHB's model (``hpoflow.search.bohb.BOHBSampler`` with this GP as its
    model, no random third; until a budget holds ``n_startup_trials`` reports, configurations are random)."""
    acquisition = GPOptions.acquisition_for(acquisition, max_concurrent, per_budget)
    startup = 1 if per_budget else n_startup_trials  # (per budget: BOHB's count decides when to fit)
    inner: optuna.samplers.BaseSampler
    if acquisition == "ei":
        inner = optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup,
                                          deterministic_objective=deterministic_objective,
                                          warn_independent_sampling=warn_independent_sampling)
    elif acquisition == "thompson":
        every = refit_every if refit_every is not None else default_refit_every(max_concurrent)
        inner = ThompsonGPSampler(seed=seed, n_startup_trials=startup, refit_every=every,
                                  deterministic_objective=deterministic_objective,
                                  warn_independent_sampling=warn_independent_sampling)
    else:
        raise ValueError(f"acquisition must be one of auto, ei, thompson, but got {acquisition!r}")
    keep = max(1, max_history // 4) if max_history is not None else 0
    if per_budget:
        return BOHBSampler(seed=seed, random_fraction=0.0, min_evaluations=max(1, n_startup_trials),
                           max_history=max_history, model=inner, keep_top=keep)
    return _viewed(inner, paused=paused, max_history=max_history, keep_top=keep, seed=seed)


def bohb(*, seed: int | None = None, min_points_in_model: int | None = None, random_fraction: float = 1 / 3,
         n_ei_candidates: int = 64, constant_liar: bool = False, max_history: int | None = 300,
         paused: bool = False) -> optuna.samplers.BaseSampler:
    """``BOHBSampler`` (it reads paused trials at the budgets they reached itself: ``paused`` changes nothing)."""
    fast_tpe.install()
    return BOHBSampler(seed=seed, min_points_in_model=min_points_in_model, random_fraction=random_fraction,
                       n_ei_candidates=n_ei_candidates, constant_liar=constant_liar, max_history=max_history)
