"""Typed, frozen study spec. Everything downstream trusts these objects and never re-validates.

A study has six parts: ``study`` (name, metric, direction), ``space`` (the search parameters),
``search`` (algorithm and budgets), ``training`` (what a trial trains), ``resources`` (what one
trial holds) and ``engine``/``storage`` (where trials run and where the study lives).
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import re
import unicodedata
from collections.abc import Iterator, Sequence
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from hpoflow.errors import did_you_mean
from hpoflow.registry import (
    CHECKPOINT_FORMATS,
    ELASTIC,
    ENGINES,
    MODELS,
    PRUNERS,
    SAMPLERS,
    SCHEDULERS,
    STRATEGIES,
    Registry,
    check_class,
    is_class_path,
)
from hpoflow.spec._auto import resolve_auto, resolve_bohb
from hpoflow.spec._command import UNBOUNDED_EPOCHS, command_argv
from hpoflow.spec._gpus import share_error
from hpoflow.spec._yaml import MAX_ITEMS as MAX_CHOICES

__all__ = [
    "PLACEHOLDER",
    "SYSTEM_PREFIX",
    "CategoricalParam",
    "CheckpointSpec",
    "ConditionMap",
    "ElasticRange",
    "FloatParam",
    "IntParam",
    "Objective",
    "OracleSpec",
    "Param",
    "PrunerSpec",
    "ResourcesSpec",
    "SchedulerSpec",
    "SearchSpec",
    "StudySection",
    "StudySpec",
    "TrackingSpec",
    "TrainConfig",
    "in_memory_storage",
    "parse_constraint",
    "placeholders",
    "unprintable",
]

PLACEHOLDER = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
Scalar = bool | int | float | str | None
# optimizer param-group keys the built-in trainer may change between epochs of one run (training.schedule,
# a PBT member's resume with new values)
SCHEDULABLE = ("lr", "momentum", "weight_decay")


def in_memory_storage(url: str) -> str | None:
    """Why the storage URL ``url`` names a database that lives in the driver's memory only (SQLite's
    ``sqlite://`` with no file, ``:memory:``, ``file::memory:``, ``?mode=memory``), or None."""
    scheme, sep, rest = url.partition("://")
    if not sep or not scheme.lower().startswith("sqlite"):
        return None
    rest, _, query = rest.partition("?")
    host, _, database = rest.partition("/")  # (SQLite URLs have no host: sqlite:///<path>)
    if not database and not host:
        return "an SQLite URL with no database file, which SQLite keeps in memory"
    if database == ":memory:" or database.startswith("file::memory:") or "mode=memory" in query.split("&"):
        return "an SQLite in-memory database"
    return None


def placeholders(value: Any) -> Iterator[tuple[tuple[str | int, ...], str]]:
    """Yield ``(path, param_name)`` for every ``${param}`` inside ``value`` (nested dicts/lists)."""
    if isinstance(value, str):
        m = PLACEHOLDER.match(value.strip())
        if m:
            yield (), m.group(1)
    elif isinstance(value, dict):
        for k, v in value.items():
            for sub, name in placeholders(v):
                yield (k, *sub), name
    elif isinstance(value, list):
        for i, v in enumerate(value):
            for sub, name in placeholders(v):
                yield (i, *sub), name


def unprintable(name: str) -> str:
    """Why ``name`` cannot be shown as it is ('' when it can): it holds a control or formatting
    character (NUL, ESC, a newline, a tab, U+202E RIGHT-TO-LEFT OVERRIDE...), which would reach the
    terminal table and the CSV header raw."""
    bad = next((c for c in name if not c.isprintable()), None)
    if bad is None:
        return ""
    kind = "control" if unicodedata.category(bad) == "Cc" else "non-printing"
    return (f"holds the {kind} character U+{ord(bad):04X}; names and values shown in tables and trials.csv "
            "must be printable text. Fix: remove it")


def _printable_name(name: str) -> str:
    why = unprintable(name)
    if why:
        raise PydanticCustomError("bad_name", "name {name} {why}", {"name": repr(name), "why": why})
    return name


Name = Annotated[str, Field(min_length=1), AfterValidator(_printable_name)]


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
    choices: list[Scalar] = Field(description=f"The values to try (at most {MAX_CHOICES}).")

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        """A bound on choices, checked before any choice is: a long list is a range written out."""
        if isinstance(data, dict) and isinstance(data.get("choices"), list | tuple) and \
                len(data["choices"]) > MAX_CHOICES:
            raise PydanticCustomError(
                "too_many_choices", "{at}: a categorical parameter holds at most {max} choices, but got {n}. "
                "Fix: search a range instead ({type: int, low: 0, high: {top}} or type: float), or list fewer "
                "choices", {"at": "choices", "max": MAX_CHOICES, "n": len(data["choices"]),
                             "top": len(data["choices"]) - 1})
        return data

    @model_validator(mode="after")
    def _check(self) -> CategoricalParam:
        if not self.choices:
            raise PydanticCustomError(
                "empty_choices", "choices must hold at least one value, but got []. Fix: list the values to try", {}
            )
        seen: set[tuple[type, Scalar]] = set()  # 1 and 1.0 and True are different choices
        for i, c in enumerate(self.choices):
            if (type(c), c) in seen:
                raise PydanticCustomError(
                    "duplicate_choice", "choices must be distinct, but {value} appears twice", {"value": c}
                )
            seen.add((type(c), c))
            if isinstance(c, str) and (why := unprintable(c)):
                raise PydanticCustomError("bad_name", "{at}: choice {value} {why}",
                                          {"at": f"choices.{i}", "value": repr(c), "why": why})
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


class Objective(_Strict):
    """One objective of a multi-objective study."""

    name: Name
    direction: Literal["minimize", "maximize"]


