"""Feasibility check of one trial before it takes a slot: the driver's hook into the oracle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.cluster import ClusterSpec, load_cluster
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import model_facts
from hpoflow.oracle.model import Plan, predict
from hpoflow.trial import Verdict

__all__ = ["DATASETS", "Verdict", "check_trial"]

# dataset name -> (input shape per sample, classes, training samples)
DATASETS: dict[str, tuple[tuple[int, ...], int, int]] = {
    "digits": ((1, 8, 8), 10, 1437),
    "mnist": ((1, 28, 28), 10, 60000),
}
_GB = 1e9


def check_trial(train: Mapping[str, Any], processes: int, gpus_per_process: int,
                cluster: ClusterSpec | None) -> Verdict:
    """Judge a trial of the built-in trainer (keys ``model``, ``model_options``, ``dataset``,
    ``batch_size`` per rank, ``optimizer``, ``momentum``, ``epochs``) on ``processes`` ranks.

    With no cluster, the ``laptop`` preset is used. Infeasible when the memory per device exceeds
    the device's memory. A trial the oracle cannot model (user model without shape, unknown
    dataset) is reported feasible with the reason, so the oracle never blocks what it can't judge.
    """
    spec = cluster or load_cluster(PRESETS["laptop"])
    model = str(train.get("model", "mlp"))
    dataset = str(train.get("dataset", "digits"))
    if dataset not in DATASETS:
        return Verdict(True, f"not checked: the oracle knows datasets {', '.join(DATASETS)}, "
                             f"not {dataset!r}")
    shape, classes, samples = DATASETS[dataset]
    ranks = max(1, processes) * max(1, gpus_per_process)
    try:
        facts = model_facts(model, shape, classes, options=dict(train.get("model_options") or {}))
        plan = Plan(batch_size=int(train.get("batch_size", 32)),
                    devices=min(ranks, spec.total_devices),
                    optimizer=str(train.get("optimizer", "sgd")),
                    momentum=float(train.get("momentum", 0.0)),
                    dataset_size=samples, epochs=float(train.get("epochs", 1)))
        pred = predict(facts, spec, plan)
    except OracleError as exc:
        return Verdict(True, f"not checked: {exc}")
    if not pred.fits:
        return Verdict(
            False,
            f"memory per device must fit the device: trial needs "
            f"{pred.memory_per_device_bytes / _GB:.2f} GB per device for model {model!r} at "
            f"batch_size {plan.batch_size}, but {spec.device.name} has "
            f"{pred.memory_available_bytes / _GB:.2f} GB available; largest batch that fits: "
            f"{pred.max_batch_per_device}",
            pred.to_dict(),
        )
    return Verdict(True, f"fits: {pred.memory_per_device_bytes / _GB:.3f} GB of "
                         f"{pred.memory_available_bytes / _GB:.2f} GB per device",
                   pred.to_dict())
