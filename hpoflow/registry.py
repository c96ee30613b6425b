"""Plug-in registries: one per kind — engine, sampler, pruner, strategy, launcher, model, elastic
policy, cost model, checkpoint format.

Every entry is a name, an implementation and a pydantic *options model* (the keys its option bag
takes, with types, defaults and rules). The spec validates each option bag of a study
(``search.sampler_options``, ``search.pruner``, ``training.strategy_options``,
``training.model_options``, ``training.checkpoint.options``, the engine's options,
``compss.launcher``) through the registry of its kind when the spec is loaded, so ``hpoflow validate``
rejects a bad option before anything runs.

Implementations and options models may be given as objects or as lazy ``"module:attr"`` references,
resolved on first use: the built-in entries below are references, so validating a spec imports only
the (light, pydantic-only) options modules, never torch or an engine. An options module must stay
light for that reason.

Adding a plug-in is one module plus one registration, from anywhere::

    from hpoflow.registry import ENGINES
    ENGINES.register("mine", MyEngine, MyEngineOptions)   # or "pkg.mod:MyEngine", "pkg.mod:Opts"

A study whose trials run in other processes names that module in its spec (``plugins: [pkg.mod]``),
so the driver and every trial process import it before anything is looked up.

Each registry is typed by what its entries are (``Registry[type[Engine]]``, ``Registry[type[BaseSampler]]``
...), and each kind is built by one factory of its family (``hpoflow.engines.make_engine``,
``hpoflow.search.samplers.make_sampler`` ...), which passes the validated options model on. What each
kind's implementation must be is in the registry's ``contract`` (and docs/architecture.md). The types
named here belong to higher layers and are imported for type checking only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import PydanticCustomError

from hpoflow.errors import HpoflowError, did_you_mean

if TYPE_CHECKING:
    import torch
    from optuna.pruners import BasePruner
    from optuna.samplers import BaseSampler

    from hpoflow.engines.base import Engine
    from hpoflow.engines.cluster.layout import LaunchJob
    from hpoflow.engines.elastic import Candidate
    from hpoflow.engines.simulated.costs import TrialCost
    from hpoflow.train.checkpoint import CheckpointFormat
    from hpoflow.train.strategies import Strategy
    from hpoflow.trial import TrialRequest

__all__ = [
    "CHECKPOINT_FORMATS",
    "COST_MODELS",
    "ELASTIC",
    "ENGINES",
    "LAUNCHERS",
    "MODELS",
    "PRUNERS",
    "SAMPLERS",
    "SCHEDULERS",
    "STRATEGIES",
    "NoOptions",
    "Options",
    "PluginError",
    "Registry",
    "check_class",
    "is_class_path",
    "resolve",
]

T = TypeVar("T")


class PluginError(HpoflowError):
    """An unknown plug-in name, or a registration that breaks its registry's rules."""