class StudySection(_Strict):
    """``metric`` + ``direction`` (one objective), or ``metrics`` (several: ``[{name, direction}, ...]``;
    ``metric``/``direction`` then name the first, which progress and pruning use)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    metric: Name
    direction: Literal["minimize", "maximize"]
    metrics: list[Objective] = Field(default_factory=list, description="Several objectives (a Pareto front).")
    constraints: list[str] = Field(
        default_factory=list, description="Feasibility, e.g. 'peak_memory_mb <= 8000': a returned metric or a "
                                          "system_ usage figure, <= or >= a number (Optuna's constraints).")

    @model_validator(mode="before")
    @classmethod
    def _first_objective(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("metrics"), list) and data["metrics"]:
            first = data["metrics"][0]
            if isinstance(first, dict):
                data = {**data}
                if "metric" in data and data["metric"] != first.get("name"):
                    raise PydanticCustomError(
                        "metric_vs_metrics", "metric '{m}' is not the first of metrics ('{f}'). Fix: drop metric "
                        "(metrics names every objective)", {"m": data["metric"], "f": first.get("name")})
                data.setdefault("metric", first.get("name"))
                data.setdefault("direction", first.get("direction"))
        return data

    @model_validator(mode="after")
    def _check_objectives(self) -> StudySection:
        names = [o.name for o in self.metrics]
        if len(set(names)) != len(names):
            raise PydanticCustomError("duplicate_metric", "metrics names {names} more than once each. Fix: one "
                                      "entry per objective", {"names": names})
        if self.metrics and (self.metrics[0].direction != self.direction):
            raise PydanticCustomError("metric_vs_metrics", "direction {d} differs from the first objective's ({f}). "
                                      "Fix: drop direction", {"d": self.direction, "f": self.metrics[0].direction})
        for c in self.constraints:
            parse_constraint(c)
        if self.metric.startswith(SYSTEM_PREFIX):
            raise PydanticCustomError(
                "system_first_objective", "study.metric{s}: '{m}' is a system_ figure, measured when a trial ends, "
                "but the first objective is the one trials report as they run (progress, pruning). Fix: list "
                "it in study.metrics after a metric the training returns, e.g. metrics: [{{name: val_loss, "
                "direction: minimize}}, {{name: {m}, direction: minimize}}]",
                {"m": self.metric, "s": "s[0].name" if self.metrics else ""})
        return self

    @property
    def objectives(self) -> list[tuple[str, str]]:
        """(name, direction) of every objective: one for the simple form."""
        return [(o.name, o.direction) for o in self.metrics] or [(self.metric, self.direction)]

    @property
    def multi(self) -> bool:
        return len(self.objectives) > 1


SYSTEM_PREFIX = "system_"
"""Objectives and constraints named ``system_<figure>`` read a trial's measured usage (``system_energy_j``,
``system_rss_peak_mb``: hpoflow.train.usage), not a metric the training returns."""

_CONSTRAINT = re.compile(r"^\s*([A-Za-z_][\w.]*)\s*(<=|>=)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


def parse_constraint(text: str) -> tuple[str, str, float]:
    """``'name <= 8000'`` -> (name, op, bound); ``PydanticCustomError`` with the rule otherwise."""
    m = _CONSTRAINT.match(text)
    if m is None:
        raise PydanticCustomError("bad_constraint", "constraint '{c}' must read 'NAME <= NUMBER' or 'NAME >= NUMBER' "
                                  "(NAME a metric the trial returns, or system_rss_peak_mb and the like). Fix: e.g. "
                                  "'peak_memory_mb <= 8000'", {"c": text})
    return m.group(1), m.group(2), float(m.group(3))


def _checked_name(registry: Registry[Any], name: str, at: str) -> None:
    if name not in registry:
        raise PydanticCustomError("unknown_plugin", "{at}: {msg}", {"at": at, "msg": registry.unknown(name)})


def _non_default(registry: Registry[Any], name: str, values: dict[str, Any]) -> dict[str, Any]:
    """A plug-in's options (validated already) without those at their defaults: what a spec sets."""
    model = registry.options_model(name).model_validate(values)
    return model.model_dump(mode="json", by_alias=True, exclude_defaults=True)


def _check_plugin(spec: BaseModel, registry: Registry[Any], name_key: str, options_at: str) -> None:
    """The plug-in named by ``spec.<name_key>`` exists and ``spec.options`` are its options; the spec
    keeps all of them, defaults included (frozen: normalised once, here)."""
    name = getattr(spec, name_key)
    _checked_name(registry, name, name_key)
    full = registry.check(name, spec.options, at=options_at)  # type: ignore[attr-defined]
    if full != spec.options:  # type: ignore[attr-defined]
        object.__setattr__(spec, "options", full)


class PrunerSpec(_Strict):
    """Early stopping of unpromising trials from their intermediate reports (Optuna pruners).

    Written flat in YAML (``{type: median, startup_trials: 5}``): the keys beside ``type`` are the
    pruner's options, validated by its options model in ``hpoflow.registry.PRUNERS``.
    """

    type: str = "none"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split_flat(cls, data: Any) -> Any:
        if isinstance(data, dict) and "class" in data:  # {class: optuna.pruners.ThresholdPruner, options: {}}
            return {"type": data["class"], "options": data.get("options") or {}}
        if isinstance(data, dict) and "options" not in data:
            return {"type": data.get("type", "none"), "options": {k: v for k, v in data.items() if k != "type"}}
        return data

    @model_validator(mode="after")
    def _check(self) -> PrunerSpec:
        if self.type not in PRUNERS and is_class_path(self.type):
            check_class(self.type, self.options, "optuna.pruners:BasePruner", "options")
            return self
        _check_plugin(self, PRUNERS, "type", "")
        return self

    @property
    def enabled(self) -> bool:
        return self.type != "none"


class SchedulerSpec(_Strict):
    """Trials that pause at rungs with a checkpoint and resume later with more budget (docs/schedulers.md).

    Written flat in YAML (``{type: asha, min_resource: 1, reduction_factor: 3}``): the keys beside
    ``type`` are the scheduler's options, validated by its options model in ``hpoflow.registry.SCHEDULERS``.
    """

    type: str = "none"
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _split_flat(cls, data: Any) -> Any:
        if isinstance(data, str):
            return {"type": data, "options": {}}
        if isinstance(data, dict) and "options" not in data:
            return {"type": data.get("type", "none"), "options": {k: v for k, v in data.items() if k != "type"}}
        return data

    @model_validator(mode="after")
    def _check(self) -> SchedulerSpec:
        _check_plugin(self, SCHEDULERS, "type", "")
        return self

    @property
    def enabled(self) -> bool:
        return self.type != "none"

    def settings(self) -> dict[str, Any]:
        """``type`` and the options that differ from their defaults, flat as the YAML writes them."""
        return {"type": self.type, **_non_default(SCHEDULERS, self.type, self.options)}


