"""Parallelism oracle: an analytic model of compute, communication and memory per strategy.

Typical use::

    from hpoflow.oracle import Plan, load_cluster, model_facts, predict
    pred = predict(model_facts("resnet50"), load_cluster("p100-cluster"), Plan(batch_size=32))
    print(pred.cost.step_s, pred.cost.algorithm, pred.algorithm_note, pred.fits, pred.max_batch_per_device)

See docs/oracle.md for the equations and what the model leaves out.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpoflow.oracle._checkpoint import (
        CheckpointAdvice,
        CheckpointCost,
        advise,
        checkpoint_cost,
        expected_overhead,
        filesystem_of,
        young_daly_interval,
    )
    from hpoflow.oracle._filesystem import CHECKPOINT_FORMATS, FILESYSTEMS, FileSystemSpec, measure_filesystem
    from hpoflow.oracle.calibration import calibrate, write_cluster
    from hpoflow.oracle.catalog import ALGORITHMS, DEVICES, LINKS, PRESETS
    from hpoflow.oracle.cluster import ClusterSpec, DeviceSpec, LinkSpec, Overheads, load_cluster
    from hpoflow.oracle.errors import OracleError
    from hpoflow.oracle.facts import BUILTIN_MODELS, ModelFacts, model_facts, optimizer_state_bytes
    from hpoflow.oracle.feasibility import check_trial
    from hpoflow.oracle.model import STRATEGIES, Plan, Prediction, StepCost, memory_breakdown, predict
    from hpoflow.trial import Verdict

__all__ = [
    "ALGORITHMS",
    "BUILTIN_MODELS",
    "CHECKPOINT_FORMATS",
    "DEVICES",
    "FILESYSTEMS",
    "LINKS",
    "PRESETS",
    "STRATEGIES",
    "CheckpointAdvice",
    "CheckpointCost",
    "ClusterSpec",
    "DeviceSpec",
    "FileSystemSpec",
    "LinkSpec",
    "ModelFacts",
    "OracleError",
    "Overheads",
    "Plan",
    "Prediction",
    "StepCost",
    "Verdict",
    "advise",
    "calibrate",
    "check_trial",
    "checkpoint_cost",
    "expected_overhead",
    "filesystem_of",
    "load_cluster",
    "measure_filesystem",
    "memory_breakdown",
    "model_facts",
    "optimizer_state_bytes",
    "predict",
    "write_cluster",
    "young_daly_interval",
]

# Names load on first use (PEP 562): importing ``hpoflow.oracle.precheck`` or ``hpoflow.cli.oracle_cmd``
# must not pull in torch through ``calibrate``/``facts``.
_WHERE = {
    **dict.fromkeys(("CheckpointAdvice", "CheckpointCost", "advise", "checkpoint_cost", "expected_overhead",
                     "filesystem_of", "young_daly_interval"), "hpoflow.oracle._checkpoint"),
    **dict.fromkeys(("CHECKPOINT_FORMATS", "FILESYSTEMS", "FileSystemSpec", "measure_filesystem"),
                    "hpoflow.oracle._filesystem"),
    'ALGORITHMS': 'hpoflow.oracle.catalog',
    'BUILTIN_MODELS': 'hpoflow.oracle.facts',
    'ClusterSpec': 'hpoflow.oracle.cluster',
    'DEVICES': 'hpoflow.oracle.catalog',
    'DeviceSpec': 'hpoflow.oracle.cluster',
    'LINKS': 'hpoflow.oracle.catalog',
    'LinkSpec': 'hpoflow.oracle.cluster',
    'ModelFacts': 'hpoflow.oracle.facts',
    'OracleError': 'hpoflow.oracle.errors',
    'Overheads': 'hpoflow.oracle.cluster',
    'PRESETS': 'hpoflow.oracle.catalog',
    'Plan': 'hpoflow.oracle.model',
    'Prediction': 'hpoflow.oracle.model',
    'STRATEGIES': 'hpoflow.oracle.model',
    'StepCost': 'hpoflow.oracle.model',
    'Verdict': 'hpoflow.trial',
    'calibrate': 'hpoflow.oracle.calibration',
    'check_trial': 'hpoflow.oracle.feasibility',
    'load_cluster': 'hpoflow.oracle.cluster',
    'memory_breakdown': 'hpoflow.oracle.model',
    'model_facts': 'hpoflow.oracle.facts',
    'optimizer_state_bytes': 'hpoflow.oracle.facts',
    'predict': 'hpoflow.oracle.model',
    'write_cluster': 'hpoflow.oracle.calibration',
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hpoflow.oracle' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
