"""Alpha-beta communication costs per step for each parallelism strategy.

Every function returns ``(bandwidth_seconds, latency_seconds)`` so callers can tell a bandwidth
bottleneck from a latency one. ``M`` is the bytes a device contributes (its gradients), ``B`` the
bandwidth per direction and ``alpha`` the per-message latency of the link used. When devices span
more than one node, a flat collective is as slow as its slowest hop, so ``B`` is the smaller and
``alpha`` the larger of the intra- and inter-node figures (:func:`slowest_link`).
"""

from __future__ import annotations

import math

from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.train.collectives import ring_allreduce_bytes

__all__ = [
    "Cost",
    "parameter_server",
    "pipeline_p2p",
    "ring_allreduce",
    "slowest_link",
    "tree_allreduce",
]

Cost = tuple[float, float]


def slowest_link(cluster: ClusterSpec, devices: int) -> tuple[float, float]:
    """(bandwidth, latency) of the slowest hop among ``devices`` packed onto nodes in order."""
    if devices <= cluster.devices_per_node:
        return cluster.intra_node.bandwidth, cluster.intra_node.latency
    return (min(cluster.intra_node.bandwidth, cluster.inter_node.bandwidth),
            max(cluster.intra_node.latency, cluster.inter_node.latency))


def ring_allreduce(p: int, m: float, bandwidth: float, alpha: float, messages: int = 1) -> Cost:
    """Ring: 2(p-1)/p * M / B  +  2(p-1) * alpha per message (bucket)."""
    if p <= 1:
        return 0.0, 0.0
    return ring_allreduce_bytes(m, p) / bandwidth, 2 * (p - 1) * alpha * messages


def tree_allreduce(p: int, m: float, bandwidth: float, alpha: float, messages: int = 1) -> Cost:
    """Pipelined binary tree (reduce then broadcast): 2 M / B  +  2 ceil(log2 p) * alpha."""
    if p <= 1:
        return 0.0, 0.0
    return 2 * m / bandwidth, 2 * math.ceil(math.log2(p)) * alpha * messages


def parameter_server(cluster: ClusterSpec, p: int, servers: int, m: float) -> Cost:
    """``p`` workers push M of gradients and pull M of weights from ``servers`` shards.

    Each server moves p*M/S each way over its own link; the workers of one node share their
    node's link. Push and pull are two phases: 2 * max(server load, worker load) + 2 alpha.
    """
    if p <= 1:
        return 0.0, 0.0
    if cluster.nodes == 1 or p <= cluster.devices_per_node:
        server_bw = worker_bw = cluster.intra_node.bandwidth
        alpha = cluster.intra_node.latency
    else:
        server_bw = cluster.inter_node.bandwidth
        worker_bw = cluster.inter_node.bandwidth / min(p, cluster.devices_per_node)
        alpha = max(cluster.intra_node.latency, cluster.inter_node.latency)
    load = max(p * m / servers / server_bw, m / worker_bw)
    return 2 * load, 2 * alpha


def pipeline_p2p(k: int, micro_batch: float, boundary_bytes: float, bandwidth: float,
                 alpha: float) -> Cost:
    """Activations forward and their gradients backward across k-1 stage boundaries on the
    critical path of the pipeline fill and drain: 2(k-1) (b/m * boundary / B + alpha)."""
    if k <= 1:
        return 0.0, 0.0
    return 2 * (k - 1) * micro_batch * boundary_bytes / bandwidth, 2 * (k - 1) * alpha