class SearchSpec(_Strict):
    algorithm: str = Field(default="tpe", description="A registered sampler (grid, random, tpe, gp, cmaes, bohb, "
                                                      "...), any Optuna sampler class by import path, or auto (the "
                                                      "benchmark's best arm: gp, fitted per budget with Thompson "
                                                      "sampling, with the asha pruner when trials train several "
                                                      "epochs, else gp alone: docs/search.md); bohb comes "
                                                      "with the asha pruner unless a pruner or scheduler is named")
    n_trials: int | None = Field(default=None, ge=1)
    max_concurrent: int = Field(default=1, ge=1)
    seed: int | None = None
    timeout: float | None = Field(
        default=None, gt=0, description="Wall-clock budget in seconds: no new trial starts after it."
    )
    max_failures: int | None = Field(default=None, ge=1)
    energy_budget_kwh: float | None = Field(
        default=None, gt=0, description="Energy budget in kWh (docs/energy.md): once the energy every run of the "
        "trials spent (finished, paused, retried and cancelled runs; system_energy_j) adds up to it, no new "
        "trial starts; running ones finish.")
    fail_fast: int = Field(
        default=3, ge=0, description="Stop when the first K finished trials all failed with the same error "
                                     "(0: never).")
    sampler_options: dict[str, Any] = Field(default_factory=dict)
    enqueue: list[dict[str, Any]] = Field(
        default_factory=list, description="Known configurations evaluated first, in order (params not given "
                                          "are sampled); checked against the space.")
    warm_start: str | None = Field(
        default=None, description="Run directory of an earlier, compatible study (same metric and direction) whose "
                                  "completed trials the sampler learns from before the first trial.")
    pruner: PrunerSpec = Field(default_factory=PrunerSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    ask_ahead: Literal["auto", True, False] = Field(
        default="auto", description="Ask the sampler for the next trial while every slot is busy, so a freed slot "
        "never waits for it; auto: with 2 or more slots, once asking takes over 1 % of a trial's time (slow "
        "samplers, short trials).")
    lease_s: float = Field(
        default=60.0, ge=1.0, description="Seconds without a heartbeat after which a driver counts as dead, so "
        "that the other drivers of the study rerun its running trials (each driver beats every lease_s / 4 s).")

    @model_validator(mode="before")
    @classmethod
    def _class_form(cls, data: Any) -> Any:
        """``algorithm: {class: optuna.samplers.QMCSampler, options: {...}}`` is the class path plus
        ``sampler_options``."""
        algo = data.get("algorithm") if isinstance(data, dict) else None
        if isinstance(algo, dict):
            unknown = sorted(set(algo) - {"class", "options"})
            if unknown or not isinstance(algo.get("class"), str):
                raise PydanticCustomError(
                    "bad_class", "algorithm: a sampler class is written {class: pkg.mod.Class, options: {...}}, "
                    "but got {value}", {"value": algo})
            data = {**data, "algorithm": algo["class"], "sampler_options": algo.get("options") or {}}
        return data

    @model_validator(mode="after")
    def _check(self) -> SearchSpec:
        if self.algorithm not in SAMPLERS and is_class_path(self.algorithm):
            check_class(self.algorithm, self.sampler_options, "optuna.samplers:BaseSampler", "sampler_options")
        else:
            _checked_name(SAMPLERS, self.algorithm, "algorithm")
            full = SAMPLERS.check(self.algorithm, self.sampler_options, at="sampler_options")
            if full != self.sampler_options:
                object.__setattr__(self, "sampler_options", full)
        if self.scheduler.enabled and self.pruner.enabled:
            raise PydanticCustomError(
                "scheduler_and_pruner", "pruner: a scheduler ({s}) decides at rungs which trials go on, and the "
                "pruner '{p}' would stop trials too. Fix: remove search.pruner (or set it to none)",
                {"s": self.scheduler.type, "p": self.pruner.type})
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
    format: str = Field(
        default="replica",
        description="How a checkpoint is laid out and written (hpoflow.registry.CHECKPOINT_FORMATS): replica (every "
                    "rank its whole state; the default), rank0 (the state once, by rank 0), dcp "
                    "(torch.distributed.checkpoint: once, split over the ranks; the default, and the only format, "
                    "of fsdp and zero1, whose state is sharded), safetensors.")
    options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the format (dcp: async_save, thread_count); once validated: "
                                          "all of them.")

    @model_validator(mode="after")
    def _check_format(self) -> CheckpointSpec:
        _check_plugin(self, CHECKPOINT_FORMATS, "format", "options")
        return self

    @property
    def shared_state(self) -> bool:
        """The format keeps one copy of the state for every rank (it needs the same state on each)."""
        return bool(getattr(CHECKPOINT_FORMATS.options_model(self.format), "shared_state", False))

    @property
    def sharded_state(self) -> bool:
        """The format keeps a state sharded over the ranks (fsdp's and zero1's model and optimizer)."""
        return bool(getattr(CHECKPOINT_FORMATS.options_model(self.format), "sharded_state", False))


METRIC_STEP_GROUPS = ("epoch", "step")  # the named groups of a training.metrics pattern that give the step