class Options(BaseModel):
    """Base of every options model: frozen, unknown keys rejected. ``kwargs()`` is what the family's
    factory passes to the implementation (every option by its name, unless a model says otherwise)."""

    model_config = ConfigDict(frozen=True, extra="forbid", defer_build=True)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments the implementation is built with."""
        return self.model_dump()


class NoOptions(Options):
    """The options model of a plug-in that takes none."""


def resolve(ref: Any) -> Any:
    """``"package.module:attr"`` -> that object (imported now); any other value is returned as is."""
    if not isinstance(ref, str):
        return ref
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise PluginError(f"a plug-in reference must look like 'package.module:attr', but got {ref!r}")
    try:
        obj: Any = importlib.import_module(module)
    except ImportError as exc:
        raise PluginError(f"cannot import {module!r} for plug-in {ref!r}: {exc}") from exc
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"module {module!r} has no attribute {attr!r} (plug-in {ref!r})") from None
    return obj


def is_class_path(name: str) -> bool:
    """``pkg.mod.Class`` or ``pkg.mod:Class`` (a class by import path, not a registered name)."""
    return ":" in name or "." in name.strip(".")


def check_class(path: str, options: Mapping[str, Any], base: str, at: str) -> type:
    """Import the class at ``path`` (``pkg.mod.Class`` or ``pkg.mod:Class``), check it subclasses
    ``base`` (an import path too) and accepts ``options`` as keyword arguments; a
    ``PydanticCustomError`` (with ``at``) says what is wrong."""
    ref = path if ":" in path else ":".join(path.rsplit(".", 1))
    try:
        cls = resolve(ref)
        base_cls = resolve(base)
    except PluginError as exc:
        raise PydanticCustomError("bad_class", "{msg}. Fix: give an importable class, e.g. "
                                  "optuna.samplers.QMCSampler or mypkg.search:MySampler", {"msg": str(exc)}) from None
    if not (isinstance(cls, type) and issubclass(cls, base_cls)):
        raise PydanticCustomError("bad_class", "{path} must be a subclass of {base}, but it is {what}",
                                  {"path": path, "base": base.replace(":", "."), "what": repr(cls)})
    import inspect

    try:
        inspect.signature(cls).bind_partial(**dict(options))
    except TypeError as exc:
        raise PydanticCustomError("bad_plugin_option", "{at}: {msg} ({path} takes: {params})",
                                  {"at": at, "msg": str(exc), "path": path,
                                   "params": ", ".join(inspect.signature(cls).parameters)}) from None
    return cls


def _same(a: Any, b: Any) -> bool:
    """The same implementation: equal, or the same definition imported again (a plug-in module that a
    worker drops from ``sys.modules`` between trials and imports anew)."""
    if a is b or a == b:
        return True
    key = (getattr(a, "__module__", None), getattr(a, "__qualname__", None))
    return key[1] is not None and key == (getattr(b, "__module__", None), getattr(b, "__qualname__", None))


@dataclass
class _Entry:
    impl: Any  # object or "module:attr"
    options: Any  # type[BaseModel] or "module:attr"
    summary: str


class Registry(Generic[T]):
    """Names -> implementations of one plug-in kind, each with its options model."""

    def __init__(self, kind: str, contract: str, plural: str = "") -> None:
        self.kind = kind
        self.plural = plural or f"{kind}s"
        self.contract = contract
        self._entries: dict[str, _Entry] = {}

    def register(self, name: str, impl: T | str, options: type[Options] | str = NoOptions, *,
                 summary: str = "", replace: bool = False) -> None:
        """Add ``name``. ``replace=False`` refuses a name already taken by another implementation."""
        if not isinstance(name, str) or not name.replace("-", "_").replace(".", "_").isidentifier():
            raise PluginError(f"a {self.kind} name must be an identifier (letters, digits, _ - .), got {name!r}")
        old = self._entries.get(name)
        if old is not None and not replace and not _same(old.impl, impl):
            raise PluginError(f"{self.kind} {name!r} is already registered ({old.impl!r}); pass replace=True "
                              "to override it")
        if not isinstance(options, str) and not (isinstance(options, type) and issubclass(options, Options)):
            raise PluginError(f"the options of {self.kind} {name!r} must be a subclass of hpoflow.registry.Options "
                              f"(a pydantic model), got {options!r}")
        self._entries[name] = _Entry(impl, options, summary)

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def _entry(self, name: str) -> _Entry:
        entry = self._entries.get(name)
        if entry is None:
            raise PluginError(self.unknown(name))
        return entry

    def unknown(self, name: object) -> str:
        """The message for a name that is not registered: the valid names and the closest one."""
        return (f"unknown {self.kind} {name!r}{did_you_mean(str(name), self.names())}; valid "
                f"{self.plural}: {', '.join(self.names())}")

    def get(self, name: str) -> T:
        """The implementation (imported on first use)."""
        entry = self._entry(name)
        entry.impl = resolve(entry.impl)
        impl: T = entry.impl
        return impl

    def options_model(self, name: str) -> type[Options]:
        entry = self._entry(name)
        model = resolve(entry.options)
        if not (isinstance(model, type) and issubclass(model, Options)):
            raise PluginError(f"the options of {self.kind} {name!r} must be a subclass of hpoflow.registry.Options, "
                              f"got {model!r}")
        entry.options = model
        return model

    def summary(self, name: str) -> str:
        return self._entry(name).summary

    def options(self, name: str, values: Mapping[str, Any] | None = None) -> Options:
        """``values`` validated by ``name``'s options model (``PluginError`` on the first problem)."""
        try:
            return self.options_model(name).model_validate(dict(values or {}))
        except ValidationError as exc:
            key, msg = self._problem(name, exc)
            raise PluginError(f"{self.kind} {name!r}: option {key or '?'}: {msg}") from None

    def check(self, name: str, values: Mapping[str, Any] | None, at: str) -> dict[str, Any]:
        """For spec validators: ``values`` validated and completed with defaults, or a
        ``PydanticCustomError`` whose ``at`` context is the offending key's path below ``at``."""
        if name not in self._entries:
            raise PydanticCustomError("unknown_plugin", "{msg}", {"msg": self.unknown(name)})
        try:
            model = self.options_model(name).model_validate(dict(values or {}))
        except ValidationError as exc:
            key, msg = self._problem(name, exc)
            path = ".".join(p for p in (at, key) if p)
            raise PydanticCustomError("bad_plugin_option", "{at}: {msg}", {"at": path, "msg": msg}) from None
        return model.model_dump(mode="json", by_alias=True)

    def _problem(self, name: str, exc: ValidationError) -> tuple[str, str]:
        """(key path, message) of the first problem, in the project's words: rule, value, fix."""
        err = exc.errors(include_url=False)[0]
        key = ".".join(str(p) for p in err["loc"])
        kind = str(err.get("type", ""))
        ctx = err.get("ctx") or {}
        if kind == "extra_forbidden":
            model = self.options_model(name)
            valid = [f.alias or n for n, f in model.model_fields.items()]
            listing = f"valid options of {name}: {', '.join(valid)}" if valid else f"{name} takes no options"
            return key, (f"unknown option of {self.kind} '{name}'{did_you_mean(key, valid)}; {listing}. "
                         "Fix: rename or remove it")
        rules = {
            "greater_than_equal": f"must be >= {ctx.get('ge')}", "greater_than": f"must be > {ctx.get('gt')}",
            "less_than": f"must be < {ctx.get('lt')}", "less_than_equal": f"must be <= {ctx.get('le')}",
            "int_type": "must be a whole number", "int_parsing": "must be a whole number",
            "int_from_float": "must be a whole number", "float_type": "must be a number",
            "float_parsing": "must be a number", "bool_type": "must be true or false",
            "bool_parsing": "must be true or false", "literal_error": f"must be one of {ctx.get('expected')}",
            "string_type": "must be a string", "list_type": "must be a list", "dict_type": "must be a mapping",
            "finite_number": "must be a finite number",
        }
        rule = rules.get(kind) or str(err.get("msg", "invalid")).removeprefix("Value error, ")
        if kind.startswith("value_error"):
            return key, f"{rule} ({self.kind} '{name}')"
        return key, f"{rule}, but got {err.get('input')!r} ({self.kind} '{name}')"


