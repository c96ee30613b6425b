"""Sampler and pruner factories: every algorithm is an Optuna sampler, every pruner Optuna's.

Grid search is not Optuna's ``GridSampler`` (it ends the grid with ``study.stop()``, which breaks
ask/tell with trials in flight); the driver enqueues grid points itself and a seeded
``RandomSampler`` stands behind it, so the enqueued values are used verbatim.
"""

from __future__ import annotations

from typing import Any

import optuna

from hpoflow.errors import HpoflowError
from hpoflow.spec import PrunerSpec, SearchSpec

__all__ = ["make_pruner", "make_sampler"]


def make_sampler(search: SearchSpec, resumed_trials: int = 0) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for ``search.algorithm``, seeded, with ``sampler_options`` passed on.

    ``resumed_trials``: trials the study already holds. A resumed study must not replay the random
    stream from the start (it would propose the same configurations again), so its seed becomes
    ``seed + resumed_trials``: still reproducible, never a repeat of the first run's stream.
    """
    opts: dict[str, Any] = dict(search.sampler_options)
    seed = None if search.seed is None else search.seed + resumed_trials
    algo = search.algorithm
    factories: dict[str, Any] = {
        "grid": optuna.samplers.RandomSampler,
        "random": optuna.samplers.RandomSampler,
        "tpe": optuna.samplers.TPESampler,
        "gp": optuna.samplers.GPSampler,
        "cmaes": optuna.samplers.CmaEsSampler,
    }
    if algo == "tpe":
        # With trials in flight, TPE must know about running trials or it proposes near-duplicates.
        opts.setdefault("constant_liar", search.max_concurrent > 1)
        opts.setdefault("multivariate", True)
    if algo == "cmaes":
        opts.setdefault("warn_independent_sampling", False)
    try:
        sampler: optuna.samplers.BaseSampler = factories[algo](seed=seed, **opts)
        return sampler
    except TypeError as exc:
        raise HpoflowError(
            f"search.sampler_options: {exc}. These options go to optuna.samplers."
            f"{factories[algo].__name__}; see its documentation for valid keywords"
        ) from None


def make_pruner(p: PrunerSpec) -> optuna.pruners.BasePruner:
    """The Optuna pruner for ``p.type`` (``none`` gives a pruner that never prunes)."""
    if p.type == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_steps)
    if p.type == "percentile":
        return optuna.pruners.PercentilePruner(
            p.percentile, n_startup_trials=p.startup_trials, n_warmup_steps=p.warmup_steps
        )
    if p.type == "asha":
        return optuna.pruners.SuccessiveHalvingPruner(
            min_resource=p.min_resource, reduction_factor=p.reduction_factor
        )
    if p.type == "hyperband":
        return optuna.pruners.HyperbandPruner(
            min_resource=p.min_resource, max_resource=p.max_resource or "auto",
            reduction_factor=p.reduction_factor,
        )
    return optuna.pruners.NopPruner()