def metric_pattern_problem(pattern: str, metrics: Sequence[str] | None = None) -> str:
    """Why ``pattern`` cannot be a ``training.metrics`` pattern ('' when it can): it does not compile, it
    has no named group, or (given the study's ``metrics``) none of its named groups is a metric of the
    study, ``step`` or ``epoch``; the rule and the fix."""
    try:
        compiled = re.compile(pattern)
    except (re.error, RecursionError, OverflowError) as exc:
        return (f"'{pattern}' is not a Python regular expression: {exc}. Fix: correct it; a pattern is a Python "
                r"regex with named groups, e.g. 'valid loss\s+(?P<val_loss>[-+.\deE]+)'")
    groups = list(compiled.groupindex)
    if not groups:
        return (f"'{pattern}' has no named group, and a pattern reports only through its named groups: one named "
                "after a metric of the study holds that metric's value, one named step or epoch the step. Fix: "
                r"name the group, e.g. (?P<val_loss>[-+.\deE]+)")
    if metrics is None:
        return ""
    known = [*metrics, *METRIC_STEP_GROUPS]
    if any(g in known for g in groups):
        return ""
    example = next((m for m in metrics if m.isidentifier()), "val_loss")
    which = (f"the groups {', '.join(groups)}, none of which is" if len(groups) > 1
             else f"the group {groups[0]}, which is not")
    return (f"'{pattern}' names {which} "
            f"a metric of the study ({', '.join(metrics)}), step or epoch{did_you_mean(groups[0], known)}. Fix: "
            f"name a group after the metric it holds, e.g. (?P<{example}>...)")


def _metric_pattern(pattern: str) -> str:
    why = metric_pattern_problem(pattern)
    if why:
        raise PydanticCustomError("metric_pattern", "{why}", {"why": why})
    return pattern


