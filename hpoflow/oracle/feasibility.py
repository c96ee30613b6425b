"""Feasibility check of one trial before it takes a slot: the driver's hook into the oracle."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.cluster import ClusterSpec, load_cluster
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import model_facts
from hpoflow.oracle.model import Plan, predict
from hpoflow.registry import STRATEGIES, PluginError
from hpoflow.train.data import dataset_info
from hpoflow.trial import Verdict

__all__ = ["Verdict", "check_trial", "strategy_plan"]

_GIB = 2**30


def check_trial(train: Mapping[str, Any], processes: int, gpus_per_process: int,
                cluster: ClusterSpec | None) -> Verdict:
    """Judge a trial of the built-in trainer (keys ``model``, ``model_options``, ``dataset``,
    ``val_fraction``, ``batch_size`` per rank, ``optimizer``, ``momentum``, ``epochs``, ``strategy``,
    ``strategy_options``) on ``processes`` ranks.

    With no cluster, the ``laptop`` preset is used. Infeasible when the memory per device exceeds
    the device's memory. A trial the oracle cannot model (user model without shape, unknown
    dataset) is reported feasible with the reason, so the oracle never blocks what it can't judge.
    """
    spec = cluster or load_cluster(PRESETS["laptop"])
    model = str(train.get("model", "mlp"))
    dataset = str(train.get("dataset", "digits"))
    try:
        shape, classes, samples = dataset_info(dataset, float(train.get("val_fraction", 0.2)))
        strategy = strategy_plan(str(train.get("strategy", "allreduce")), train.get("strategy_options") or {})
    except (ValueError, PluginError) as exc:
        return Verdict(True, f"not checked: {exc}")
    ranks = max(1, processes) * max(1, gpus_per_process)
    try:
        facts = model_facts(model, shape, classes, options=dict(train.get("model_options") or {}))
        plan = Plan(batch_size=int(train.get("batch_size", 32)),
                    devices=min(ranks, spec.total_devices),
                    optimizer=str(train.get("optimizer", "sgd")),
                    momentum=float(train.get("momentum", 0.0)),
                    dataset_size=samples, epochs=float(train.get("epochs", 1)), **strategy)
        pred = predict(facts, spec, plan)
    except OracleError as exc:
        return Verdict(True, f"not checked: {exc}")
    if not pred.fits:
        return Verdict(
            False,
            f"memory per device must fit the device: trial needs "
            f"{pred.memory_per_device_bytes / _GIB:.2f} GiB per device for model {model!r} at "
            f"batch_size {plan.batch_size}, but {spec.device.name} has "
            f"{pred.memory_available_bytes / _GIB:.2f} GiB available; largest batch that fits: "
            f"{pred.max_batch_per_device}",
            pred.to_dict(),
        )
    return Verdict(True, f"fits: {pred.memory_per_device_bytes / _GIB:.3f} GiB of "
                         f"{pred.memory_available_bytes / _GIB:.2f} GiB per device",
                   pred.to_dict())


def strategy_plan(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The oracle's ``Plan`` fields for a training strategy, from its registry entry's options
    model (``oracle_plan()``); ``ValueError`` when the strategy has no oracle model."""
    model = STRATEGIES.options(name, options)
    plan = getattr(model, "oracle_plan", None)
    if plan is None:
        raise ValueError(f"strategy {name!r} has no oracle model (its options model defines no oracle_plan())")
    fields: dict[str, Any] = plan()
    return fields
