"""The simulated engine's built-in cost models: what a trial would cost, without running it.

Each is a ``COST_MODELS`` entry (``hpoflow.registry``): a factory called with its options model
(``hpoflow.engines.simulated.options``) that returns ``cost(request) -> TrialCost``. ``lognormal``:
synthetic durations and metrics; ``function``: a user's ``module:function``; ``replay``: a recorded run.
The parallelism oracle's model (``oracle``) lives with the oracle (``hpoflow.oracle.simcost``).
"""

from __future__ import annotations

import importlib
import json
import math
import random
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from hpoflow.engines.simulated.options import FunctionCost, LogNormalCostModel, ReplayCost
from hpoflow.errors import EngineError
from hpoflow.train.context import metric_dict, real_number
from hpoflow.trial import TrialRequest

__all__ = ["TrialCost", "function_cost", "lognormal_cost", "replay_cost"]


@dataclass(frozen=True)
class TrialCost:
    """What the cost model says of one trial: its duration on its own slots, final metrics, the study
    metric's value after each epoch (``curve``), and whether it fails. ``epoch_ends``: when each epoch
    ends, in seconds of its work from its start (non-decreasing, the last one ``duration_s``); empty:
    the epochs take equal shares of ``duration_s``."""

    duration_s: float
    metrics: dict[str, float]
    curve: list[dict[str, float]] = field(default_factory=list)
    error: str | None = None
    epoch_ends: list[float] = field(default_factory=list)


def lognormal_cost(options: LogNormalCostModel) -> Callable[[TrialRequest], TrialCost]:
    """Durations log-normal around ``median_s``; the metric a seeded uniform draw in [0, 1) approached
    over ``epochs`` reports; the same for the same seed and trial number."""

    def cost(req: TrialRequest) -> TrialCost:
        rng = random.Random(options.seed * 1_000_003 + req.number)
        duration = options.median_s * math.exp(options.sigma * rng.gauss(0.0, 1.0))
        value = rng.random()
        curve = [{req.metric: value * (1.0 - 0.5 ** (k + 1))} for k in range(options.epochs)]
        return TrialCost(duration, {req.metric: value}, curve)

    return cost


def function_cost(options: FunctionCost) -> Callable[[TrialRequest], TrialCost]:
    """``function(params, number)`` returns ``duration_s``, metrics and optionally ``curve`` (each a
    real number of any type: ``hpoflow.train.context.real_number``)."""
    ref = options.function

    def cost(req: TrialRequest) -> TrialCost:
        for p in reversed(req.python_path):
            if p not in sys.path:
                sys.path.insert(0, p)
        module, _, attr = ref.partition(":")
        fn = getattr(importlib.import_module(module), attr)
        out = fn(dict(req.params), req.number)
        if not isinstance(out, Mapping) or "duration_s" not in out:
            raise TypeError(f"{ref} must return a mapping with duration_s, got {out!r}")
        duration = real_number(out["duration_s"])
        if duration is None or not math.isfinite(duration) or duration < 0:
            raise ValueError(f"{ref} returned duration_s={out['duration_s']!r}; it must be a finite number >= 0")
        metrics = metric_dict({k: v for k, v in out.items() if k not in ("duration_s", "curve")}, strict=False,
                              where=ref)
        curve = []
        for step in out.get("curve") or []:
            if isinstance(step, Mapping):
                curve.append(metric_dict(step, strict=True, where=f"{ref} curve"))
            else:
                value = real_number(step)
                if value is None:
                    raise TypeError(f"{ref}: a curve entry is {step!r}; it must be a real number or a mapping of "
                                    "metrics")
                curve.append({req.metric: value})
        return TrialCost(duration, metrics, curve)

    return cost


def replay_cost(options: ReplayCost) -> Callable[[TrialRequest], TrialCost]:
    """Trial i replays the recorded trial i mod n of ``run_dir`` (its ``trials/*/result.json``, in trial
    order): duration, metrics, and failure; curves are not in those files, so no reports."""
    run_dir = Path(options.run_dir)
    recorded = []
    for p in sorted((run_dir / "trials").glob("*/result.json"), key=lambda p: int(p.parent.name)
                    if p.parent.name.isascii() and p.parent.name.isdigit() else -1):
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if data.get("status") in ("complete", "failed", "pruned") and "duration_s" in (data.get("timings") or {}):
            recorded.append(data)
    if not recorded:
        raise EngineError(f"engine_options.replay: {run_dir} holds no finished trials (trials/*/result.json). "
                          "Fix: point replay at the run directory of a study that ran")

    def cost(req: TrialRequest) -> TrialCost:
        data = recorded[req.number % len(recorded)]
        duration = float(data["timings"]["duration_s"])
        metrics = {k: float(v) for k, v in (data.get("metrics") or {}).items() if isinstance(v, int | float)}
        if data.get("status") == "failed":
            return TrialCost(duration, {}, error=str(data.get("error") or "failed (replayed)"))
        if data.get("status") == "complete" and data.get("value") is not None:
            metrics[req.metric] = float(data["value"])
        return TrialCost(duration, metrics)

    return cost
