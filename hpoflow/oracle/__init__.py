"""Parallelism oracle: an analytic model of compute, communication and memory per strategy.

Typical use::

    from hpoflow.oracle import Plan, load_cluster, model_facts, predict
    pred = predict(model_facts("resnet50"), load_cluster("p100-cluster"), Plan(batch_size=32))
    print(pred.cost.step_s, pred.bottleneck, pred.max_speedup_devices)

See docs/oracle.md for the equations and what the model leaves out.
"""

from __future__ import annotations

from hpoflow.oracle.calibrate import calibrate, write_cluster
from hpoflow.oracle.catalog import DEVICES, LINKS, PRESETS
from hpoflow.oracle.cluster import ClusterSpec, DeviceSpec, LinkSpec, Overheads, load_cluster
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import BUILTIN_MODELS, ModelFacts, model_facts, optimizer_state_bytes
from hpoflow.oracle.model import STRATEGIES, Plan, Prediction, StepCost, predict
from hpoflow.oracle.trial import Verdict, check_trial

__all__ = [
    "BUILTIN_MODELS",
    "DEVICES",
    "LINKS",
    "PRESETS",
    "STRATEGIES",
    "ClusterSpec",
    "DeviceSpec",
    "LinkSpec",
    "ModelFacts",
    "OracleError",
    "Overheads",
    "Plan",
    "Prediction",
    "StepCost",
    "Verdict",
    "calibrate",
    "check_trial",
    "load_cluster",
    "model_facts",
    "optimizer_state_bytes",
    "predict",
    "write_cluster",
]
