"""The ``oracle`` cost model of the simulated engine: how long each trial would take on a cluster.

``engine_options: {cost: {type: oracle, cluster: p100-cluster}}`` gives each simulated trial the
parallelism oracle's predicted time to train its training config (model, data set, batch, epochs,
strategy) on its ``resources.processes`` devices of that cluster (a preset or a cluster YAML; default
the laptop preset). The oracle predicts time, not accuracy: the metric is a seeded synthetic draw
approached over the epochs, as the lognormal model's. A trial the oracle cannot judge (a user
``training.function``, a plan that does not fit) fails in the simulation with the oracle's reason,
as the precheck would have pruned it. Predictions are cached per distinct (config, processes, GPUs).

Imports torch (the oracle traces a step on the meta device): in the driver process, once.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from pydantic import Field

from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.oracle.cluster import ClusterSpec, load_cluster
from hpoflow.oracle.feasibility import check_trial
from hpoflow.oracle.precheck import judged
from hpoflow.registry import Options
from hpoflow.trial import TrialRequest

__all__ = ["OracleCostOptions", "oracle_cost"]

class OracleCostOptions(Options):
    """``cluster``: a preset name or a cluster YAML (default: laptop); ``seed``: of the synthetic metric."""

    cluster: str | None = None
    seed: int = 0
    epochs: int | None = Field(default=None, ge=1, description="reports per trial (default: training.epochs)")


def oracle_cost(options: OracleCostOptions) -> Callable[[TrialRequest], TrialCost]:
    cluster: ClusterSpec | None = load_cluster(options.cluster) if options.cluster else None
    cache: dict[str, tuple[float | None, str]] = {}

    def cost(req: TrialRequest) -> TrialCost:
        if req.train.get("function") or req.train.get("command") is not None:
            return TrialCost(0.0, {}, error="cost model oracle: a training.function or training.command is opaque "
                                            "to the oracle; use the function or lognormal cost model")
        train, key = judged(req)
        if key not in cache:
            verdict = check_trial(train, req.processes, req.gpus_per_process, cluster)
            seconds = verdict.predicted.get("time_to_train_s")
            ok = verdict.feasible and isinstance(seconds, int | float) and math.isfinite(seconds)
            cache[key] = (float(seconds) if ok and seconds is not None else None, verdict.reason)
        seconds, reason = cache[key]
        if seconds is None:
            return TrialCost(0.0, {}, error=f"cost model oracle: {reason}")
        rng = random.Random(options.seed * 1_000_003 + req.number)
        value = rng.random()
        epochs = options.epochs or int(req.train.get("epochs") or 1)
        curve = [{req.metric: value * (1.0 - 0.5 ** (k + 1))} for k in range(epochs)]
        return TrialCost(seconds, {req.metric: value}, curve)

    return cost
