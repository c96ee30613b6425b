"""Options models of the built-in samplers and pruners (pydantic only: the spec imports this module).

Each model is the option bag of one registry entry (``hpoflow.registry.SAMPLERS`` / ``PRUNERS``):
``search.sampler_options`` for the sampler, the keys beside ``type`` in ``search.pruner`` for the
pruner. ``hpoflow.search.samplers`` builds the Optuna class of the entry with ``kwargs()`` (a sampler's
with ``sampler_kwargs(max_concurrent)``).
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator

from hpoflow.registry import NoOptions, Options

__all__ = [
    "AshaPrunerOptions",
    "AshaSchedulerOptions",
    "BOHBOptions",
    "CmaEsOptions",
    "GPOptions",
    "GridOptions",
    "HyperbandPrunerOptions",
    "HyperbandSchedulerOptions",
    "MedianPrunerOptions",
    "NopPrunerOptions",
    "PercentilePrunerOptions",
    "PrunerOptions",
    "RandomOptions",
    "SamplerOptions",
    "TPEOptions",
    "pbt_budget",
]


class SamplerOptions(Options):
    """Base of a sampler's options: ``sampler_kwargs`` may depend on how many trials run at once."""

    def sampler_kwargs(self, max_concurrent: int, stops_early: bool = False) -> dict[str, Any]:
        """The sampler's keyword arguments (besides ``seed``) for a study of ``max_concurrent`` slots;
        ``stops_early``: the study has a pruner, or a scheduler that pauses trials at rungs."""
        return self.kwargs()


class GridOptions(NoOptions):
    """Exact grid: the driver enumerates the points (``search.space.Grid``)."""


class RandomOptions(NoOptions):
    """``optuna.samplers.RandomSampler`` (seeded by ``search.seed``)."""


class _LiarOptions(SamplerOptions):
    """A TPE-based sampler's: ``constant_liar`` defaults to on when trials run concurrently (with trials in
    flight, TPE must know about running trials or it proposes near-duplicates)."""

    constant_liar: bool | None = None
    max_history: int | None = Field(default=300, ge=1, description=(
        "the most finished trials the model is fitted on (null: all); beyond it, the 25 best (TPE's good set) "
        "and a uniform sample of the others (hpoflow.search.history), so an ask costs the same at 100,000 "
        "trials as at 300"))

    def sampler_kwargs(self, max_concurrent: int, stops_early: bool = False) -> dict[str, Any]:
        liar = max_concurrent > 1 if self.constant_liar is None else self.constant_liar
        return {**self.kwargs(), "constant_liar": liar}


class TPEOptions(_LiarOptions):
    """``optuna.samplers.TPESampler`` (``hpoflow.search.models.tpe``); with a pruner or a promotion scheduler,
    by default fitted per budget (``per_budget``). ``constant_liar`` defaults to on when trials run
    concurrently. (The options Optuna deprecated in 4.9 — prior_weight, consider_magic_clip, consider_endpoints,
    warn_independent_sampling — are not offered.)"""

    n_startup_trials: int = Field(default=10, ge=0)
    n_ei_candidates: int = Field(default=24, ge=1)
    multivariate: bool = True
    group: bool = False
    per_budget: bool | None = Field(default=None, description=(
        "fit the model on the trials' reports at one budget, as BOHB does (hpoflow.search.bohb), instead of "
        "Optuna's ranking of stopped trials by the step they reached; null: on when the study has a pruner or "
        "a promotion scheduler"))

    def sampler_kwargs(self, max_concurrent: int, stops_early: bool = False) -> dict[str, Any]:
        kwargs = super().sampler_kwargs(max_concurrent, stops_early)
        return {**kwargs, "per_budget": stops_early if self.per_budget is None else self.per_budget}


class BOHBOptions(_LiarOptions):
    """``hpoflow.search.bohb.BOHBSampler``: BOHB's model on Optuna's TPE. ``constant_liar`` defaults to on
    when trials run concurrently."""

    min_points_in_model: int | None = Field(default=None, ge=1)
    random_fraction: float = Field(default=1 / 3, ge=0, le=1)
    n_ei_candidates: int = Field(default=64, ge=1)


