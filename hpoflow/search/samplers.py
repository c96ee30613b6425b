"""The sampler and pruner of a study: every algorithm an Optuna sampler, every pruner Optuna's.

One factory per family: ``make_sampler`` builds the class a name is registered as
(``hpoflow.registry.SAMPLERS``), or a sampler class given by import path, with the validated options
(``hpoflow.search.options``) as keyword arguments and the study's seed; ``make_pruner`` does the same
for ``PRUNERS``.

Grid search is not Optuna's ``GridSampler`` (it ends the grid with ``study.stop()``, which breaks
ask/tell with trials in flight); the driver enqueues grid points itself and a seeded
``RandomSampler`` stands behind it, so the enqueued values are used verbatim.
"""

from __future__ import annotations

import inspect
from typing import Any

import optuna

from hpoflow.registry import PRUNERS, SAMPLERS, resolve
from hpoflow.search.options import SamplerOptions
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
        made: optuna.samplers.BaseSampler = _build(_class(search.algorithm), dict(search.sampler_options), seed)
        return made
    options = SAMPLERS.options(search.algorithm, search.sampler_options)
    kwargs = options.sampler_kwargs(search.max_concurrent) if isinstance(options, SamplerOptions) \
        else options.kwargs()
    sampler: optuna.samplers.BaseSampler = _build(SAMPLERS.get(search.algorithm), kwargs, seed)
    return sampler


def make_pruner(p: PrunerSpec) -> optuna.pruners.BasePruner:
    """The Optuna pruner for ``p.type`` (``none`` gives a pruner that never prunes)."""
    if p.type not in PRUNERS:  # a pruner class by import path (checked by the spec)
        made: optuna.pruners.BasePruner = _build(_class(p.type), dict(p.options), None)
        return made
    options = PRUNERS.options(p.type, p.options)
    pruner: optuna.pruners.BasePruner = _build(PRUNERS.get(p.type), options.kwargs(), None)
    return pruner


def _class(path: str) -> Any:
    return resolve(path if ":" in path else ":".join(path.rsplit(".", 1)))


def _build(cls: Any, kwargs: dict[str, Any], seed: int | None) -> Any:
    """``cls(**kwargs)``, seeded when it takes a ``seed``."""
    if seed is not None and "seed" in inspect.signature(cls).parameters:
        kwargs = {"seed": seed, **kwargs}
    return cls(**kwargs)
