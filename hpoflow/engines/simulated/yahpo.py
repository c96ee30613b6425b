"""YAHPO Gym's surrogate benchmarks as a cost model (``cost: {type: yahpo, instance: "167168"}``).

YAHPO Gym (Pfisterer et al., AutoML-Conf 2022) fits a neural network to the learning curves of real
training runs; its LCBench scenario gives, for 7 hyperparameters and 34 OpenML tasks, the validation
and test metrics after each of 52 epochs and the cumulative training time to that epoch. This module
queries that surrogate directly with onnxruntime (``model.onnx``, encoded as ``yahpo-gym`` 1.0.2
encodes it: the instance's integer code as ``x_cat``, the epoch and the hyperparameters in the
scenario's order as ``x_cont``), so neither ``yahpo-gym`` nor ConfigSpace is needed.

A trial's curve is the surrogate at epochs 1..E (E: the trial's ``training.epochs``, at most 52); its
epoch ``k`` ends at the surrogate's cumulative ``time`` at ``k`` (made non-decreasing), so a trial
paused at a rung and resumed is charged only the epochs it trains after it. Every output is a metric
(``val_accuracy``, ``val_cross_entropy``, ...); the study's metric must be one of them.

The data is not part of hpoflow: ``data_path`` is a folder holding ``yahpo-lcbench/`` (``model.onnx``,
``encoding.json``, ``config_space.json``) or that folder itself; default ``$HPOFLOW_BENCHMARKS`` or
``../shared/benchmarks`` beside the working directory or the source tree. ``yahpo_spec`` writes a
study of the benchmark (its space, its metric, its epochs).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.options import YahpoCost
from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest

if TYPE_CHECKING:
    from hpoflow.train.context import TrialContext

__all__ = ["LCBENCH_OUTPUTS", "YahpoSurrogate", "benchmarks_dir", "surrogate", "yahpo_cost", "yahpo_spec",
           "yahpo_trial"]

# the scenario's columns, in the order of its ONNX model's inputs and outputs (yahpo-gym 1.0.2's lcbench config)
LCBENCH_INPUTS = ("epoch", "batch_size", "learning_rate", "momentum", "weight_decay", "num_layers", "max_units",
                  "max_dropout")
LCBENCH_OUTPUTS = ("time", "val_accuracy", "val_cross_entropy", "val_balanced_accuracy", "test_cross_entropy",
                   "test_balanced_accuracy")
_FOLDER = {"lcbench": "yahpo-lcbench"}  # scenario -> its folder under data_path


def benchmarks_dir() -> Path:
    """Where benchmark data is looked for by default: ``$HPOFLOW_BENCHMARKS``, else the first existing
    ``../shared/benchmarks`` beside the working directory or beside hpoflow's source tree (that path
    relative to the working directory when neither exists)."""
    env = os.environ.get("HPOFLOW_BENCHMARKS")
    if env:
        return Path(env).expanduser()
    here = Path(__file__).resolve().parents[3]  # the source tree's root (hpoflow/engines/simulated/yahpo.py)
    for base in (Path.cwd(), here):
        p = base.parent / "shared" / "benchmarks"
        if p.is_dir():
            return p
    return Path("../shared/benchmarks")


@dataclass(frozen=True)
class _Files:
    folder: Path
    encoding: dict[str, int]
    space: dict[str, dict[str, Any]]


def _files(scenario: str, data_path: str | None) -> _Files:
    base = Path(data_path).expanduser() if data_path else benchmarks_dir()
    folder = base if (base / "model.onnx").is_file() else base / _FOLDER[scenario]
    if not (folder / "model.onnx").is_file():
        raise EngineError(f"cost.data_path: no YAHPO {scenario} surrogate at {folder} (model.onnx is missing). Fix: "
                          f"point data_path (or $HPOFLOW_BENCHMARKS) at the folder that holds {_FOLDER[scenario]}/")
    try:
        encoding = json.loads((folder / "encoding.json").read_text())["OpenML_task_id"]
        space = {h["name"]: h for h in json.loads((folder / "config_space.json").read_text())["hyperparameters"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(f"cost.data_path: {folder} does not hold a readable YAHPO {scenario} surrogate "
                          f"({type(exc).__name__}: {exc})") from None
    return _Files(folder, {str(k): int(v) for k, v in encoding.items()}, space)


class YahpoSurrogate:
    """One scenario's surrogate: ``curves(configs, epochs)`` gives each configuration's outputs per epoch."""

    def __init__(self, scenario: str = "lcbench", data_path: str | None = None) -> None:
        try:
            import numpy as np
            import onnxruntime as ort
        except ImportError as exc:
            raise EngineError(f"the yahpo cost model needs onnxruntime ({exc}). Fix: pip install 'hpoflow[benchmarks]'"
                              ) from None
        self._np = np
        files = _files(scenario, data_path)
        self.folder = files.folder
        self.encoding = files.encoding
        self.hyperparameters = {k: v for k, v in files.space.items() if k not in ("OpenML_task_id", "epoch")}
        self.max_epoch = int(files.space.get("epoch", {}).get("upper", 52))
        self.instances = sorted(k for k in self.encoding if k != "#na#")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 1  # a query is ~0.4 ms: threads would only contend with the driver
        opts.inter_op_num_threads = 1
        self._session = ort.InferenceSession(str(self.folder / "model.onnx"), sess_options=opts,
                                             providers=["CPUExecutionProvider"])
        self._lock = threading.Lock()

    def code(self, instance: str) -> int:
        if instance not in self.encoding or instance == "#na#":
            raise EngineError(f"cost.instance: {instance!r} is not an instance of this surrogate; use one of: "
                              f"{', '.join(self.instances)}")
        return self.encoding[instance]

    def curves(self, instance: str, configs: list[dict[str, Any]], epochs: int) -> list[list[dict[str, float]]]:
        """For each configuration, its outputs (``LCBENCH_OUTPUTS``) after epochs 1..``epochs``."""
        np = self._np
        code = self.code(instance)
        epochs = max(1, min(int(epochs), self.max_epoch))
        rows: list[list[float]] = []
        for cfg in configs:
            missing = [n for n in LCBENCH_INPUTS[1:] if n not in cfg]
            if missing:
                raise EngineError(f"the yahpo cost model needs the benchmark's hyperparameters; missing: "
                                  f"{', '.join(missing)} (the space of hpoflow.engines.simulated.yahpo.yahpo_spec)")
            values = [float(cfg[n]) for n in LCBENCH_INPUTS[1:]]
            rows.extend([float(e), *values] for e in range(1, epochs + 1))
        x_cont = np.asarray(rows, dtype=np.float32)
        x_cat = np.full((len(rows), 1), code, dtype=np.int32)
        with self._lock:
            out = self._session.run(None, {"x_cat": x_cat, "x_cont": x_cont})[0]
        result = []
        for i in range(len(configs)):
            block = out[i * epochs:(i + 1) * epochs]
            result.append([{name: float(v) for name, v in zip(LCBENCH_OUTPUTS, row, strict=True)} for row in block])
        return result


@lru_cache(maxsize=8)
def surrogate(scenario: str = "lcbench", data_path: str | None = None) -> YahpoSurrogate:
    """The scenario's surrogate, loaded once per process."""
    return YahpoSurrogate(scenario, data_path)


