"""Feasibility check of one trial before it takes a slot: the driver's hook into the oracle.

:func:`check_trial` is also the stable way for a trainer's tests to ask the oracle what a trial
should cost: ``Verdict.predicted`` holds the whole prediction (``Prediction.to_dict()``), among
it ``memory_per_device_bytes`` (and its breakdown under ``memory``), ``bytes_per_step`` (bytes each
rank sends per step: what the strategies' meter counts), ``step_s`` and ``throughput``.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.cluster import ClusterSpec, load_cluster
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import ModelFacts, model_facts
from hpoflow.oracle.model import Plan, Prediction, predict
from hpoflow.oracle.plan import CHECKPOINTING
from hpoflow.registry import STRATEGIES, PluginError
from hpoflow.spec import shares_per_gpu
from hpoflow.train import data
from hpoflow.trial import Verdict

__all__ = ["Verdict", "check_trial", "strategy_plan"]

_GIB = 2**30


def _dataset(train: Mapping[str, Any]) -> tuple[tuple[int, ...], int, int, bool]:
    """(input shape, classes, training samples, token input) of the trial's built-in data set."""
    name = str(train.get("dataset", "digits"))
    val = float(train.get("val_fraction", 0.2))
    options = train.get("model_options") or {}
    seq = options.get("context") or options.get("sequence_length")
    if seq is not None and "sequence_length" in inspect.signature(data.dataset_info).parameters:
        shape, classes, samples = data.dataset_info(name, val, sequence_length=int(seq))  # type: ignore[call-arg,unused-ignore]
    else:
        shape, classes, samples = data.dataset_info(name, val)
    info = data.DATASETS.get(name)
    return shape, classes, samples, getattr(info, "task", "classify") == "next_token"


def _checkpointing(train: Mapping[str, Any]) -> str:
    value = train.get("activation_checkpointing", "none")
    if value is True:
        return "full"
    if value in (False, None):
        return "none"
    return str(value) if str(value) in CHECKPOINTING else "none"


def check_trial(train: Mapping[str, Any], processes: int, gpus_per_process: float,
                cluster: ClusterSpec | None) -> Verdict:
    """Judge a trial of the built-in trainer (keys ``model``, ``model_options``, ``dataset``,
    ``val_fraction``, ``batch_size`` per rank, ``optimizer``, ``momentum``, ``epochs``, ``strategy``,
    ``strategy_options``, ``precision``, ``activation_checkpointing``) on ``processes`` ranks.

    With no cluster, the ``laptop`` preset is used. Infeasible when the memory per device exceeds
    the device's memory, or, for a rank given a share ``1/k`` of a GPU (``gpus_per_process: 0.25``),
    that share of the device's memory (the cap the rank runs under). A sharded trial (``zero1``,
    ``fsdp``) that fits only because it is sharded is feasible and the reason says so, with what a
    replicated copy would need. A trial the oracle cannot model (user model without shape, unknown
    dataset) is reported feasible with the reason, so the oracle never blocks what it can't judge.
    """
    spec = cluster or load_cluster(PRESETS["laptop"])
    model = str(train.get("model", "mlp"))
    try:
        shape, classes, samples, tokens = _dataset(train)
        strategy = strategy_plan(str(train.get("strategy", "allreduce")), train.get("strategy_options") or {})
    except (ValueError, TypeError, PluginError) as exc:
        return Verdict(True, f"not checked: {exc}")
    share = 1 / shares_per_gpu(gpus_per_process) if shares_per_gpu(gpus_per_process) else 1.0
    ranks = max(1, processes) * max(1, int(gpus_per_process))
    try:
        plan = Plan(batch_size=int(train.get("batch_size", 32)),
                    devices=min(ranks, spec.total_devices),
                    optimizer=str(train.get("optimizer", "sgd")),
                    momentum=float(train.get("momentum", 0.0)),
                    precision=str(train.get("precision", "fp32")),
                    activation_checkpointing=_checkpointing(train),
                    dataset_size=samples, epochs=float(train.get("epochs", 1)), **strategy)
        facts = model_facts(model, shape, classes, plan.precision, dict(train.get("model_options") or {}),
                            param_dtype=plan.compute_dtype, token_input=tokens)
        pred = predict(facts, spec, plan)
    except OracleError as exc:
        return Verdict(True, f"not checked: {exc}")
    per_device = f"{pred.memory_per_device_bytes / _GIB:.3f} GiB of {pred.memory_available_bytes / _GIB:.2f} GiB"
    if share < 1 and pred.fits and pred.memory_per_device_bytes > share * pred.memory_available_bytes:
        return Verdict(
            False,
            f"memory per rank must fit its share of the GPU: trial needs {_size(pred.memory_per_device_bytes)} "
            f"per rank for model {model!r} at batch_size {plan.batch_size}, but a {gpus_per_process:g} share "
            f"(gpus_per_process) of {spec.device.name} is {_size(share * pred.memory_available_bytes)} of "
            f"{_size(pred.memory_available_bytes)}. Fix: give each rank a larger share or a whole GPU, or a "
            "smaller batch or model",
            pred.to_dict(),
        )
    if share < 1:
        per_device += f" ({gpus_per_process:g} share: {_size(share * pred.memory_available_bytes)})"
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
    replicated = None
    if plan.sharded:
        full = facts if plan.compute_dtype == "fp32" else model_facts(
            model, shape, classes, plan.precision, dict(train.get("model_options") or {}), token_input=tokens)
        replicated = _replicated(full, spec, plan)
    if replicated is not None and not replicated.fits:
        return Verdict(True, f"fits only when sharded: {plan.strategy} needs {per_device} per device; replicated "
                             f"(allreduce) it would need {replicated.memory_per_device_bytes / _GIB:.2f} GiB",
                       pred.to_dict())
    return Verdict(True, f"fits: {per_device} per device", pred.to_dict())


def _size(n: float) -> str:
    """Bytes for a message: GiB, or MiB below one GiB (a share of a small device)."""
    return f"{n / _GIB:.2f} GiB" if n >= _GIB else f"{n / 2**20:.1f} MiB"


def _replicated(facts: ModelFacts, cluster: ClusterSpec, plan: Plan) -> Prediction | None:
    """The same trial with a full replica per rank (DDP), or None when it cannot be priced so."""
    try:
        return predict(facts, cluster, replace(plan, strategy="allreduce", param_dtype="fp32"))
    except OracleError:
        return None


def strategy_plan(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The oracle's ``Plan`` fields for a training strategy, from its registry entry's options
    model (``oracle_plan()``; ``zero1``: ``{"strategy": "zero1", "bucket_mb": ...}``, ``fsdp``:
    ``reshard_after_forward``, ``param_dtype``, ``cpu_offload``); ``ValueError`` when the strategy
    has no oracle model."""
    model = STRATEGIES.options(name, options)
    plan = getattr(model, "oracle_plan", None)
    if plan is None:
        raise ValueError(f"strategy {name!r} has no oracle model (its options model defines no oracle_plan())")
    fields: dict[str, Any] = plan()
    return fields
