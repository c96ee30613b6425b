"""Sampler and pruner factories: every algorithm is an Optuna sampler, every pruner Optuna's.

Each factory is the implementation of a registry entry (``hpoflow.registry.SAMPLERS`` /
``PRUNERS``) and receives its validated options model (``hpoflow.search.options``).

Grid search is not Optuna's ``GridSampler`` (it ends the grid with ``study.stop()``, which breaks
ask/tell with trials in flight); the driver enqueues grid points itself and a seeded
``RandomSampler`` stands behind it, so the enqueued values are used verbatim.
"""

from __future__ import annotations

import inspect
from typing import Any

import optuna
from pydantic import BaseModel

from hpoflow.registry import PRUNERS, SAMPLERS, resolve
from hpoflow.search.options import (
    AshaPrunerOptions,
    CmaEsOptions,
    GPOptions,
    HyperbandPrunerOptions,
    MedianPrunerOptions,
    NSGAIIIOptions,
    NSGAIIOptions,
    PercentilePrunerOptions,
    TPEOptions,
)
from hpoflow.spec import PrunerSpec, SearchSpec

__all__ = ["make_pruner", "make_sampler"]


def make_sampler(search: SearchSpec, resumed_trials: int = 0) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for ``search.algorithm``, seeded, with ``sampler_options`` passed on.

    ``resumed_trials``: trials the study already holds. A resumed study must not replay the random
    stream from the start (it would propose the same configurations again), so its seed becomes
    ``seed + resumed_trials``: still reproducible, never a repeat of the first run's stream.
    """
    seed = None if search.seed is None else search.seed + resumed_trials
    if search.algorithm not in SAMPLERS:  # a sampler class by import path (checked by the spec)
        made: optuna.samplers.BaseSampler = _from_class(search.algorithm, search.sampler_options, seed)
        return made
    options = SAMPLERS.options(search.algorithm, search.sampler_options)
    sampler: optuna.samplers.BaseSampler = SAMPLERS.get(search.algorithm)(options, seed, search.max_concurrent)
    return sampler


def make_pruner(p: PrunerSpec) -> optuna.pruners.BasePruner:
    """The Optuna pruner for ``p.type`` (``none`` gives a pruner that never prunes)."""
    if p.type not in PRUNERS:  # a pruner class by import path (checked by the spec)
        pruner_made: optuna.pruners.BasePruner = _from_class(p.type, p.options, None)
        return pruner_made
    pruner: optuna.pruners.BasePruner = PRUNERS.get(p.type)(PRUNERS.options(p.type, p.options))
    return pruner


def _from_class(path: str, options: dict[str, Any], seed: int | None) -> Any:
    """An instance of the class at ``path`` with ``options``, seeded when it takes a ``seed``."""
    cls = resolve(path if ":" in path else ":".join(path.rsplit(".", 1)))
    kwargs = dict(options)
    if seed is not None and "seed" in inspect.signature(cls).parameters:
        kwargs.setdefault("seed", seed)
    return cls(**kwargs)


# -- the built-in factories (registered in hpoflow.registry) ---------------------------------------

def make_random(options: BaseModel, seed: int | None, max_concurrent: int) -> optuna.samplers.BaseSampler:
    return optuna.samplers.RandomSampler(seed=seed)


make_grid = make_random  # the driver enqueues the grid points; a seeded RandomSampler stands behind


def make_tpe(options: BaseModel, seed: int | None, max_concurrent: int) -> optuna.samplers.BaseSampler:
    opts: dict[str, Any] = options.model_dump()
    if not isinstance(options, TPEOptions):
        raise TypeError(f"make_tpe needs TPEOptions, got {type(options).__name__}")
    # With trials in flight, TPE must know about running trials or it proposes near-duplicates.
    opts["constant_liar"] = max_concurrent > 1 if options.constant_liar is None else options.constant_liar
    return optuna.samplers.TPESampler(seed=seed, **opts)


def make_gp(options: BaseModel, seed: int | None, max_concurrent: int) -> optuna.samplers.BaseSampler:
    if not isinstance(options, GPOptions):
        raise TypeError(f"make_gp needs GPOptions, got {type(options).__name__}")
    return optuna.samplers.GPSampler(seed=seed, **options.model_dump())


def make_nsga2(options: BaseModel, seed: int | None, max_concurrent: int) -> optuna.samplers.BaseSampler:
    if not isinstance(options, NSGAIIOptions):
        raise TypeError(f"make_nsga2 needs NSGAIIOptions, got {type(options).__name__}")
    return optuna.samplers.NSGAIISampler(seed=seed, **options.model_dump())


def make_nsga3(options: BaseModel, seed: int | None, max_concurrent: int) -> optuna.samplers.BaseSampler:
    if not isinstance(options, NSGAIIIOptions):
        raise TypeError(f"make_nsga3 needs NSGAIIIOptions, got {type(options).__name__}")
    return optuna.samplers.NSGAIIISampler(seed=seed, **options.model_dump())


def make_cmaes(options: BaseModel, seed: int | None, max_concurrent: int) -> optuna.samplers.BaseSampler:
    if not isinstance(options, CmaEsOptions):
        raise TypeError(f"make_cmaes needs CmaEsOptions, got {type(options).__name__}")
    return optuna.samplers.CmaEsSampler(seed=seed, **options.model_dump())


def make_none_pruner(options: BaseModel) -> optuna.pruners.BasePruner:
    return optuna.pruners.NopPruner()


def make_median_pruner(options: BaseModel) -> optuna.pruners.BasePruner:
    if not isinstance(options, MedianPrunerOptions):
        raise TypeError(f"make_median_pruner needs MedianPrunerOptions, got {type(options).__name__}")
    return optuna.pruners.MedianPruner(
        n_startup_trials=options.startup_trials, n_warmup_steps=options.warmup_steps,
        interval_steps=options.interval_steps, n_min_trials=options.min_trials)


def make_percentile_pruner(options: BaseModel) -> optuna.pruners.BasePruner:
    if not isinstance(options, PercentilePrunerOptions):
        raise TypeError(f"make_percentile_pruner needs PercentilePrunerOptions, got {type(options).__name__}")
    return optuna.pruners.PercentilePruner(
        options.percentile, n_startup_trials=options.startup_trials, n_warmup_steps=options.warmup_steps,
        interval_steps=options.interval_steps, n_min_trials=options.min_trials)


def make_asha_pruner(options: BaseModel) -> optuna.pruners.BasePruner:
    if not isinstance(options, AshaPrunerOptions):
        raise TypeError(f"make_asha_pruner needs AshaPrunerOptions, got {type(options).__name__}")
    return optuna.pruners.SuccessiveHalvingPruner(
        min_resource=options.min_resource, reduction_factor=options.reduction_factor,
        min_early_stopping_rate=options.min_early_stopping_rate)


def make_hyperband_pruner(options: BaseModel) -> optuna.pruners.BasePruner:
    if not isinstance(options, HyperbandPrunerOptions):
        raise TypeError(f"make_hyperband_pruner needs HyperbandPrunerOptions, got {type(options).__name__}")
    return optuna.pruners.HyperbandPruner(
        min_resource=options.min_resource, max_resource=options.max_resource or "auto",
        reduction_factor=options.reduction_factor)