def yahpo_cost(options: YahpoCost) -> Callable[[TrialRequest], TrialCost]:
    """The ``COST_MODELS`` entry: each trial's curve and epoch end times from the surrogate (see the module
    docstring). The same configuration always costs the same (the model is deterministic)."""
    sur = surrogate(options.scenario, options.data_path)
    sur.code(options.instance)  # an unknown instance is refused before the study starts

    fidelities = options.fidelities

    @lru_cache(maxsize=4096)  # a resumed (promoted) trial asks again for the same curve
    def one(key: tuple[tuple[str, Any], ...], epochs: int) -> TrialCost:
        if fidelities:  # one evaluation a fidelity, each trained from scratch: its time adds up
            full = sur.curves(options.instance, [dict(key)], fidelities[-1])[0]
            curve = [full[min(f, len(full)) - 1] for f in fidelities[:epochs]]
            spent = [sum(r["time"] for r in curve[:k + 1]) for k in range(len(curve))]
        else:
            curve = sur.curves(options.instance, [dict(key)], epochs)[0]
            spent = [row["time"] for row in curve]
        ends, last = [], 0.0
        for t in spent:
            last = max(last, t, 1e-6 + last)
            ends.append(last)
        metrics = [{k: v for k, v in row.items() if k != "time"} for row in curve]
        return TrialCost(ends[-1], dict(metrics[-1]), metrics, epoch_ends=ends)

    def cost(req: TrialRequest) -> TrialCost:
        epochs = int(req.train.get("epochs") or (len(fidelities) if fidelities else sur.max_epoch))
        made = one(tuple(sorted((k, v) for k, v in req.params.items() if k in LCBENCH_INPUTS)), epochs)
        if req.metric not in made.metrics:
            raise EngineError(f"study.metric {req.metric!r} is not an output of the YAHPO surrogate; use one of: "
                              f"{', '.join(n for n in LCBENCH_OUTPUTS if n != 'time')}")
        return made

    return cost


