"""Typed, frozen study spec. Everything downstream trusts these objects and never re-validates.

A study has six parts: ``study`` (name, metric, direction), ``space`` (the search parameters),
``search`` (algorithm and budgets), ``training`` (what a trial trains), ``resources`` (what one
trial holds) and ``engine``/``storage`` (where trials run and where the study lives).
"""

from __future__ import annotations

import difflib
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

__all__ = [
    "ALGORITHMS",
    "PLACEHOLDER",
    "CategoricalParam",
    "ConditionMap",
    "EngineName",
    "FloatParam",
    "IntParam",
    "Param",
    "PrunerSpec",
    "ResourcesSpec",
    "SearchSpec",
    "StudySection",
    "StudySpec",
    "TrainConfig",
    "did_you_mean",
]

ALGORITHMS = ("grid", "random", "tpe", "gp", "cmaes")
PRUNERS = ("none", "median", "percentile", "asha", "hyperband")
PLACEHOLDER = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
Scalar = bool | int | float | str | None
EngineName = Literal["local", "compss"]


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class _Strict(BaseModel):
    """Frozen model that rejects unknown keys with a "did you mean" and the list of valid keys."""

    model_config = ConfigDict(frozen=True, extra="forbid", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            valid = list(cls.model_fields)
            unknown = [k for k in data if k not in valid]
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


class ResourcesSpec(_Strict):
    processes: int = Field(default=1, ge=1, description="DDP world size of one trial.")
    cpus_per_process: int = Field(default=1, ge=1)
    gpus_per_process: int = Field(default=0, ge=0)
    nodes: int = Field(default=1, ge=1, description="Nodes one trial spans (compss engine).")
    timeout: float | None = Field(default=None, gt=0, description="Seconds before a trial is killed.")
    max_retries: int = Field(default=0, ge=0)


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