ENGINES: Registry[type[Engine]] = Registry(
    "engine", "a subclass of hpoflow.engines.base.Engine, built as cls.from_options(options, run_dir) (options: "
              "its options model) and checked at validate time with cls.check_fit(options, request)")
SAMPLERS: Registry[type[BaseSampler]] = Registry(
    "sampler", "a subclass of optuna.samplers.BaseSampler, built as cls(seed=seed, **options.kwargs()); an "
               "options model that subclasses hpoflow.search.options.SamplerOptions sees the study's concurrency")
PRUNERS: Registry[type[BasePruner]] = Registry(
    "pruner", "a subclass of optuna.pruners.BasePruner, built as cls(**options.kwargs())")
SCHEDULERS: Registry[Callable[[Any, str], Any]] = Registry(
    "scheduler", "a callable (options: its options model, direction: str) -> "
                 "hpoflow.search.schedulers.PromotionScheduler (trials that pause and resume from checkpoints)")
STRATEGIES: Registry[type[Strategy]] = Registry(
    "strategy", "a subclass of hpoflow.train.strategies.Strategy, built as cls(options: dict, env)", "strategies")
LAUNCHERS: Registry[Callable[[LaunchJob], list[list[str]]]] = Registry(
    "launcher", "a callable (job: hpoflow.engines.cluster.layout.LaunchJob) -> list of argv lists, one per "
                "node launcher process")