class TrainConfig(_Strict):
    """What one trial trains, after every ``${param}`` has been replaced by its value.

    With ``function`` set, the user's function trains and receives this config (``options`` is
    free-form for it); with ``command``, the user's program runs as each rank (``hpoflow.train.command``);
    otherwise the built-in trainer trains ``model`` on ``dataset``.
    """

    function: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    command: list[str] | None = Field(
        default=None, description="Your own program as each rank of a trial, with torchrun's environment: an argv "
        "list (or one line, split like a shell splits it but never run by one); any argument may hold ${param} "
        "placeholders. python means the interpreter hpoflow runs in.")
    workdir: str = Field(
        default="${trial_dir}", min_length=1, description="Where a command trial's program runs: its trial "
        "directory (${trial_dir}, the default: files it writes under fixed names are the trial's own), '.' for the "
        "directory hpoflow runs in, or another path (relative to that directory; may hold ${trial_dir}). "
        "Arguments naming existing files there are made absolute, so relative input paths keep working.")
    isolate: bool = Field(
        default=False, description="A command python SCRIPT or python -m MODULE runs warm: in a process forked "
        "from the engine's worker, which has torch imported already (runpy, sys.argv set). true: a fresh "
        "interpreter every time, as for any other program.")
    stop_grace_s: float = Field(
        default=30.0, ge=0, description="A command trial pruned, paused or at its last epoch: seconds it has to "
        "exit by itself (hpoflow.client.should_stop() is true) before SIGTERM, then SIGKILL, on every rank.")
    metrics: list[Annotated[str, AfterValidator(_metric_pattern)]] = Field(
        default_factory=list, description="A command trial's own print format: Python regexes read on each line "
        "of rank 0's stdout before NAME=VALUE pairs are (as Katib's metrics-collector filters). A named group "
        "named after a metric of the study holds its value, one named step or epoch the step: e.g. 'end of "
        r"epoch\s+(?P<epoch>\d+).*valid loss\s+(?P<val_loss>[-+.\deE]+)'.")
    model: str = "cnn"
    model_options: dict[str, Any] = Field(default_factory=dict)
    dataset: Literal["digits", "synthetic", "chars"] = "digits"
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
    strategy: str = Field(
        default="allreduce", description="How the ranks of a trial combine their work (hpoflow.registry.STRATEGIES).")
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
    # -- precision (hpoflow.train.precision) ------------------------------------------------------
    precision: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32", description="fp32, or mixed precision: bf16 or fp16 autocast on the rank's device (fp16 "
                                    "with a loss scaler); weights, gradients and optimizer state stay fp32.")
    schedule: dict[str, list[tuple[int, float]]] = Field(
        default_factory=dict,
        description="Values of lr, momentum, weight_decay by epoch, each applied from the start of its epoch: "
                    "{lr: [[0, 0.1], [4, 0.05]]} (epochs increasing from 0); what best.yaml of a PBT study "
                    "replays (docs/schedulers.md). Built-in trainer.")
    # -- checkpoints (hpoflow.train.checkpoint; docs/checkpointing.md) ---------------------------
    checkpoint: CheckpointSpec = Field(
        default_factory=CheckpointSpec,
        description="Periodic checkpoints a trial resumes from after a crash: every, keep, async, format, options.")

    @model_validator(mode="before")
    @classmethod
    def _command_argv(cls, data: Any) -> Any:
        """``command`` as an argv (a string split with shlex); a command trial without ``epochs`` has no
        step limit (``UNBOUNDED_EPOCHS``: its program ends itself)."""
        if isinstance(data, dict) and data.get("command") is not None:
            data = {**data, "command": command_argv(data["command"])}
            data.setdefault("epochs", UNBOUNDED_EPOCHS)
        return data

    @property
    def builtin(self) -> bool:
        """The built-in trainer trains (neither ``function`` nor ``command`` is set)."""
        return self.function is None and self.command is None

    @model_validator(mode="after")
    def _check_metric_patterns(self) -> TrainConfig:
        if self.metrics and self.command is None:
            raise PydanticCustomError(
                "metrics_without_command", "{at}: patterns read the lines a command trial's program prints, but "
                "training.command is not set{what}. Fix: remove metrics, or run your program with command",
                {"at": "metrics", "what": " (a training.function returns or reports its metrics itself)"
                 if self.function is not None else " (the built-in trainer reports its metrics itself)"})
        return self

    @field_validator("schedule")
    @classmethod
    def _check_schedule(cls, v: dict[str, list[tuple[int, float]]]) -> dict[str, list[tuple[int, float]]]:
        for key, points in v.items():
            if key not in SCHEDULABLE:
                raise PydanticCustomError(
                    "schedule_key", "the built-in trainer changes only {ok} between epochs, but got '{k}'. Fix: "
                    "schedule one of those", {"k": key, "ok": ", ".join(SCHEDULABLE)})
            epochs = [e for e, _ in points]
            if not points or epochs[0] != 0 or any(b <= a for a, b in itertools.pairwise(epochs)):
                raise PydanticCustomError(
                    "schedule_epochs", "{k} is a list of [epoch, value] with epochs increasing from 0, but got epochs "
                    "{e}. Fix: start at [0, value] and increase", {"k": key, "e": epochs})
            bad = [x for _, x in points if not math.isfinite(x) or x < 0 or (key == "lr" and x == 0)
                   or (key == "momentum" and x >= 1)]
            if bad:
                rule = {"lr": "> 0", "momentum": "in [0, 1)"}.get(key, ">= 0")
                raise PydanticCustomError("schedule_value", "every value of {k} must be {r}, but got {b}. Fix: "
                                          "correct it", {"k": key, "r": rule, "b": bad[0]})
        return v

    @model_validator(mode="after")
    def _check_plugins(self) -> TrainConfig:
        if self.function is not None and self.command is not None:
            raise PydanticCustomError(
                "function_and_command", "{at}: give either function (module:function) or command (your program), "
                "but both are set. Fix: remove one of them", {"at": "command"})
        if self.command is None and self.isolate:
            raise PydanticCustomError(
                "isolate_without_command", "{at}: true starts a command's program in a fresh interpreter, but "
                "training.command is not set: a function or the built-in trainer runs in the engine's worker either "
                "way. Fix: remove isolate", {"at": "isolate"})
        if self.command is None and self.workdir != "${trial_dir}":
            raise PydanticCustomError(
                "workdir_without_command", "{at}: {w} is where a command's program runs, but training.command is "
                "not set (a function runs where hpoflow runs and writes its own files under ctx.trial_dir). Fix: "
                "remove workdir", {"at": "workdir", "w": repr(self.workdir)})
        if self.builtin:
            _checked_name(MODELS, self.model, "model")
            full_model = MODELS.check(self.model, self.model_options, at="model_options")
            if full_model != self.model_options:
                object.__setattr__(self, "model_options", full_model)
        _checked_name(STRATEGIES, self.strategy, "strategy")
        raw = dict(self.strategy_options)
        # One mapping per strategy name (a searched strategy): check each, keep the active one's.
        per_strategy = bool(raw) and all(k in STRATEGIES and isinstance(v, dict) for k, v in raw.items())
        if per_strategy:
            for name, sub in raw.items():
                if name != self.strategy:
                    STRATEGIES.check(name, sub, at=f"strategy_options.{name}")
            chosen = STRATEGIES.check(self.strategy, raw.get(self.strategy, {}),
                                      at=f"strategy_options.{self.strategy}")
        else:
            chosen = STRATEGIES.check(self.strategy, raw, at="strategy_options")
        if self.strategy == "easgd" and chosen.get("momentum") and self.optimizer != "sgd":
            raise PydanticCustomError(
                "bad_strategy_option",
                "strategy_options.momentum: true (momentum EASGD) puts Nesterov momentum on each "
                "worker's SGD step, so it needs optimizer: sgd, but got optimizer: {opt}. Fix: set "
                "optimizer: sgd or momentum: false", {"opt": self.optimizer})
        if chosen != self.strategy_options:
            object.__setattr__(self, "strategy_options", chosen)  # frozen: normalise once, here
        self._check_precision(chosen)
        sharded = bool(getattr(STRATEGIES.options_model(self.strategy), "sharded", False))
        if self.builtin and sharded:
            self._sharded_checkpoints()
        elif self.builtin and self.strategy != "allreduce" and self.checkpoint.shared_state:
            raise PydanticCustomError(
                "checkpoint_format",
                "{at}: {fmt} keeps one copy of the state for every rank, which holds only where every "
                "rank has the same model and optimizer (strategy allreduce), but the strategy is '{s}', whose ranks "
                "hold state of their own. Fix: use format replica or safetensors, or strategy allreduce",
                {"at": "checkpoint.format", "fmt": self.checkpoint.format, "s": self.strategy})
        return self

    def settings(self) -> dict[str, Any]:
        """What this config sets, as JSON: every value that differs from its default, down to the options
        of its model, strategy and checkpoint format. Writing a default out or leaving it out gives the
        same settings, and so does a field that a later hpoflow adds at its default."""
        data = self.model_dump(mode="json", exclude_defaults=True)
        options: list[tuple[str, dict[str, Any], Registry[Any], str]] = (
            [("model_options", data, MODELS, self.model)] if self.function is None else [])
        options.append(("strategy_options", data, STRATEGIES, self.strategy))
        if "checkpoint" in data:
            options.append(("options", data["checkpoint"], CHECKPOINT_FORMATS, self.checkpoint.format))
        for key, where, registry, name in options:
            if key in where:
                where[key] = _non_default(registry, name, where[key])
                if not where[key]:
                    del where[key]
        if data.get("checkpoint") == {}:
            del data["checkpoint"]
        return data

    def _sharded_checkpoints(self) -> None:
        """fsdp and zero1 keep their model and optimizer sharded over the ranks: they checkpoint through a
        format that writes sharded state, ``dcp`` unless another such format is named."""
        if "format" not in self.checkpoint.model_fields_set:
            checkpoint = CheckpointSpec.model_validate({**self.checkpoint.model_dump(by_alias=True), "format": "dcp",
                                                        "options": {}})
            object.__setattr__(self, "checkpoint", checkpoint)
        elif not self.checkpoint.sharded_state:
            raise PydanticCustomError(
                "checkpoint_format",
                "{at}: {fmt} keeps each rank's state whole, but {s} keeps its model and optimizer sharded over the "
                "ranks, which only a format that writes sharded state keeps (dcp: torch.distributed.checkpoint, "
                "which also resumes them on another number of ranks). Fix: use format: dcp (their default), or "
                "leave format out",
                {"at": "checkpoint.format", "fmt": self.checkpoint.format, "s": self.strategy})

    def _check_precision(self, chosen: dict[str, Any]) -> None:
        """Precision against the strategy: fp16's loss scaler must decide alike on every rank."""
        if self.precision == "fp16" and self.strategy == "parameter_server":
            raise PydanticCustomError(
                "bad_precision", "precision: fp16 needs a loss scaler whose scale every rank keeps alike, but "
                "parameter_server's workers never step (their scale would stay while their server's moves). "
                "Fix: use precision: bf16 (no scaler), or another strategy")
        if self.strategy == "fsdp" and chosen.get("mixed_precision") == "fp16" and self.precision != "fp16":
            raise PydanticCustomError(
                "bad_precision", "strategy_options.mixed_precision: fp16 computes the gradients in fp16, "
                "which needs a loss scaler, but precision is {p}. Fix: set precision: fp16 (it adds the scaler), "
                "or mixed_precision: bf16", {"p": self.precision})
        if self.strategy == "fsdp" and self.lars:
            raise PydanticCustomError(
                "bad_strategy_option", "lars: true rescales each gradient by its whole weight's norm, but fsdp "
                "holds only a shard of each weight on a rank. Fix: set lars: false, or use allreduce or zero1")


