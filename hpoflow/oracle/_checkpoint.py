"""The checkpoint-cost term and how often to checkpoint (Young/Daly).

Bytes: one copy of the state is the fp32 weights plus the optimizer's state (``ModelFacts.param_bytes``
+ ``optimizer_state_bytes``: SGD 0, momentum 1x, Adam 2x the weights; buffers such as batch norm's
running statistics and the RNG states are left out: 0.2 % of a ResNet's file, 3 % of the
0.9 MB CNN's: the study in docs/checkpointing.md). The format decides who writes
what (hpoflow's formats, docs/checkpointing.md):

* ``replica``, ``safetensors``: every rank writes the whole state: ``p`` writers of ``S`` bytes;
* ``rank0``: one writer of ``S`` (the other ranks' RNG states are a few kB);
* ``dcp``: DCP writes each replicated tensor once, spread over the ranks: ``p`` writers of ``S / p``.

A checkpoint is on disk after (``filesystem`` of the cluster, ``_filesystem.FileSystemSpec``)::

    write = latency + max(total / bandwidth, busiest node's bytes / node_bandwidth,
                          one writer's bytes / stream_bandwidth)

Training waits ``write`` for a blocking save; for an async save it waits only for the copy of its
state (``S / staging_bandwidth``; every format copies the rank's whole state, DCP's staging too) and
the checkpoint counts once written. A restart reads ``S`` on every rank (priced like a write of ``p S``).

Young/Daly: with a job's mean time between failures ``M`` (a node's MTBF over the nodes the job holds:
failures independent) and ``C`` the time a checkpoint costs training, the interval that minimises the
expected loss is Young's ``tau = sqrt(2 C M)`` (J. W. Young, CACM 17(9), 1974; Daly's higher-order
refinement, FGCS 22(3), 2006, differs by less than ``C``). The expected fraction of time lost is::

    overhead = C / tau + (tau / 2 + lag + restore) / M

(checkpoints, plus per failure half an interval of work redone, the async write's ``lag`` during
which the newest checkpoint is not yet on disk, and the restart's read), ``sqrt(2 C / M)`` at
``tau = sqrt(2 C M)`` without lag and restore. An async save's next save waits for its write, so
``tau >= write``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from hpoflow.oracle._filesystem import CHECKPOINT_FORMATS, FILESYSTEMS, FileSystemSpec
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import ModelFacts, optimizer_state_bytes

__all__ = ["CHECKPOINT_FORMATS", "CheckpointAdvice", "CheckpointCost", "advise", "checkpoint_cost",
           "expected_overhead", "filesystem_of", "young_daly_interval"]


@dataclass(frozen=True)
class CheckpointCost:
    """What one checkpoint of a training job costs (bytes and seconds)."""

    format: str
    async_save: bool
    devices: int
    nodes: int
    filesystem: str
    state_bytes: float
    bytes_written: float
    writers: int
    bytes_per_writer: float
    write_s: float
    blocking_s: float
    restore_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CheckpointAdvice:
    """How often to checkpoint (Young/Daly) and what it costs, for a node MTBF."""

    node_mtbf_s: float
    job_mtbf_s: float
    interval_s: float
    interval_steps: float
    overhead: float
    overhead_checkpoints: float
    overhead_failures: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def filesystem_of(cluster: ClusterSpec) -> FileSystemSpec:
    """The cluster's ``filesystem``, or the default: ``local-ssd`` on one node, ``parallel-fs`` on several."""
    if cluster.filesystem is not None:
        return cluster.filesystem
    return FileSystemSpec.model_validate(FILESYSTEMS["local-ssd" if cluster.nodes == 1 else "parallel-fs"])


