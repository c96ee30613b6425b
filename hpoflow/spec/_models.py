"""Typed, frozen study spec. Everything downstream trusts these objects and never re-validates.

A study has six parts: ``study`` (name, metric, direction), ``space`` (the search parameters),
``search`` (algorithm and budgets), ``training`` (what a trial trains), ``resources`` (what one
trial holds) and ``engine``/``storage`` (where trials run and where the study lives).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from hpoflow.errors import did_you_mean

__all__ = [
    "ALGORITHMS",
    "PLACEHOLDER",
    "CategoricalParam",
    "CheckpointSpec",
    "ConditionMap",
    "EngineName",
    "FloatParam",
    "IntParam",
    "OracleSpec",
    "Param",
    "PrunerSpec",
    "ResourcesSpec",
    "SearchSpec",
    "StudySection",
    "StudySpec",
    "TrainConfig",
]

ALGORITHMS = ("grid", "random", "tpe", "gp", "cmaes")
PRUNERS = ("none", "median", "percentile", "asha", "hyperband")
PLACEHOLDER = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
Scalar = bool | int | float | str | None
EngineName = Literal["local", "compss"]


class _Strict(BaseModel):
    """Frozen model that rejects unknown keys with a "did you mean" and the list of valid keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            # A field is written by its alias when it has one (``async`` for ``async_``).
            valid = [f.alias or name for name, f in cls.model_fields.items()]
            unknown = [k for k in data if k not in valid and k not in cls.model_fields]
            if unknown:
                key = str(unknown[0])
                raise PydanticCustomError(
                    "unknown_key",
                    "unknown key '{key}'{hint}; valid keys here: {valid}. Fix: rename or remove it",
                    {"key": key, "hint": did_you_mean(key, valid), "valid": ", ".join(valid)},
                )
        return data


ConditionMap = dict[str, list[Scalar]]


class _ParamBase(_Strict):
    when: ConditionMap | None = Field(
        default=None,
        description="Active only when each named parameter has one of the given values.",
    )

    @model_validator(mode="before")
    @classmethod
    def _normalise_when(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("when"), dict):
            when = {k: (v if isinstance(v, list) else [v]) for k, v in data["when"].items()}
            data = {**data, "when": when}
        return data


class FloatParam(_ParamBase):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = None

    @model_validator(mode="after")
    def _check(self) -> FloatParam:
        _check_range(self.low, self.high, self.log, self.step)
        return self


class IntParam(_ParamBase):
    type: Literal["int"]
    low: int
    high: int
    log: bool = False
    step: int = 1

    @model_validator(mode="after")
    def _check(self) -> IntParam:
        _check_range(self.low, self.high, self.log, self.step if self.step != 1 else None)
        if self.step < 1:
            raise PydanticCustomError(
                "bad_step", "step must be >= 1 for an int parameter, but got step={step}", {"step": self.step}
            )
        return self


class CategoricalParam(_ParamBase):
    type: Literal["categorical"]
    choices: list[Scalar]

    @model_validator(mode="after")
    def _check(self) -> CategoricalParam:
        if not self.choices:
            raise PydanticCustomError(
                "empty_choices", "choices must hold at least one value, but got []. Fix: list the values to try", {}
            )
        seen: list[Scalar] = []
        for c in self.choices:
            if c in seen and type(c) is type(seen[seen.index(c)]):
                raise PydanticCustomError(
                    "duplicate_choice", "choices must be distinct, but {value} appears twice", {"value": c}
                )
            seen.append(c)
        return self


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if low > high:
        raise PydanticCustomError(
            "low_gt_high",
            "low <= high must hold, but got low={low}, high={high}. Fix: swap them",
            {"low": low, "high": high},
        )
    if log and low <= 0:
        raise PydanticCustomError(
            "log_nonpositive",
            "a log-scaled parameter needs low > 0, but got low={low}. Fix: raise low or set log: false",
            {"low": low},
        )
    if log and step is not None:
        raise PydanticCustomError(
            "log_and_step", "log and step cannot be used together (Optuna's rule). Fix: drop one of them", {}
        )
    if step is not None and step <= 0:
        raise PydanticCustomError("bad_step", "step must be > 0, but got step={step}", {"step": step})


Param = Annotated[FloatParam | IntParam | CategoricalParam, Field(discriminator="type")]