class ElasticRange(_Strict):
    """An elastic trial's sizes (``resources.processes: {min: 1, max: 8}``): it starts with ``min``
    ranks, may grow up to ``max`` onto idle slots at an epoch boundary and shrinks back when a new
    trial needs them; ``policy`` (a registered elastic policy) picks which trial grows first."""

    min: int = Field(default=1, ge=1)
    max: int = Field(ge=1)
    policy: str = "longest_remaining"

    @model_validator(mode="after")
    def _ordered(self) -> ElasticRange:
        if self.max < self.min:
            raise PydanticCustomError("bad_range", "max ({max}) must be >= min ({min}). Fix: swap them",
                                      {"max": self.max, "min": self.min})
        if self.policy not in ELASTIC:
            raise PydanticCustomError("unknown_plugin", "policy: {msg}", {"msg": ELASTIC.unknown(self.policy)})
        return self


class ResourcesSpec(_Strict):
    processes: int = Field(default=1, ge=1, description="DDP world size of one trial; {min, max} (and an "
                           "optional policy) makes the trial elastic: it starts with min ranks and grows "
                           "onto idle slots up to max (docs/elastic.md).")
    elastic: ElasticRange | None = Field(
        default=None, description="Set from processes: {min, max}: the elastic sizes and policy.")
    cpus_per_process: int = Field(default=1, ge=1)
    gpus_per_process: int | float = Field(
        default=0, description="GPUs per rank: 0 (CPU ranks), a whole number, or a share 1/k of one GPU (0.5, "
                               "0.25, ...: k ranks of different trials share the GPU, each capped to its share; "
                               "the ranks of one trial are on different GPUs). The local engine, and the slurm "
                               "engine's node agents (a step per trial and the compss engine refuse a share: they "
                               "give whole GPUs); MIG instances are never shared.")
    nodes: int = Field(default=1, ge=1, description="Nodes one trial spans (compss and slurm engines).")
    memory_gb: float | None = Field(
        default=None, gt=0, description="Host memory per rank in GB. The slurm engine asks each step for it "
                                        "(--mem: this x ranks per node) and counts it against the allocation's "
                                        "memory; unset, each rank gets its CPUs' or its GPUs' share of the "
                                        "node's allocated memory, whichever is larger.")
    timeout: float | None = Field(default=None, gt=0, description="Seconds before a trial is killed.")
    max_retries: int = Field(
        default=2, ge=0, description="Reruns of a trial killed by the system (signal, lost rank or node, "
                                     "timeout), from its last checkpoint; never for errors in user code.")

    @model_validator(mode="before")
    @classmethod
    def _elastic_processes(cls, data: Any) -> Any:
        """``processes: {min, max, policy}`` -> ``processes: min`` and ``elastic``."""
        if isinstance(data, dict) and isinstance(data.get("processes"), dict):
            if "elastic" in data:
                raise PydanticCustomError("elastic_twice", "give the elastic range once, as processes: {min, "
                                          "max}, not also elastic:", {})
            try:
                rng = ElasticRange.model_validate(data["processes"])
            except ValidationError as exc:
                err = exc.errors(include_url=False)[0]
                at = ".".join(["processes", *(str(x) for x in err["loc"])])
                raise PydanticCustomError("elastic_range", "{at}: {msg}. An elastic trial reads processes: {min: 1, "
                                          "max: 8} (optional policy)", {"at": at, "msg": err["msg"]}) from None
            data = {**data, "processes": rng.min, "elastic": rng}
        return data

    @field_validator("gpus_per_process")
    @classmethod
    def _check_gpus(cls, v: int | float) -> int | float:
        why = share_error(v)
        if why:
            k = round(1 / v) if 0 < v < 1 else 0
            fix = (f"use 1/{k} = {1 / k:.4g}, or a whole number" if 1 < k <= 64
                   else "use 0, a whole number, or a share 0.5, 0.25, 0.125, ... (at least 1/64)")
            raise PydanticCustomError("bad_gpus", "gpus_per_process {why}, but got {v}. Fix: {fix}",
                                      {"why": why, "v": v, "fix": fix})
        return int(v) if float(v).is_integer() else v

    @model_validator(mode="after")
    def _elastic_matches(self) -> ResourcesSpec:
        if self.elastic is not None and self.elastic.min != self.processes:
            raise PydanticCustomError("elastic_min", "processes ({p}) must equal elastic.min ({m}). Fix: write "
                                      "processes: {min: {m}, max: {x}}",
                                      {"p": self.processes, "m": self.elastic.min, "x": self.elastic.max})
        return self

    def elastic_sizes(self, batch_size: int | None) -> tuple[int, ...]:
        """The numbers of ranks an elastic trial may run with: ``min .. max``, multiples of ``nodes``,
        and, for the built-in trainer (``batch_size`` given), dividing the global batch
        ``batch_size x min`` so every size trains with the same global batch. ``()``: not elastic."""
        if self.elastic is None:
            return ()
        lo, hi = self.elastic.min, self.elastic.max
        sizes = tuple(k for k in range(lo, hi + 1) if k % self.nodes == 0
                      and (batch_size is None or (batch_size * lo) % k == 0))
        return sizes if len(sizes) > 1 else ()


