"""Throw-away plug-ins of every kind, registered when this module is imported: a spec names it with
``plugins: [tests.plugin_kit]``, so the driver and every trial process import it.

Each leaves a trace the tests can check: the model, the strategy and the checkpoint format append a line
to the file their ``marker`` option names (they run in the trial's processes), the sampler pins every parameter to its
lowest value (``kit_single`` too, for one objective only), the cost model and the engine score trials
by their number and ``lr``.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.distributions import BaseDistribution, CategoricalDistribution
from pydantic import Field

from hpoflow.engines.base import Engine, Event
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.registry import CHECKPOINT_FORMATS, COST_MODELS, ENGINES, MODELS, SAMPLERS, NoOptions, Options
from hpoflow.train.checkpoint import Checkpointer
from hpoflow.train.options import AllReduceOptions
from hpoflow.train.strategies import AllReduce, StrategyEnv, register_strategy
from hpoflow.trial import TrialRequest, TrialResult


def _mark(path: str | None, what: str) -> None:
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{what} pid={os.getpid()} rank={os.environ.get('HPOFLOW_RANK', '?')}\n")


# -- a model ------------------------------------------------------------------------------------------
class TinyOptions(Options):
    hidden: int = Field(default=8, ge=1)
    marker: str | None = None


def tiny(input_shape: tuple[int, ...], n_classes: int, hidden: int = 8, marker: str | None = None) -> Any:
    from torch import nn

    _mark(marker, "model")
    size = 1
    for d in input_shape:
        size *= d
    return nn.Sequential(nn.Flatten(), nn.Linear(size, hidden), nn.ReLU(), nn.Linear(hidden, n_classes))


MODELS.register("kit_tiny", tiny, TinyOptions)


# -- a strategy ---------------------------------------------------------------------------------------
class KitAllReduceOptions(AllReduceOptions):
    marker: str | None = None


class KitAllReduce(AllReduce):
    """All-reduce DDP that says it ran."""

    name = "kit_allreduce"

    def __init__(self, options: dict[str, Any], env: StrategyEnv) -> None:
        options = dict(options)
        _mark(options.pop("marker", None), "strategy")
        super().__init__(options, env)


register_strategy(KitAllReduce, KitAllReduceOptions)


# -- a checkpoint format ------------------------------------------------------------------------------
class KitFormatOptions(Options):
    marker: str | None = None


class KitFormat(Checkpointer):
    """The replica format under its own file names, saying what it saved."""

    name = "kit_format"
    prefix = "kit"

    def save(self, state: Any, step: int, private: Any = None, *, sharded: Any = None) -> None:
        _mark(getattr(self.options, "marker", None), f"checkpoint step={step}")
        super().save(state, step, private, sharded=sharded)


CHECKPOINT_FORMATS.register("kit_format", KitFormat, KitFormatOptions)


# -- a sampler ----------------------------------------------------------------------------------------
class PinnedOptions(NoOptions):
    """The pinned sampler takes no options."""


class PinnedSampler(optuna.samplers.BaseSampler):
    """Every parameter at its lowest value (the first choice of a categorical)."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed

    def infer_relative_search_space(self, study: optuna.Study, trial: optuna.trial.FrozenTrial
                                    ) -> dict[str, BaseDistribution]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: optuna.trial.FrozenTrial, param_name: str,
                           param_distribution: BaseDistribution) -> Any:
        if isinstance(param_distribution, CategoricalDistribution):
            return param_distribution.choices[0]
        return param_distribution.low  # type: ignore[attr-defined]


SAMPLERS.register("kit_pinned", PinnedSampler, PinnedOptions)


class SingleObjectiveSampler(PinnedSampler):
    """Pinned, and for one objective only (as Optuna's CmaEsSampler is): a study of several refuses it."""

    def sample_relative(self, study: optuna.Study, trial: optuna.trial.FrozenTrial,
                        search_space: dict[str, BaseDistribution]) -> dict[str, Any]:
        self._raise_error_if_multi_objective(study)
        return {}


SAMPLERS.register("kit_single", SingleObjectiveSampler, PinnedOptions)


# -- a cost model of the simulated engine ---------------------------------------------------------------
class ConstantCostOptions(Options):
    seconds: float = Field(default=10.0, gt=0)


def constant_cost(options: ConstantCostOptions) -> Callable[[TrialRequest], TrialCost]:
    def cost(req: TrialRequest) -> TrialCost:
        value = float(req.params.get("lr", 0.0)) * 100 + req.number
        return TrialCost(options.seconds, {req.metric: value}, [{req.metric: value}])

    return cost


COST_MODELS.register("kit_constant", constant_cost, ConstantCostOptions)


# -- an engine ------------------------------------------------------------------------------------------
class KitEngineOptions(Options):
    slots: int = Field(default=1, ge=1)


class KitEngine(Engine):
    """Scores a trial as its lr at once, in the driver's thread; holds ``slots`` trials at a time."""

    name = "kit_engine"

    def __init__(self, options: KitEngineOptions) -> None:
        self.options = options
        self._done: list[Event] = []

    @classmethod
    def from_options(cls, options: KitEngineOptions, run_dir: Path | None = None) -> KitEngine:
        return cls(options)

    @classmethod
    def check_fit(cls, options: KitEngineOptions, request: TrialRequest) -> None:
        from hpoflow.errors import EngineError

        if request.processes > 1:
            raise EngineError(f"the kit engine runs one process per trial, not {request.processes}. "
                              "Fix: resources.processes: 1")

    def capacity(self, request: TrialRequest) -> int:
        return self.options.slots if request.processes == 1 else 0

    def submit(self, request: TrialRequest) -> None:
        value = float(request.params["lr"])
        self._done.append(TrialResult(request.number, "complete", value=value, metrics={request.metric: value}))

    def poll(self, timeout: float | None) -> list[Event]:
        out, self._done = self._done, []
        return out

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        pass

    def cancel(self, number: int, reason: str) -> None:
        pass

    def running(self) -> list[int]:
        return [e.number for e in self._done]

    def close(self) -> None:
        pass


ENGINES.register("kit_engine", KitEngine, KitEngineOptions)