class GPOptions(SamplerOptions):
    """``optuna.samplers.GPSampler``, or batched Thompson sampling on its GP (``acquisition``;
    ``hpoflow.search.gp_parallel``). ``auto`` keeps Optuna's sampler up to ``EI_UP_TO`` trials at once for a
    GP fitted on completed trials, where its ask costs under 0.4 s and, with 32 LCBench trials at once (5
    repetitions), it reached random search's final regret sooner than Thompson sampling (median 175 s of
    virtual time against 249 s; final regret 0.040 against Thompson's 0.032); above, its ask grows with the
    running trials. Fitted per budget, ``auto`` is Thompson sampling: with the Hyperband pruner (its
    ``max_resource`` then Optuna's ``auto``), one trial at a time on LCBench 167168, LogEI's mean regret was
    0.050 (5 repetitions) against Thompson's 0.016 (30),
    and with 32 trials at once LogEI's qLogEI did not finish 5 repetitions in 35 minutes."""

    EI_UP_TO: ClassVar[int] = 32  # acquisition auto: Optuna's GPSampler up to this many trials at once

    n_startup_trials: int = Field(default=10, ge=0)
    deterministic_objective: bool = False
    warn_independent_sampling: bool = True
    max_history: int | None = Field(default=500, ge=1, description=(
        "the most finished trials the GP is fitted on (null: all); beyond it, the best quarter and a uniform "
        "sample of the others (hpoflow.search.history), as Syne Tune's max_size_data_for_model"))
    acquisition: Literal["auto", "ei", "thompson"] = Field(default="auto", description=(
        "ei: Optuna's GPSampler (LogEI; qLogEI over the running trials when some run): 0.33-0.38 s of CPU an "
        "ask with up to 32 trials running, 0.71 s with 256 (500 finished trials, 7 parameters); thompson: "
        "asynchronous parallel Thompson sampling on the same GP (hpoflow.search.gp_parallel), one fit and one "
        "posterior over 1,024 candidates serving refit_every asks: 0.23 s an ask with a fit at each, 60 ms at "
        f"32 at once, 1.7 ms at 1,024; auto: ei up to {EI_UP_TO} trials at once (search.max_concurrent), "
        "thompson above, and thompson wherever the GP is fitted per budget (per_budget)"))
    refit_every: int | None = Field(default=None, ge=1, description=(
        "thompson: completed trials between two fits of the GP (null: 1 up to 15 trials at once, then "
        "max_concurrent // 8: 4 at 32, 128 at 1,024, where a fit's 0.2-0.3 s is shared by 128 asks)"))

    per_budget: bool | None = Field(default=None, description=(
        "fit the GP on the trials' reports at one budget, as BOHB fits its model (hpoflow.search.bohb), "
        "instead of on the completed trials alone (Optuna's GPSampler leaves pruned and paused trials out); "
        "null: on when the study has a pruner or a promotion scheduler"))

    @classmethod
    def acquisition_for(cls, acquisition: str, max_concurrent: int, per_budget: bool = False) -> str:
        """``acquisition`` with ``auto`` resolved for a study of ``max_concurrent`` trials at once, fitted per
        budget or not (class docstring)."""
        if acquisition == "auto":
            return "ei" if max_concurrent <= cls.EI_UP_TO and not per_budget else "thompson"
        return acquisition

    def sampler_kwargs(self, max_concurrent: int, stops_early: bool = False) -> dict[str, Any]:
        per_budget = stops_early if self.per_budget is None else self.per_budget
        return {**self.kwargs(), "acquisition": self.acquisition_for(self.acquisition, max_concurrent, per_budget),
                "max_concurrent": max_concurrent, "per_budget": per_budget}


class NSGAIIOptions(Options):
    """``optuna.samplers.NSGAIISampler`` (several objectives; constraints)."""

    population_size: int = Field(default=50, ge=2)
    mutation_prob: float | None = Field(default=None, ge=0, le=1)
    crossover_prob: float = Field(default=0.9, ge=0, le=1)
    swapping_prob: float = Field(default=0.5, ge=0, le=1)


class NSGAIIIOptions(NSGAIIOptions):
    """``optuna.samplers.NSGAIIISampler`` (many objectives; constraints)."""

    dividing_parameter: int = Field(default=3, ge=1)