MODELS: Registry[Callable[..., torch.nn.Module]] = Registry(
    "model", "a callable (input_shape, n_classes, **options) -> torch.nn.Module")
ELASTIC: Registry[Callable[[list[Candidate], str], list[Candidate]]] = Registry(
    "elastic policy", "a callable (candidates: list[hpoflow.engines.elastic.Candidate], direction: str) -> the "
                      "candidates in the order they should grow", "elastic policies")
COST_MODELS: Registry[Callable[[Any], Callable[[TrialRequest], TrialCost]]] = Registry(
    "cost model", "a callable (options: its options model) -> a callable (TrialRequest) -> "
                  "hpoflow.engines.simulated.costs.TrialCost, for the simulated engine's cost: {type: NAME, ...}")
CHECKPOINT_FORMATS: Registry[type[CheckpointFormat]] = Registry(
    "checkpoint format", "a subclass of hpoflow.train.checkpoint.CheckpointFormat, built on every rank as "
                         "cls(directory, rank=, world_size=, keep=, background=, elastic=, options=its options "
                         "model) by hpoflow.train.checkpoint.make_checkpointer; an options model whose "
                         "shared_state is true keeps one copy of the state (the spec then needs strategy allreduce)")

# -- built-in plug-ins: one line each ------------------------------------------------------------
ENGINES.register("local", "hpoflow.engines.local.engine:LocalEngine", "hpoflow.engines.local.options:LocalOptions",
                 summary="warm worker processes on this machine")
ENGINES.register("compss", "hpoflow.engines.compss.engine:CompssEngine", "hpoflow.engines.compss.options:CompssOptions",
                 summary="PyCOMPSs tasks on a cluster")
ENGINES.register("slurm", "hpoflow.engines.slurm.engine:SlurmEngine", "hpoflow.engines.slurm.options:SlurmOptions",
                 summary="SLURM job steps in the driver's allocation, or a batch job per trial")
ENGINES.register("simulated", "hpoflow.engines.simulated.engine:SimulatedEngine",
                 "hpoflow.engines.simulated.options:SimulatedOptions",
                 summary="a virtual clock and a cost model, for planning and driver tests (trains nothing)")
for _name, _opts in [("lognormal", "LogNormalCostModel"), ("function", "FunctionCost"), ("replay", "ReplayCost")]:
    COST_MODELS.register(_name, f"hpoflow.engines.simulated.costs:{_name}_cost",
                         f"hpoflow.engines.simulated.options:{_opts}")
COST_MODELS.register("yahpo", "hpoflow.engines.simulated.yahpo:yahpo_cost",
                     "hpoflow.engines.simulated.options:YahpoCost",
                     summary="YAHPO Gym's surrogate (LCBench): learning curves and epoch times of a published "
                             "benchmark")
COST_MODELS.register("tabular", "hpoflow.engines.simulated.tabular:tabular_cost",
                     "hpoflow.engines.simulated.options:TabularCost",
                     summary="tabular benchmarks (HPOBench MLP, FCNet, NAS-Bench-201): recorded metrics and durations")
COST_MODELS.register("oracle", "hpoflow.oracle.simcost:oracle_cost", "hpoflow.oracle.simcost:OracleCostOptions",
                     summary="durations from the parallelism oracle's time-to-train, a synthetic metric")
for _name in ("longest_remaining", "most_promising", "fifo"):
    ELASTIC.register(_name, f"hpoflow.engines.elastic:{_name}")