class StudySection(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    metric: str = Field(min_length=1)
    direction: Literal["minimize", "maximize"]


class PrunerSpec(_Strict):
    """Early stopping of unpromising trials from their intermediate reports (Optuna pruners)."""

    type: Literal["none", "median", "percentile", "asha", "hyperband"] = "none"
    warmup_steps: int = Field(default=0, ge=0)
    startup_trials: int = Field(default=5, ge=0)
    percentile: float = Field(default=25.0, gt=0, lt=100)
    min_resource: int = Field(default=1, ge=1)
    reduction_factor: int = Field(default=3, ge=2)
    max_resource: int | None = Field(default=None, ge=1)


class SearchSpec(_Strict):
    algorithm: Literal["grid", "random", "tpe", "gp", "cmaes"] = "tpe"
    n_trials: int | None = Field(default=None, ge=1)
    max_concurrent: int = Field(default=1, ge=1)
    seed: int | None = None
    timeout: float | None = Field(
        default=None, gt=0, description="Wall-clock budget in seconds: no new trial starts after it."
    )
    max_failures: int | None = Field(default=None, ge=1)
    sampler_options: dict[str, Any] = Field(default_factory=dict)
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)

    @model_validator(mode="after")
    def _check(self) -> SearchSpec:
        if self.n_trials is None and self.algorithm != "grid":
            raise PydanticCustomError(
                "missing_n_trials",
                "n_trials is required for algorithm '{algo}' (only grid can default to the grid size). "
                "Fix: add n_trials: 20",
                {"algo": self.algorithm},
            )
        return self


class CheckpointSpec(_Strict):
    """``training.checkpoint``: periodic, atomic, checksummed checkpoints (docs/checkpointing.md).

    ``async`` is a Python keyword: the field is ``async_`` and reads and writes the key ``async``.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True, serialize_by_alias=True)

    every: int = Field(default=0, ge=0, description="Save every K epochs (0: never).")
    keep: int = Field(default=2, ge=1, description="How many of the newest checkpoints to keep.")
    async_: bool = Field(default=True, alias="async",
                         description="Write in a background thread (the training thread only copies the state).")


class TrainConfig(_Strict):
    """What one trial trains, after every ``${param}`` has been replaced by its value.

    With ``function`` set, the user's function trains and receives this config (``options`` is
    free-form for it); otherwise the built-in trainer trains ``model`` on ``dataset``.
    """

    function: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    model: str = "cnn"
    model_options: dict[str, Any] = Field(default_factory=dict)
    dataset: Literal["digits", "synthetic"] = "digits"
    epochs: int = Field(default=10, ge=1)
    batch_size: int = Field(default=64, ge=1, description="Per process (rank).")
    optimizer: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(default=1e-3, gt=0)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    weight_decay: float = Field(default=0.0, ge=0)
    val_fraction: float = Field(default=0.2, gt=0, lt=1)
    seed: int = 0
    options: dict[str, Any] = Field(default_factory=dict)
    # -- data-parallel strategy (hpoflow.train.strategies; docs/strategies.md) ------------------
    strategy: Literal["allreduce", "parameter_server", "easgd", "local_sgd"] = Field(
        default="allreduce", description="How the ranks of a trial combine their work.")
    strategy_options: dict[str, Any] = Field(
        default_factory=dict,
        description="Options of the strategy, or one mapping per strategy name (for a "
                    "searched strategy); once validated: the active strategy's options, in full.")
    # -- large-batch control (hpoflow.train.largebatch) -----------------------------------------
    lr_scaling: Literal["none", "linear", "sqrt"] = Field(
        default="none", description="Scale lr by the global batch over base_batch_size.")
    base_batch_size: int | None = Field(
        default=None, ge=1, description="Batch size lr was tuned for (default: batch_size).")
    warmup_epochs: float = Field(default=0.0, ge=0, description="Linear lr warm-up length.")
    lars: bool = Field(default=False, description="Layer-wise adaptive rate scaling (LARS).")
    lars_trust_coefficient: float = Field(default=0.001, gt=0)
    grad_accum_steps: int = Field(default=1, ge=1, description="Micro-batches per optimizer step.")
    # -- checkpoints (hpoflow.train.checkpoint; docs/checkpointing.md) ---------------------------
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="Periodic checkpoints a trial resumes from after a crash: every, keep, async.")

    @staticmethod
    def strategy_option_table() -> dict[str, dict[str, tuple[str, Any, Any]]]:
        """strategy -> option -> (kind, default, rule): the single source of truth for strategy
        options, torch-free because the driver validates specs without importing torch."""
        return {
            "allreduce": {
                "bucket_cap_mb": ("float>0", 25.0, None),
                "gradient_as_bucket_view": ("bool", False, None),
                "compression": ("choice", "none", ("none", "fp16", "bf16", "powersgd")),
                "powersgd_rank": ("int>=1", 1, None),
                "powersgd_start_iter": ("int>=2", 2, None),
            },
            "parameter_server": {"servers": ("int>=1", 1, None)},
            "easgd": {
                "alpha": ("float(0,1)", None, None),
                "rho": ("float>0", None, None),
                "tau": ("int>=1", 4, None),
                "momentum": ("bool", False, None),
                "momentum_coefficient": ("float[0,1)", 0.9, None),
            },
            "local_sgd": {"period": ("int>=1", 8, None)},
        }

    @staticmethod
    def _option_problem(kind: str, value: Any, rule: Any) -> str | None:
        """Why ``value`` breaks an option's rule, or None if it is fine."""
        if kind == "bool":
            return None if isinstance(value, bool) else "must be true or false"
        if kind == "choice":
            return None if value in rule else f"must be one of {', '.join(rule)}"
        if kind.startswith("int"):
            low = int(kind.removeprefix("int>="))
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
            return None if ok else f"must be a whole number >= {low}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return "must be a number"
        if kind == "float>0":
            return None if value > 0 else "must be > 0"
        if kind == "float(0,1)":
            return None if 0 < value < 1 else "must lie in the open interval (0, 1)"
        return None if 0 <= value < 1 else "must lie in [0, 1)"  # float[0,1)

    @model_validator(mode="after")
    def _check_strategy(self) -> TrainConfig:
        table = self.strategy_option_table()
        raw = dict(self.strategy_options)
        if raw and all(k in table for k in raw):  # one mapping per strategy: take the active one
            for name, sub in raw.items():
                if not isinstance(sub, dict):
                    raise PydanticCustomError(
                        "strategy_options",
                        "strategy_options.{name} must be a mapping of {name}'s options, but got "
                        "{value}. Fix: put {name}'s options under strategy_options.{name}",
                        {"name": name, "value": sub, "at": f"strategy_options.{name}"})
            chosen = dict(raw.get(self.strategy, {}))
            others = {n: dict(s) for n, s in raw.items() if n != self.strategy}
        else:
            chosen, others = raw, {}
        for name, opts in [(self.strategy, chosen), *others.items()]:
            schema = table[name]
            prefix = "strategy_options" if chosen is raw else f"strategy_options.{name}"
            for key, value in opts.items():
                if key not in schema:
                    raise PydanticCustomError(
                        "unknown_strategy_option",
                        "{prefix}.{key}: unknown option of strategy '{name}'{hint}; valid "
                        "options of {name}: {valid}. Fix: rename or remove it",
                        {"prefix": prefix, "key": key, "name": name, "valid": ", ".join(schema),
                         "hint": did_you_mean(key, list(schema)), "at": f"{prefix}.{key}"})
                kind, default, rule = schema[key]
                if value is None and default is None:
                    continue  # "unset" (how a normalised config round-trips)
                problem = self._option_problem(kind, value, rule)
                if problem:
                    raise PydanticCustomError(
                        "bad_strategy_option",
                        "{prefix}.{key} {problem}, but got {value} (strategy '{name}')",
                        {"prefix": prefix, "key": key, "problem": problem, "value": value,
                         "name": name, "at": f"{prefix}.{key}"})
        if self.strategy == "easgd" and None not in (chosen.get("alpha"), chosen.get("rho")):
            raise PydanticCustomError(
                "bad_strategy_option",
                "strategy_options: easgd takes alpha or rho (alpha = lr * rho), not both, but got "
                "alpha={alpha}, rho={rho}. Fix: remove one",
                {"alpha": chosen["alpha"], "rho": chosen["rho"]})
        if self.strategy == "easgd" and chosen.get("momentum") and self.optimizer != "sgd":
            raise PydanticCustomError(
                "bad_strategy_option",
                "strategy_options.momentum: true (momentum EASGD) puts Nesterov momentum on each "
                "worker's SGD step, so it needs optimizer: sgd, but got optimizer: {opt}. Fix: set "
                "optimizer: sgd or momentum: false", {"opt": self.optimizer})
        full = {k: chosen.get(k, spec[1]) for k, spec in table[self.strategy].items()}
        if full != self.strategy_options:
            object.__setattr__(self, "strategy_options", full)  # frozen: normalise once, here
        return self