class CmaEsOptions(Options):
    """``optuna.samplers.CmaEsSampler``."""

    sigma0: float | None = Field(default=None, gt=0)
    n_startup_trials: int = Field(default=1, ge=0)
    consider_pruned_trials: bool = False
    restart_strategy: Literal["ipop", "bipop"] | None = None
    popsize: int | None = Field(default=None, ge=2)
    inc_popsize: int = Field(default=-1)
    use_separable_cma: bool = False
    with_margin: bool = False
    lr_adapt: bool = False
    warn_independent_sampling: bool = False


class NopPrunerOptions(NoOptions):
    """No early stopping."""


class PrunerOptions(Options):
    """Base of a pruner's options: ``pruner_kwargs`` may depend on the trials' epochs (``training.epochs``):
    an ``auto`` step becomes the first rung of Hyperband's geometry there (``hpoflow.search.schedulers.
    first_rung``: 52 epochs -> 2), so a trial is never judged before the first rung."""

    def pruner_kwargs(self, first_rung: int | None, epochs: int | None = None) -> dict[str, Any]:
        """The pruner's keyword arguments; ``first_rung``: the first rung of the study's epochs, ``epochs``: those
        epochs (None: unknown)."""
        return self.kwargs()


def _int_or_auto(v: int | str, least: int, name: str) -> int | str:
    if isinstance(v, int) and v < least:
        raise ValueError(f"{name} must be >= {least} or auto, but got {v}")
    return v


class MedianPrunerOptions(PrunerOptions):
    """``optuna.pruners.MedianPruner``: stop a trial below the median of earlier trials at the same step."""

    startup_trials: int = Field(default=5, ge=0, description="Trials that finish before pruning starts.")
    warmup_steps: int | Literal["auto"] = Field(
        default="auto", description="The first step at which a trial can be pruned (auto: the first rung of "
                                    "Hyperband's geometry over training.epochs, 2 of 52; 0 when epochs are unknown).")
    interval_steps: int = Field(default=1, ge=1)
    min_trials: int = Field(default=1, ge=1, description="Trials reporting a step before it is compared.")

    @field_validator("warmup_steps")
    @classmethod
    def _steps(cls, v: int | str) -> int | str:
        return _int_or_auto(v, 0, "warmup_steps")

    def pruner_kwargs(self, first_rung: int | None, epochs: int | None = None) -> dict[str, Any]:
        warmup = (first_rung or 0) if self.warmup_steps == "auto" else self.warmup_steps
        return {"n_startup_trials": self.startup_trials, "n_warmup_steps": warmup,
                "interval_steps": self.interval_steps, "n_min_trials": self.min_trials}

    def kwargs(self) -> dict[str, Any]:
        return self.pruner_kwargs(None)


class PercentilePrunerOptions(MedianPrunerOptions):
    """``optuna.pruners.PercentilePruner``: like median, at ``percentile``."""

    percentile: float = Field(default=25.0, gt=0, lt=100)

    def pruner_kwargs(self, first_rung: int | None, epochs: int | None = None) -> dict[str, Any]:
        return {**super().pruner_kwargs(first_rung, epochs), "percentile": self.percentile}


class _RungPrunerOptions(PrunerOptions):
    """The rungs of Optuna's successive-halving pruners: ``min_resource * reduction_factor**k``."""

    min_resource: int | Literal["auto"] = Field(
        default="auto", description="The first rung (auto: the first rung of Hyperband's geometry over "
                                    "training.epochs, 2 of 52, so the rungs are 2, 6, 18; 1 when epochs are unknown).")
    reduction_factor: int = Field(default=3, ge=2)

    @field_validator("min_resource")
    @classmethod
    def _positive(cls, v: int | str) -> int | str:
        return _int_or_auto(v, 1, "min_resource")

    def pruner_kwargs(self, first_rung: int | None, epochs: int | None = None) -> dict[str, Any]:
        auto = self.min_resource == "auto"
        return {**self.kwargs(), "min_resource": (first_rung or 1) if auto else self.min_resource}


class AshaPrunerOptions(_RungPrunerOptions):
    """``optuna.pruners.SuccessiveHalvingPruner`` (asynchronous successive halving)."""

    min_early_stopping_rate: int = Field(default=0, ge=0)


