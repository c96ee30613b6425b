"""Extrapolate from a measurement: calibrate the device time on a small run, predict the large one.

Datasheet figures leave the compute of a given model and software stack uncertain by a factor of
two or more (a 2017 Caffe2 ResNet-50 ran at half the speed a P100's datasheet allows; cuDNN's
Winograd convolutions run VGG-16 faster than its FLOPs allow). A user usually has a measurement of
their own at a small scale: a trial's ``samples_per_s`` in ``trials.csv`` or a published figure.

:func:`calibrate_scale` finds the factor ``compute_scale`` on the device time of a step
(forward, backward, optimizer and the overheads, all together) that makes the oracle predict the
baseline's samples/s per device at the baseline's device count and batch; everything else is kept
from the model: communication per network level, its overlap with backward, the wait for
stragglers and congestion, which is what changes with scale.
"""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import ModelFacts
from hpoflow.oracle.model import step_cost
from hpoflow.oracle.plan import Plan

__all__ = ["Baseline", "calibrate_scale", "read_baseline"]


@dataclass(frozen=True)
class Baseline:
    """A measured throughput: samples/s per device on ``devices`` devices (at ``batch_size`` per
    device when known), and where it comes from."""

    samples_per_s: float
    devices: int = 1
    batch_size: int | None = None
    source: str = "given"


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def read_baseline(text: str, devices: int | None = None) -> Baseline:
    """A :class:`Baseline` from ``--baseline``: a number (samples/s per device, on ``devices``
    devices, default 1) or a run directory (or its ``trials.csv``): the median per-device
    ``samples_per_s`` of its complete trials at their smallest world size."""
    value = _number(text)
    if value is not None:
        if value <= 0:
            raise OracleError(f"--baseline must be samples/s per device > 0, but got {text!r}; "
                              "e.g. --baseline 138 --baseline-devices 8")
        return Baseline(value, devices or 1)
    path = Path(text)
    csv_path = path / "trials.csv" if path.is_dir() else path
    if not csv_path.is_file():
        raise OracleError(f"--baseline must be samples/s per device or a run directory with a trials.csv, but "
                          f"{text!r} is neither; run a study first or give the number")
    with csv_path.open(newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    done = []
    for row in rows:
        rate, world = _number(row.get("metric_samples_per_s", "")), _number(row.get("metric_world_size", "") or "1")
        if row.get("state") == "COMPLETE" and rate and rate > 0 and world and world >= 1:
            batch = _number(row.get("metric_global_batch", "") or "")
            done.append((int(world), rate / world, int(batch / world) if batch else None))
    if not done:
        raise OracleError(f"--baseline {text!r}: {csv_path} has no complete trial with metric_samples_per_s; "
                          "give the samples/s per device as a number instead")
    world = min(w for w, _, _ in done)
    if devices is not None and devices != world:
        raise OracleError(f"--baseline-devices must match the run's trials, but got {devices} while the smallest "
                          f"world size in {csv_path} is {world}; drop --baseline-devices")
    at = [(r, b) for w, r, b in done if w == world]
    batches = sorted({b for _, b in at if b})
    rate = statistics.median(r for r, _ in at)
    return Baseline(rate, world, batches[len(batches) // 2] if batches else None,
                    f"median of {len(at)} complete trial(s) at world size {world} in {csv_path}")


def calibrate_scale(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, baseline: Baseline) -> float:
    """The ``compute_scale`` with which the oracle predicts ``baseline`` (see the module docs)."""
    devices = baseline.devices
    if devices > cluster.total_devices:
        raise OracleError(f"the baseline's devices ({devices}) must fit the cluster's {cluster.total_devices}; "
                          "give a cluster at least that large")
    batch = baseline.batch_size or plan.batch_size
    at = replace(plan, devices=devices, batch_size=batch).validate(cluster)

    def per_device(scale: float) -> float:
        return batch / step_cost(facts, cluster, replace(at, compute_scale=scale), devices, batch).step_s

    lo, hi = 1e-4, 1e4
    if per_device(lo) < baseline.samples_per_s:
        raise OracleError(
            f"--baseline {baseline.samples_per_s:g} samples/s per device on {devices} device(s) is faster than "
            f"this cluster's communication allows even with free compute ({per_device(lo):.4g}); check the "
            f"baseline's devices (--baseline-devices) and the cluster's links")
    for _ in range(100):  # bisection in log space: throughput falls as the device time grows
        mid = math.sqrt(lo * hi)
        if per_device(mid) > baseline.samples_per_s:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-6:
            break
    return math.sqrt(lo * hi)