class ResourcesSpec(_Strict):
    processes: int = Field(default=1, ge=1, description="DDP world size of one trial.")
    cpus_per_process: int = Field(default=1, ge=1)
    gpus_per_process: int = Field(default=0, ge=0)
    nodes: int = Field(default=1, ge=1, description="Nodes one trial spans (compss engine).")
    timeout: float | None = Field(default=None, gt=0, description="Seconds before a trial is killed.")
    max_retries: int = Field(default=0, ge=0)


class OracleSpec(_Strict):
    """The parallelism oracle's check before each trial (built-in trainer only)."""

    enabled: bool = True
    cluster: str | None = Field(
        default=None,
        description="Preset name (laptop, p100-cluster, ...) or a cluster YAML file such as one written "
                    "by `hpoflow oracle calibrate`; default: the laptop preset.",
    )


class StudySpec(_Strict):
    """A whole study. ``training`` may still hold ``${param}`` placeholders."""

    study: StudySection
    space: dict[str, Param] = Field(default_factory=dict)
    search: SearchSpec
    training: dict[str, Any] = Field(default_factory=dict)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    engine: EngineName = "local"
    storage: str | None = None
    compss: dict[str, Any] = Field(default_factory=dict, description="Options of the compss engine.")
    oracle: OracleSpec = Field(default_factory=OracleSpec)