class TrackingSpec(_Strict):
    """Optional logging of every trial to the tracking tools a group uses (their own clients; each an
    optional extra): ``mlflow``, true (a local store, ``sqlite:///RUN_DIR/mlflow.db``) or a tracking URI
    (``sqlite:///path.db``, ``http://host:5000``, ...; one MLflow run per trial in ``experiment``, default
    the study name); ``tensorboard``, true (``RUN_DIR/tensorboard``) or a directory (one event directory
    per trial)."""

    mlflow: bool | str | None = None
    experiment: str | None = Field(default=None, min_length=1)
    tensorboard: bool | str = False

    @model_validator(mode="after")
    def _installed(self) -> TrackingSpec:
        import importlib.util

        if self.mlflow not in (None, False, "") and importlib.util.find_spec("mlflow") is None:
            raise PydanticCustomError("missing_extra", "tracking.mlflow needs MLflow, which is not installed. Fix: "
                                      "pip install 'hpoflow[mlflow]' (or mlflow-skinny)", {})
        if self.tensorboard not in (False, "") and importlib.util.find_spec("tensorboardX") is None:
            raise PydanticCustomError("missing_extra", "tracking.tensorboard needs tensorboardX, which is not "
                                      "installed. Fix: pip install 'hpoflow[tensorboard]' (or tensorboardX)", {})
        return self


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
    engine: str = Field(default="local", description="A registered engine: local, compss, ...")
    storage: str | None = Field(
        default=None, description="An Optuna storage URL or a journal file path (default: study.journal in the "
                                  "run directory); not an in-memory database (sqlite://), which keeps nothing. A "
                                  "URL with a password belongs in storage_env; a password written here is redacted "
                                  "from everything hpoflow writes or prints.")
    storage_env: str | None = Field(
        default=None, pattern=r"^[A-Za-z_][A-Za-z0-9_]*$",
        description="Name of an environment variable holding the storage URL (keeps it out of the spec; the "
                    "way to give a URL with a password). The run takes it out of its environment before any "
                    "trial process starts, so trial code never sees it.")
    storage_retry_s: float = Field(
        default=60.0, ge=0, le=86400,
        description="Seconds a run waits out a storage outage (a database that refuses or drops connections, a "
                    "network file system that stops answering), retrying with backoff; past it the run stops "
                    "cleanly (exit code 1) and a rerun resumes. 0: never wait.")
    compss: dict[str, Any] = Field(default_factory=dict, description="Options of the compss engine.")
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="Options of the engine (for compss: the compss: section).")
    oracle: OracleSpec = Field(default_factory=OracleSpec)
    tracking: TrackingSpec = Field(default_factory=TrackingSpec)
    plugins: list[Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")]] = Field(
        default_factory=list, description="Modules that register plug-ins (hpoflow.registry: engines, samplers, "
        "strategies, models, ...), imported before the spec is validated, in the driver and in every trial "
        "process.")

    @field_validator("storage")
    @classmethod
    def _check_storage(cls, v: str | None) -> str | None:
        why = in_memory_storage(v) if v is not None else None
        if why:
            raise PydanticCustomError(
                "in_memory_storage", "'{url}' is {why}: it lives only inside the driver's process, so nothing is "
                "kept when the run ends: `hpoflow status` and a resume cannot find the study, and no other driver can "
                "share it. Fix: name a database file (sqlite:///study.db is in the run directory) or a journal file, "
                "or leave storage out (the run directory's study.journal)", {"url": v, "why": why})
        return v

    @model_validator(mode="before")
    @classmethod
    def _auto_search(cls, data: Any) -> Any:
        """``search.algorithm: auto``: the benchmark's winning arm (``hpoflow.spec._auto``, docs/search.md);
        ``bohb``: with its default pruner."""
        search = data.get("search") if isinstance(data, dict) else None
        if isinstance(search, dict) and search.get("algorithm") == "auto":
            data = {**data, "search": resolve_auto(search, data.get("training"))}
        elif isinstance(search, dict) and search.get("algorithm") == "bohb":
            data = {**data, "search": resolve_bohb(search, data.get("training"))}
        return data

    @model_validator(mode="before")
    @classmethod
    def _printable_names(cls, data: Any) -> Any:
        """Parameter names reach the terminal table and the CSV header: printable text only."""
        space = data.get("space") if isinstance(data, dict) else None
        for name in space if isinstance(space, dict) else ():
            why = unprintable(str(name))
            if why:
                raise PydanticCustomError("bad_name", "{at}: parameter name {name} {why}",
                                          {"at": f"space.{name}", "name": repr(name), "why": why})
        return data

    @model_validator(mode="after")
    def _check_metric_patterns(self) -> StudySpec:
        """Each ``training.metrics`` pattern reads a metric of the study or a step (one that does not compile:
        ``TrainConfig`` says so at its line)."""
        patterns = self.training.get("metrics")
        if not isinstance(patterns, list):
            return self
        names = list(dict.fromkeys([*(n for n, _ in self.study.objectives),
                                    *(parse_constraint(c)[0] for c in self.study.constraints)]))
        for i, pattern in enumerate(patterns):
            if isinstance(pattern, str) and not metric_pattern_problem(pattern):
                why = metric_pattern_problem(pattern, names)
                if why:
                    raise PydanticCustomError("metric_pattern", "{at}: {why}", {"at": f"training.metrics.{i}",
                                                                               "why": why})
        return self

    @model_validator(mode="after")
    def _check_multi_objective(self) -> StudySpec:
        if not self.study.multi:
            return self
        if self.search.scheduler.enabled:
            raise PydanticCustomError(
                "multi_objective_scheduler", "search.scheduler: a scheduler ranks trials by one value, but "
                "study.metrics has {n} objectives. Fix: remove search.scheduler, or keep one metric",
                {"n": len(self.study.objectives)})
        if self.search.pruner.type != "none":
            raise PydanticCustomError(
                "multi_objective_pruning", "search.pruner: Optuna does not prune trials of a study with several "
                "objectives (study.metrics), but the pruner is '{p}'. Fix: remove the pruner, or keep one metric",
                {"p": self.search.pruner.type})
        if self.search.algorithm in ("cmaes",):
            raise PydanticCustomError(
                "multi_objective_sampler", "search.algorithm: {a} optimises one objective, but study.metrics has "
                "{n}. Fix: use tpe, nsga2, nsga3, gp or random", {"a": self.search.algorithm,
                                                                  "n": len(self.study.objectives)})
        return self

    @model_validator(mode="after")
    def _check_pbt(self) -> StudySpec:
        """``search.scheduler: {type: pbt}`` (docs/schedulers.md): explored hyperparameters are float/int
        parameters of the space; every member trains a fixed ``training.epochs``; with the built-in
        trainer an explored hyperparameter feeds only ``SCHEDULABLE`` keys of ``training`` itself: a member
        resumes from a checkpoint whose fingerprint covers every other value (``model_options`` included,
        at any depth), and ``best.yaml`` replays the changes as a ``training.schedule``, which holds only those."""
        s = self.search.scheduler
        if s.type != "pbt":
            return self
        names = s.options.get("hyperparams") or [k for k, p in self.space.items()
                                                 if isinstance(p, FloatParam | IntParam)]
        for name in names:
            if not isinstance(self.space.get(name), FloatParam | IntParam):
                raise PydanticCustomError(
                    "pbt_hyperparam", "search.scheduler.hyperparams: PBT explores float and int parameters of the "
                    "space, but '{n}' is {what}. Fix: name float/int parameters of space:",
                    {"n": name, "what": "not in the space" if name not in self.space else "categorical"})
        if s.options.get("explore") == "pb2" and importlib.util.find_spec("hpoflow.search.pb2") is None:
            raise PydanticCustomError(
                "pb2_missing", "search.scheduler.explore: pb2 needs hpoflow.search.pb2 (PB2's explore step), which "
                "this installation does not have. Fix: use explore: pbt", {})
        population = int(s.options.get("population", 8))
        if len(self.search.enqueue) > population:
            raise PydanticCustomError(
                "pbt_enqueue", "search.enqueue: with PBT the known configurations are roots of the population, "
                "at most population ({p}), but got {n}. Fix: enqueue at most {p}, or raise population",
                {"p": population, "n": len(self.search.enqueue)})
        epochs = self.training.get("epochs", 10)
        if not isinstance(epochs, int) or isinstance(epochs, bool):
            raise PydanticCustomError(
                "pbt_epochs", "training.epochs: PBT trains every member a fixed number of epochs, but got {e}. Fix: "
                "write a whole number", {"e": epochs})
        if self.training.get("function") or self.training.get("command") is not None:
            return self  # the user's code decides what a resume may change
        for path, name in placeholders(self.training):
            if name in names and not (len(path) == 1 and path[0] in SCHEDULABLE):
                raise PydanticCustomError(
                    "pbt_resume_key", "{at}: PBT changes '{n}' when a member resumes from a checkpoint, and the "
                    "built-in trainer resumes a checkpoint with new values only of training.{ok}. Fix: list "
                    "search.scheduler.hyperparams without '{n}' (each member then keeps its value)",
                    {"at": ".".join(str(k) for k in ("training", *path)), "n": name,
                     "ok": ", training.".join(SCHEDULABLE)})
        return self

    @model_validator(mode="after")
    def _check_elastic(self) -> StudySpec:
        """An elastic built-in trial resumes its checkpoint on another number of ranks, which holds where
        every rank keeps the same state (allreduce: rank 0's goes to every rank) or where the state is
        sharded by name and cut anew for the new number (fsdp, zero1: through dcp)."""
        if self.resources.elastic is None or self.training.get("function"):
            return self
        strategy = self.training.get("strategy", "allreduce")
        if isinstance(strategy, str) and not PLACEHOLDER.match(strategy) and strategy != "allreduce" \
                and not (strategy in STRATEGIES and getattr(STRATEGIES.options_model(strategy), "sharded", False)):
            sharded = [n for n in STRATEGIES.names() if getattr(STRATEGIES.options_model(n), "sharded", False)]
            raise PydanticCustomError(
                "elastic_strategy", "resources.processes: an elastic trial of the built-in trainer needs a strategy "
                "whose checkpoint resumes on any number of ranks: allreduce (every rank holds the same model and "
                "optimizer) or {sh} (sharded by name, cut anew), but the strategy is '{s}'. Fix: use one of those, or "
                "a fixed processes: N", {"s": strategy, "sh": ", ".join(sharded)})
        return self

    @model_validator(mode="after")
    def _check_engine(self) -> StudySpec:
        _checked_name(ENGINES, self.engine, "engine")
        if self.engine == "compss" and self.engine_options and self.compss:
            raise PydanticCustomError(
                "engine_options", "engine_options: the compss engine's options go in the compss: section, "
                "not both. Fix: move them under compss:", {})
        if self.compss:
            ENGINES.check("compss", self.compss, at="compss")
        if self.engine_options:
            ENGINES.check(self.engine, self.engine_options, at="engine_options")
        return self

    def engine_option_values(self) -> dict[str, Any]:
        """The chosen engine's option bag as written (compss: the ``compss:`` section)."""
        if self.engine == "compss" and not self.engine_options:
            return dict(self.compss)
        return dict(self.engine_options)

    def storage_url(self) -> str | None:
        """The storage to open: ``storage_env``'s value when set (``SpecError``-free: a missing variable
        is reported by the caller), else ``storage``. The variable is taken out of the environment and
        kept in memory (``hpoflow.credentials.take_env``): later calls answer from there, and no process
        started afterwards inherits it."""
        from hpoflow.credentials import hold, scrub_environ, take_env

        if self.storage_env:
            return take_env(self.storage_env)
        hold(self.storage)  # a URL with a password written in the spec: no variable holding it is passed on
        scrub_environ()
        return self.storage
