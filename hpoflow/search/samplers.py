"""The sampler and pruner of a study: every algorithm an Optuna sampler, every pruner Optuna's.

One factory per family: ``make_sampler`` builds the class a name is registered as
(``hpoflow.registry.SAMPLERS``), or a sampler class given by import path, with the validated options
(``hpoflow.search.options``) as keyword arguments and the study's seed; ``make_pruner`` does the same
for ``PRUNERS``.

Grid search is not Optuna's ``GridSampler`` (it ends the grid with ``study.stop()``, which breaks
ask/tell with trials in flight); the driver enqueues grid points itself and a seeded
``RandomSampler`` stands behind it, so the enqueued values are used verbatim.

With a scheduler (``search.scheduler``), the sampler sees a trial paused at a rung as PRUNED with
its intermediate values (``PausedAsPruned``), as it sees a trial a pruner stopped: a paused trial is
RUNNING in the storage until it is promoted or closed, and a sampler that waits for finished trials
(TPE's startup, its model) would otherwise sample at random for most of the study.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Container
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpoflow.registry import PRUNERS, SAMPLERS, resolve
from hpoflow.run.ledger import ATTR_PAUSED
from hpoflow.search.history import History, ViewedSampler
from hpoflow.search.options import PrunerOptions, SamplerOptions
from hpoflow.search.schedulers import first_rung
from hpoflow.spec import PrunerSpec, SearchSpec

__all__ = ["PausedAsPruned", "StudyView", "make_pruner", "make_sampler"]


def make_sampler(search: SearchSpec, resumed_trials: int = 0) -> optuna.samplers.BaseSampler:
    """The Optuna sampler for ``search.algorithm``, seeded, with ``sampler_options`` passed on.

    ``resumed_trials``: trials the study already holds. A resumed study must not replay the random
    stream from the start (it would propose the same configurations again), so its seed becomes
    ``seed + resumed_trials``: still reproducible, never a repeat of the first run's stream.

    A builder that takes ``paused`` (the model-based ones, ``hpoflow.search.models``) is told whether a
    scheduler pauses trials and reads them as pruned itself; any other sampler is wrapped in
    ``PausedAsPruned`` then.
    """
    seed = None if search.seed is None else search.seed + resumed_trials
    if search.algorithm not in SAMPLERS:  # a sampler class by import path (checked by the spec)
        made: optuna.samplers.BaseSampler = _build(_class(search.algorithm), dict(search.sampler_options), seed)
        return made
    options = SAMPLERS.options(search.algorithm, search.sampler_options)
    stops_early = search.pruner.type != "none" or search.scheduler.type in ("asha", "hyperband")
    kwargs = options.sampler_kwargs(search.max_concurrent, stops_early) if isinstance(options, SamplerOptions) \
        else options.kwargs()
    cls = SAMPLERS.get(search.algorithm)
    if "paused" in inspect.signature(cls).parameters:
        built: optuna.samplers.BaseSampler = _build(cls, {**kwargs, "paused": search.scheduler.enabled}, seed)
        return built
    sampler: optuna.samplers.BaseSampler = _build(cls, kwargs, seed)
    return PausedAsPruned(sampler) if search.scheduler.enabled else sampler


class StudyView:
    """A study as a sampler reads it: the study's trials, each shown as ``shown`` says (None: left out);
    everything else is the study's. Read-only: a sampler given it through ``as_study`` only reads trials."""

    def __init__(self, study: optuna.Study) -> None:
        self._study = study

    def __getattr__(self, name: str) -> Any:
        return getattr(self._study, name)

    def shown(self, t: FrozenTrial) -> FrozenTrial | None:
        raise NotImplementedError

    def _get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None,
                    use_cache: bool = False) -> list[FrozenTrial]:
        out = []
        for t in self._study._get_trials(deepcopy=False, states=None, use_cache=use_cache):
            seen = self.shown(t)
            if seen is not None and (states is None or seen.state in states):
                out.append(copy.deepcopy(seen) if deepcopy else seen)
        return out

    def get_trials(self, deepcopy: bool = True, states: Container[TrialState] | None = None) -> list[FrozenTrial]:
        return self._get_trials(deepcopy=deepcopy, states=states)

    def as_study(self) -> optuna.Study:
        view: optuna.Study = self  # type: ignore[assignment]  # duck-typed: samplers read only
        return view


def paused_as_pruned(t: FrozenTrial) -> FrozenTrial:
    """``t``, shown PRUNED (its intermediate values kept) where a scheduler paused it."""
    if t.state == TrialState.RUNNING and t.user_attrs.get(ATTR_PAUSED) is not None:
        t = copy.copy(t)
        t.state = TrialState.PRUNED
    return t


class _PausedView(StudyView):
    """Every paused trial shown PRUNED (its intermediate values kept)."""

    def shown(self, t: FrozenTrial) -> FrozenTrial | None:
        return paused_as_pruned(t)


class PausedAsPruned(ViewedSampler):
    """Wraps a sampler so that it reads trials paused by a scheduler as PRUNED (module docstring), through a
    ``History`` (``hpoflow.search.history``) of at most ``cap`` finished trials (None: all)."""

    def __init__(self, inner: optuna.samplers.BaseSampler, *, cap: int | None = None, keep_top: int = 25,
                 seed: int | None = None) -> None:
        super().__init__(inner, History(paused_as_pruned, cap=cap, keep_top=keep_top, seed=seed))


def make_pruner(p: PrunerSpec, epochs: Any = None) -> optuna.pruners.BasePruner:
    """The Optuna pruner for ``p.type`` (``none`` gives a pruner that never prunes). ``epochs``: the
    trials' ``training.epochs`` (an int, else unknown), where an ``auto`` step of the options resolves
    (``PrunerOptions.pruner_kwargs``: the first rung of Hyperband's geometry over those epochs; Hyperband's
    ``max_resource``, those epochs)."""
    if p.type not in PRUNERS:  # a pruner class by import path (checked by the spec)
        made: optuna.pruners.BasePruner = _build(_class(p.type), dict(p.options), None)
        return made
    options = PRUNERS.options(p.type, p.options)
    if isinstance(options, PrunerOptions):
        known = isinstance(epochs, int) and not isinstance(epochs, bool) and epochs > 1
        eta = int(getattr(options, "reduction_factor", 3))
        kwargs = options.pruner_kwargs(first_rung(epochs, eta) if known else None, epochs if known else None)
    else:
        kwargs = options.kwargs()
    pruner: optuna.pruners.BasePruner = _build(PRUNERS.get(p.type), kwargs, None)
    return pruner


def _class(path: str) -> Any:
    return resolve(path if ":" in path else ":".join(path.rsplit(".", 1)))


def _build(cls: Any, kwargs: dict[str, Any], seed: int | None) -> Any:
    """``cls(**kwargs)``, seeded when it takes a ``seed``."""
    if seed is not None and "seed" in inspect.signature(cls).parameters:
        kwargs = {"seed": seed, **kwargs}
    return cls(**kwargs)