# grid: the driver enqueues the grid points itself, a seeded RandomSampler stands behind them; the model-based
# ones read a bounded history (hpoflow.search.models)
for _name, _impl, _opts in [("grid", "optuna.samplers:RandomSampler", "Grid"),
                            ("random", "optuna.samplers:RandomSampler", "Random"),
                            ("tpe", "hpoflow.search.models:tpe", "TPE"), ("gp", "hpoflow.search.models:gp", "GP"),
                            ("cmaes", "optuna.samplers:CmaEsSampler", "CmaEs"),
                            ("nsga2", "optuna.samplers:NSGAIISampler", "NSGAII"),
                            ("nsga3", "optuna.samplers:NSGAIIISampler", "NSGAIII")]:
    SAMPLERS.register(_name, _impl, f"hpoflow.search.options:{_opts}Options")
SAMPLERS.register("bohb", "hpoflow.search.models:bohb", "hpoflow.search.options:BOHBOptions",
                  summary="BOHB's model on Optuna's TPE, fitted at the largest budget with enough reports "
                          "(with a Hyperband pruner or scheduler)")
PRUNERS.register("none", "optuna.pruners:NopPruner", "hpoflow.search.options:NopPrunerOptions")
# Optuna's stopping pruners, answering from an index the driver keeps current (same arguments, same decisions)
for _name, _cls, _opts in [("median", "IndexedMedianPruner", "Median"),
                           ("percentile", "IndexedPercentilePruner", "Percentile"),
                           ("asha", "IndexedSuccessiveHalvingPruner", "Asha"),
                           ("hyperband", "IndexedHyperbandPruner", "Hyperband")]:
    PRUNERS.register(_name, f"hpoflow.search.pruners:{_cls}", f"hpoflow.search.options:{_opts}PrunerOptions")
SCHEDULERS.register("none", "hpoflow.search.schedulers:asha", "hpoflow.search.options:NoSchedulerOptions",
                    summary="no scheduler: trials run to their end")
SCHEDULERS.register("asha", "hpoflow.search.schedulers:asha", "hpoflow.search.options:AshaSchedulerOptions",
                    summary="promotion-type ASHA: pause at rungs, resume the top 1/eta from checkpoints")
SCHEDULERS.register("hyperband", "hpoflow.search.schedulers:hyperband",
                    "hpoflow.search.options:HyperbandSchedulerOptions",
                    summary="promotion-type ASHA in each Hyperband bracket")
SCHEDULERS.register("pbt", "hpoflow.search.pbt:pbt", "hpoflow.search.options:PbtSchedulerOptions",
                    summary="population-based training (PBT or PB2): exploit a top member's checkpoint, explore")
for _name, _cls in [("allreduce", "AllReduce"), ("parameter_server", "ParameterServer"), ("easgd", "EASGD"),
                    ("local_sgd", "LocalSGD"), ("zero1", "ZeRO1"), ("fsdp", "FSDP")]:
    STRATEGIES.register(_name, f"hpoflow.train.strategies:{_cls}", f"hpoflow.train.options:{_cls}Options")
for _name in ("srun", "mpirun", "ssh"):
    LAUNCHERS.register(_name, f"hpoflow.engines.cluster.layout:{_name}_argv")
MODELS.register("mlp", "hpoflow.train.models:mlp", "hpoflow.train.options:MLPOptions")
MODELS.register("cnn", "hpoflow.train.models:cnn", "hpoflow.train.options:CNNOptions")
MODELS.register("gpt", "hpoflow.train.models:gpt", "hpoflow.train.options:GPTOptions")
for _name, _cls, _opts, _summary in [
        ("replica", "Checkpointer", "Replica", "every rank writes its whole state (any strategy)"),
        ("rank0", "Rank0Checkpointer", "Rank0", "rank 0 writes the state once, every rank its RNG states"),
        ("dcp", "DcpCheckpointer", "Dcp", "torch.distributed.checkpoint: written once, split over the ranks, async"),
        ("safetensors", "SafetensorsCheckpointer", "Safetensors", "the replica layout in safetensors files")]:
    CHECKPOINT_FORMATS.register(_name, f"hpoflow.train.checkpoint:{_cls}",
                                f"hpoflow.train.checkpoint.options:{_opts}Options", summary=_summary)
del _name, _cls, _opts, _summary