def yahpo_trial(ctx: TrialContext) -> dict[str, float]:
    """The training function of ``yahpo_spec``'s studies (``training.options``: ``YahpoCost``'s): on an engine
    that runs it, it reports the surrogate's metrics after each epoch (so pruners judge them) and returns the
    last epoch's, at once. The simulated engine never calls it (the cost model answers)."""
    opts = YahpoCost.model_validate(dict(ctx.options))
    sur = surrogate(opts.scenario, opts.data_path)
    if opts.fidelities:
        full = sur.curves(opts.instance, [dict(ctx.params)], opts.fidelities[-1])[0]
        curve = [full[min(f, len(full)) - 1] for f in opts.fidelities[:int(ctx.config.epochs or len(opts.fidelities))]]
    else:
        curve = sur.curves(opts.instance, [dict(ctx.params)], int(ctx.config.epochs or sur.max_epoch))[0]
    metrics: dict[str, float] = {}
    for epoch, row in enumerate(curve, 1):
        metrics = {k: v for k, v in row.items() if k != "time"}
        if epoch < len(curve):
            ctx.report(epoch, **metrics)
    return metrics


def yahpo_spec(instance: str, *, scenario: str = "lcbench", data_path: str | None = None,
               metric: str = "val_accuracy", epochs: int | None = None, search: dict[str, Any] | None = None,
               slots: int = 1, name: str | None = None, fidelities: list[int] | None = None) -> dict[str, Any]:
    """A study of the benchmark, in the YAML layout: the surrogate's search space (every hyperparameter,
    with its range and log scale), ``metric`` (maximized unless it is a cross-entropy), ``epochs`` (default:
    the scenario's most, 52), the simulated engine on ``slots`` slots with this cost model, and ``search``.
    ``fidelities``: evaluate each trial at these epochs instead, each from scratch (``YahpoCost``); the
    trial's steps are then the evaluations (``training.epochs`` = how many)."""
    sur = surrogate(scenario, data_path)
    sur.code(str(instance))
    space: dict[str, Any] = {}
    for n in LCBENCH_INPUTS[1:]:
        h = sur.hyperparameters[n]
        kind = "int" if "int" in str(h.get("type")) else "float"
        low, high = h["lower"], h["upper"]
        if kind == "float":  # config_space.json's bounds carry float noise (0.00010000000000000009)
            low, high = float(f"{low:.12g}"), float(f"{high:.12g}")
        space[n] = {"type": kind, "low": low, "high": high, **({"log": True} if h.get("log") else {})}
    cost: dict[str, Any] = {"type": "yahpo", "scenario": scenario, "instance": str(instance)}
    if data_path:
        cost["data_path"] = data_path
    e = sur.max_epoch if epochs is None else max(1, min(int(epochs), sur.max_epoch))
    if fidelities:
        cost["fidelities"] = [int(f) for f in fidelities]
        e = len(fidelities)
    direction = "minimize" if "entropy" in metric else "maximize"
    return {"study": {"name": name or f"yahpo-{scenario}-{instance}", "metric": metric, "direction": direction},
            "space": space, "search": dict(search or {"algorithm": "tpe", "n_trials": 100}),
            "training": {"function": f"{__name__}:yahpo_trial", "epochs": e,
                         "options": {k: v for k, v in cost.items() if k != "type"}},
            "oracle": {"enabled": False},
            "engine": "simulated", "engine_options": {"slots": slots, "cost": cost}}