class HyperbandPrunerOptions(_RungPrunerOptions):
    """``optuna.pruners.HyperbandPruner``; ``max_resource`` defaults to ``training.epochs``, else to the
    trials' reported steps (Optuna's ``auto``: its brackets wait for a trial to complete, and no trial is
    pruned before; with 1,024 trials at once on a budget of a few epochs each, none ever was)."""

    max_resource: int | None = Field(
        default=None, ge=1, description="The largest step (default: training.epochs; when the epochs are not a "
                                        "number, the longest completed trial's last step + 1, known only once a "
                                        "trial completes: no trial is pruned before).")

    def pruner_kwargs(self, first_rung: int | None, epochs: int | None = None) -> dict[str, Any]:
        return {**super().pruner_kwargs(first_rung, epochs), "max_resource": self.max_resource or epochs or "auto"}


class NoSchedulerOptions(NoOptions):
    """No scheduler: trials run to their end (or a pruner stops them)."""


class AshaSchedulerOptions(Options):
    """Promotion-type ASHA (``hpoflow.search.schedulers``): pause at rungs, promote the top 1/eta.
    ``max_resource`` defaults to the trial's ``training.epochs``."""

    min_resource: int = Field(default=1, ge=1, description="The first rung's step (epochs).")
    max_resource: int | None = Field(default=None, ge=1, description="The last step (default: training.epochs).")
    reduction_factor: int = Field(default=3, ge=2, description="eta: the top 1/eta of a rung is promoted.")
    min_early_stopping_rate: int = Field(default=0, ge=0, description="s: the s lowest rungs are left out.")
    anchor: Literal["max", "min"] = Field(
        default="max", description="max: rungs at max_resource / eta**k (Hyperband's geometry: 2, 6, 17 of 52); "
                                   "min: at min_resource * eta**k (1, 3, 9, 27).")


class HyperbandSchedulerOptions(Options):
    """Promotion-type ASHA in each Hyperband bracket (a trial's bracket: its number modulo the brackets)."""

    min_resource: int = Field(default=1, ge=1)
    max_resource: int | None = Field(default=None, ge=1)
    reduction_factor: int = Field(default=3, ge=2)
    anchor: Literal["max", "min"] = Field(
        default="max", description="max: rungs at max_resource / eta**k (Hyperband's geometry); min: at "
                                   "min_resource * eta**k.")


def pbt_budget(population: int, interval: int, epochs: int) -> int:
    """The most intervals a PBT study can have: ``population x ceil(epochs / interval)`` (a member never
    trains an epoch range twice, so it has at most that many intervals)."""
    return population * math.ceil(epochs / interval)


class PbtSchedulerOptions(Options):
    """Population-based training (``hpoflow.search.pbt``): members train in intervals; at each interval's
    end a member in the bottom ``quantile`` copies a top member's checkpoint (exploit) and changes its
    hyperparameters (explore)."""

    population: int = Field(default=8, ge=2, description="Members trained side by side.")
    interval: int = Field(default=2, ge=1, description="Epochs per interval (one Optuna trial each).")
    quantile: float = Field(default=0.25, gt=0, le=0.5, description="Bottom/top fraction for exploit.")
    resample_probability: float = Field(default=0.25, ge=0, le=1,
                                        description="PBT explore: chance to resample a hyperparameter.")
    perturb: list[float] = Field(default=[0.8, 1.2], min_length=1,
                                 description="PBT explore: factors one of which multiplies a hyperparameter.")
    explore: Literal["pbt", "pb2"] = Field(default="pbt", description="pbt: PBT's rules; pb2: PB2's GP bandit.")
    hyperparams: list[str] | None = Field(
        default=None, min_length=1, description="Space parameters explored (default: every float/int one).")

    def budget(self, epochs: int) -> int:
        """The most intervals a study of ``epochs`` can have (``pbt_budget``)."""
        return pbt_budget(self.population, self.interval, epochs)

    @field_validator("perturb")
    @classmethod
    def _positive(cls, v: list[float]) -> list[float]:
        if any(not (f > 0 and math.isfinite(f)) for f in v):
            raise ValueError(f"every perturb factor must be a finite number > 0, but got {v}")
        return v