def checkpoint_cost(facts: ModelFacts, cluster: ClusterSpec, devices: int, optimizer: str = "sgd",
                    momentum: float = 0.9, fmt: str = "replica", async_save: bool = True) -> CheckpointCost:
    """One checkpoint of ``facts`` trained data-parallel on ``devices`` devices of ``cluster``."""
    if fmt not in CHECKPOINT_FORMATS:
        raise OracleError(f"checkpoint format must be one of {', '.join(CHECKPOINT_FORMATS)}, but got {fmt!r}")
    if not 1 <= devices <= cluster.total_devices:
        raise OracleError(f"devices must be between 1 and the {cluster.total_devices} devices of cluster "
                          f"{cluster.name!r}, but got {devices}")
    fs = filesystem_of(cluster)
    per_node = cluster.devices_per_node
    nodes = math.ceil(devices / per_node)
    state = float(facts.param_bytes + optimizer_state_bytes(facts.params, optimizer, momentum))
    writers, each = {"replica": (devices, state), "safetensors": (devices, state), "rank0": (1, state),
                     "dcp": (devices, state / devices)}[fmt]

    def transfer(total: float, busiest_node: float, one_stream: float) -> float:
        return fs.latency + max(total / fs.bandwidth, busiest_node / fs.node_bandwidth,
                                one_stream / fs.stream_bandwidth)

    write = transfer(writers * each, min(writers, per_node) * each, each)
    restore = transfer(devices * state, min(devices, per_node) * state, state)
    blocking = state / fs.staging_bandwidth if async_save else write
    return CheckpointCost(format=fmt, async_save=async_save, devices=devices, nodes=nodes, filesystem=fs.name,
                          state_bytes=state, bytes_written=writers * each, writers=writers, bytes_per_writer=each,
                          write_s=write, blocking_s=min(blocking, write), restore_s=restore)


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval ``sqrt(2 C M)`` (seconds)."""
    if cost_s < 0 or mtbf_s <= 0:
        raise OracleError(f"a checkpoint cost >= 0 and an MTBF > 0 are needed, but got cost={cost_s}, "
                          f"mtbf={mtbf_s}")
    return math.sqrt(2.0 * cost_s * mtbf_s)


def expected_overhead(interval_s: float, cost_s: float, mtbf_s: float, restore_s: float = 0.0,
                      lag_s: float = 0.0) -> tuple[float, float]:
    """(time lost to checkpoints, time lost to failures) as fractions of the run, for a checkpoint of
    ``cost_s`` every ``interval_s`` and failures every ``mtbf_s`` on average."""
    if interval_s <= 0 or mtbf_s <= 0:
        raise OracleError(f"an interval > 0 and an MTBF > 0 are needed, but got interval={interval_s}, "
                          f"mtbf={mtbf_s}")
    return cost_s / interval_s, (interval_s / 2.0 + lag_s + restore_s) / mtbf_s


def advise(cost: CheckpointCost, node_mtbf_hours: float, step_s: float) -> CheckpointAdvice:
    """The Young/Daly interval for this job and its expected overhead (docstring of the module)."""
    if not node_mtbf_hours > 0:
        raise OracleError(f"--mtbf-hours must be > 0 (a node's mean time between failures), but got "
                          f"{node_mtbf_hours}; e.g. --mtbf-hours 8760 for a node that fails once a year")
    node_mtbf = node_mtbf_hours * 3600.0
    job_mtbf = node_mtbf / cost.nodes
    lag = cost.write_s - cost.blocking_s
    interval = young_daly_interval(cost.blocking_s, job_mtbf)
    interval = max(interval, cost.write_s if cost.async_save else 0.0, step_s)
    ckpt, failures = expected_overhead(interval, cost.blocking_s, job_mtbf, cost.restore_s, lag)
    return CheckpointAdvice(node_mtbf_s=node_mtbf, job_mtbf_s=job_mtbf, interval_s=interval,
                            interval_steps=interval / step_s if step_s > 0 else math.inf, overhead=ckpt + failures,
                            overhead_checkpoints=ckpt, overhead_failures=failures)
