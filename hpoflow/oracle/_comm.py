"""Collectives priced per level of a two-level network (alpha-beta model, one message at a time).

A job of ``p`` devices is packed onto ``n = ceil(p / g)`` nodes of ``g`` devices (``g`` = the
cluster's ``devices_per_node``, or ``p`` on one node). Inside a node devices talk over the
``intra_node`` link (bandwidth ``B_i`` per device and direction, latency ``a_i``); between nodes
each node has ``rails`` network adapters of the ``inter_node`` link (``B_n = rails x bandwidth``
per node and direction, latency ``a_n``). Every function returns ``(bandwidth seconds, latency
seconds)`` for one all-reduce of ``M`` bytes per device:

* ``ring`` (NCCL's ring, flat over all p devices, nodes in order): ``2(p-1)/p M / min(B_i, B_n)``
  and, as NCCL's own tuning model counts it, ``2(n-1)`` steps at the network's latency and the
  other ``2(p-1) - 2(n-1)`` at the node's.
* ``tree`` (NCCL's double binary tree between nodes, a chain inside each): ``2 M / (0.9 min(B_i,
  B_n))`` (NCCL's model credits trees with 90 % of the bus bandwidth) and
  ``2((g-1) a_i + ceil(log2 n) a_n)``; only across nodes.
* ``hier-ring`` (two levels: reduce-scatter inside the node, g rings of n nodes on the node's
  shards, all-gather inside the node): ``2(g-1)/g M / B_i + 2(n-1)/n M / B_n`` and
  ``2(g-1) a_i + 2(n-1) a_n``.
* ``hier-hd``: the same with recursive halving and doubling between nodes (Rabenseifner; what
  Goyal et al. 2017 ran over Ethernet): ``2 ceil(log2 n)`` network latencies; when ``n`` is not a
  power of two, the extra nodes first fold their data into a partner and get the result back
  (``+2 M / B_n + 2 a_n``).
* ``torus`` (a cluster with ``torus: [x, y]``, x y = n): the node's shards go round a ring along x,
  all-reduce along y, back along x (the 2D-torus all-reduce):
  ``(2(x-1)/x + 2(y-1)/(x y)) M / B_n + (2(x-1) + 2(y-1)) a_n`` plus the intra-node levels.

:func:`best_allreduce` picks the fastest applicable algorithm for a message size, as NCCL picks by
its own time model (it would pick among ring and tree; the hierarchical schemes are what Horovod,
Gloo and Caffe2 ran). Parameter servers and pipeline transfers use the same links.

Sharded strategies add two collectives, both NCCL's ring over the ``p`` devices (``M`` = the
gathered, full size): **all-gather** ``(p-1)/p M / min(B_i, B_n)`` and ``(p-1) - (n-1)`` intra-node
plus ``n-1`` network latencies; **reduce-scatter** the same with NCCL, and as much as a ring
all-reduce with gloo (which runs it as one: measured, 2(p-1)/p M sent per rank).

**Congestion.** A job spread over more nodes than one switch of a network level holds shares that
level's uplinks: ``B_n`` is divided by the product of the oversubscription of every level it spans
(``ClusterSpec.congestion``).

**Volumes.** :func:`volume` gives what one step's collective moves on each level: bytes each
device sends (what hpoflow's meter counts per rank) and bytes each node sends across the network.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hpoflow.oracle.catalog import ALGORITHMS
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.train.collectives import ring_allreduce_bytes

__all__ = [
    "ALGORITHMS",
    "Cost",
    "Network",
    "allgather",
    "allreduce",
    "allreduce_costs",
    "best_allreduce",
    "explain",
    "latency_steps",
    "network",
    "parameter_server",
    "pipeline_p2p",
    "reduce_scatter",
    "ring_allreduce",
    "tree_allreduce",
    "volume",
]

Cost = tuple[float, float]
TREE_BANDWIDTH = 0.9  # NCCL's tuning model: a tree reaches 90 % of the bus bandwidth


@dataclass(frozen=True)
class Network:
    """The links one collective over ``p`` devices uses (see the module docs)."""

    p: int
    nodes: int
    per_node: int
    intra_bw: float
    intra_lat: float
    node_bw: float
    inter_lat: float
    torus: tuple[int, int] | None = None
    #: gloo's collectives (reduce-scatter as an all-reduce) instead of NCCL's
    gloo: bool = False
    #: the factor ``node_bw`` was divided by for the job's spread over the network levels
    congestion: float = 1.0

    @property
    def bottleneck_bw(self) -> float:
        """Bandwidth of the slowest hop of a flat collective."""
        return self.intra_bw if self.nodes == 1 else min(self.intra_bw, self.node_bw)


def network(cluster: ClusterSpec, p: int) -> Network:
    """The two-level network of ``p`` devices packed onto the cluster's nodes in order."""
    g = cluster.devices_per_node
    nodes = max(1, math.ceil(p / g))
    torus = cluster.torus if cluster.torus and nodes == cluster.torus[0] * cluster.torus[1] else None
    congestion = cluster.congestion(nodes)
    return Network(p=p, nodes=nodes, per_node=min(p, g), intra_bw=cluster.intra_node.bandwidth,
                   intra_lat=cluster.intra_node.latency,
                   node_bw=cluster.inter_node.bandwidth * cluster.rails / congestion,
                   inter_lat=cluster.inter_node.latency, torus=torus, gloo=cluster.backend == "gloo",
                   congestion=congestion)


def ring_allreduce(p: int, m: float, bandwidth: float, alpha: float, messages: int = 1) -> Cost:
    """One level's ring: ``2(p-1)/p M / B`` and ``2(p-1) alpha`` per message."""
    if p <= 1:
        return 0.0, 0.0
    return ring_allreduce_bytes(m, p) / bandwidth, 2 * (p - 1) * alpha * messages


def tree_allreduce(p: int, m: float, bandwidth: float, alpha: float, messages: int = 1) -> Cost:
    """One level's pipelined binary tree (reduce, then broadcast): ``2 M / B`` and
    ``2 ceil(log2 p) alpha`` per message."""
    if p <= 1:
        return 0.0, 0.0
    return 2 * m / bandwidth, 2 * math.ceil(math.log2(p)) * alpha * messages


def _halving_doubling(n: int, m: float, bandwidth: float, alpha: float) -> Cost:
    if n <= 1:
        return 0.0, 0.0
    core = 1 << (n.bit_length() - 1)  # the largest power of two <= n
    bw, lat = ring_allreduce_bytes(m, core) / bandwidth, 2 * math.log2(core) * alpha
    if core != n:  # the extra nodes fold their data into a partner, then get the result back
        bw, lat = bw + 2 * m / bandwidth, lat + 2 * alpha
    return bw, lat


def _intra_levels(net: Network, m: float) -> Cost:
    """Reduce-scatter then all-gather inside each node (ring over its g devices)."""
    g = net.per_node
    if g <= 1:
        return 0.0, 0.0
    return 2 * (g - 1) / g * m / net.intra_bw, 2 * (g - 1) * net.intra_lat


def allreduce_costs(net: Network, m: float) -> dict[str, Cost]:
    """Every applicable algorithm's ``(bandwidth, latency)`` seconds for ``m`` bytes per device."""
    p, n, g = net.p, net.nodes, net.per_node
    if p <= 1 or m <= 0:
        return {"ring": (0.0, 0.0)}
    ring_lat = (2 * (p - 1) - 2 * (n - 1)) * net.intra_lat + 2 * (n - 1) * net.inter_lat
    out = {"ring": (ring_allreduce_bytes(m, p) / net.bottleneck_bw, ring_lat)}
    if n > 1:
        out["tree"] = (2 * m / (TREE_BANDWIDTH * net.bottleneck_bw),
                       2 * ((g - 1) * net.intra_lat + math.ceil(math.log2(n)) * net.inter_lat))
        ibw, ilat = _intra_levels(net, m)
        if g > 1:
            rbw, rlat = ring_allreduce(n, m, net.node_bw, net.inter_lat)
            out["hier-ring"] = (ibw + rbw, ilat + rlat)
        hbw, hlat = _halving_doubling(n, m, net.node_bw, net.inter_lat)
        out["hier-hd"] = (ibw + hbw, ilat + hlat)
        if net.torus is not None:
            x, y = net.torus
            tbw = (2 * (x - 1) / x + 2 * (y - 1) / (x * y)) * m / net.node_bw
            out["torus"] = (ibw + tbw, ilat + (2 * (x - 1) + 2 * (y - 1)) * net.inter_lat)
    return out


def best_allreduce(net: Network, m: float) -> tuple[str, Cost]:
    """The fastest applicable algorithm for one message of ``m`` bytes per device."""
    costs = allreduce_costs(net, m)
    name = min(costs, key=lambda a: (sum(costs[a]), ALGORITHMS.index(a)))
    return name, costs[name]


def allreduce(net: Network, m: float, algorithm: str = "auto") -> tuple[str, Cost]:
    """``algorithm``'s cost for ``m`` bytes, or the fastest one's (``auto``); an algorithm that
    does not apply to this network (``tree`` on one node) falls back to the flat ring."""
    if algorithm == "auto":
        return best_allreduce(net, m)
    costs = allreduce_costs(net, m)
    name = algorithm if algorithm in costs else "ring"
    return name, costs[name]


def allgather(net: Network, m: float) -> Cost:
    """NCCL's ring all-gather of ``m`` bytes (the gathered size) over the job's ``p`` devices."""
    p, n = net.p, net.nodes
    if p <= 1 or m <= 0:
        return 0.0, 0.0
    lat = ((p - 1) - (n - 1)) * net.intra_lat + (n - 1) * net.inter_lat
    return (p - 1) / p * m / net.bottleneck_bw, lat


def reduce_scatter(net: Network, m: float) -> Cost:
    """A ring reduce-scatter of ``m`` bytes (the full size, before scattering): as an all-gather
    with NCCL; gloo runs it as an all-reduce (twice the bytes and the latency steps)."""
    if net.gloo:
        return allreduce_costs(net, m)["ring"]
    return allgather(net, m)


def volume(net: Network, kind: str, m: float, algorithm: str = "ring") -> tuple[float, float]:
    """(bytes each device sends, bytes each node sends across the network) of one collective of
    ``m`` bytes: ``kind`` ``allreduce`` (with ``algorithm``), ``allgather``, ``reduce_scatter``, or
    ``broadcast_shards`` (every rank broadcasts its 1/p share: ZeroRedundancyOptimizer's update)."""
    p, n, g = net.p, net.nodes, net.per_node
    if p <= 1 or m <= 0:
        return 0.0, 0.0
    if kind == "reduce_scatter" and net.gloo:
        kind, algorithm = "allreduce", "ring"
    if kind in ("allgather", "reduce_scatter", "broadcast_shards"):
        sent = (p - 1) / p * m
        return sent, sent if n > 1 else 0.0  # a ring crosses each node boundary once per step
    sent = ring_allreduce_bytes(m, p)
    if n <= 1:
        return sent, 0.0
    inter = {"ring": sent, "tree": 2 * m, "hier-ring": 2 * (n - 1) / n * m}
    if algorithm == "hier-hd":
        core = 1 << (n.bit_length() - 1)
        inter["hier-hd"] = 2 * (core - 1) / core * m + (0.0 if core == n else 2 * m)
        sent = 2 * (g - 1) / g * m + inter["hier-hd"] / g
    elif algorithm == "hier-ring":
        sent = 2 * (g - 1) / g * m + inter["hier-ring"] / g
    elif algorithm == "tree":
        sent = 2 * m
    elif algorithm == "torus" and net.torus is not None:
        x, y = net.torus
        inter["torus"] = (2 * (x - 1) / x + 2 * (y - 1) / (x * y)) * m
        sent = 2 * (g - 1) / g * m + inter["torus"] / g
    return sent, inter.get(algorithm, sent)


def parameter_server(net: Network, servers: int, m: float) -> Cost:
    """``p`` workers push ``M`` of gradients and pull ``M`` of weights from ``servers`` shards.

    Each server moves ``p M / S`` each way over its node's network (servers on distinct nodes);
    the workers of a node share their node's adapters. Push and pull are two phases:
    ``2 max(server load, worker load)`` and ``2`` latencies.
    """
    if net.p <= 1:
        return 0.0, 0.0
    if net.nodes == 1:
        server_bw = worker_bw = net.intra_bw
        alpha = net.intra_lat
    else:
        server_bw = net.node_bw
        worker_bw = net.node_bw / net.per_node
        alpha = net.inter_lat
    load = max(net.p * m / servers / server_bw, m / worker_bw)
    return 2 * load, 2 * alpha


def pipeline_p2p(k: int, micro_batch: float, boundary_bytes: float, net: Network) -> Cost:
    """Activations forward and their gradients backward across k-1 stage boundaries on the
    critical path of the pipeline fill and drain: ``2(k-1) (b/m boundary / B + alpha)`` with the
    slowest hop of the ``k`` stages' devices."""
    if k <= 1:
        return 0.0, 0.0
    alpha = net.intra_lat if net.nodes == 1 else max(net.intra_lat, net.inter_lat)
    return 2 * (k - 1) * micro_batch * boundary_bytes / net.bottleneck_bw, 2 * (k - 1) * alpha


def latency_steps(net: Network, algorithm: str) -> tuple[int, int]:
    """(intra-node, network) latency steps of one all-reduce with ``algorithm``."""
    p, n, g = net.p, net.nodes, net.per_node
    log_n = math.ceil(math.log2(n)) if n > 1 else 0
    steps = {
        "ring": (2 * (p - 1) - 2 * (n - 1), 2 * (n - 1)),
        "tree": (2 * (g - 1), 2 * log_n),
        "hier-ring": (2 * (g - 1), 2 * (n - 1)),
        "hier-hd": (2 * (g - 1), 2 * log_n + (0 if n & (n - 1) == 0 else 2)),
    }
    if net.torus is not None:
        x, y = net.torus
        steps["torus"] = (2 * (g - 1), 2 * (x - 1) + 2 * (y - 1))
    return steps.get(algorithm, (0, 0))


def explain(net: Network, algorithm: str) -> str:
    """Why ``algorithm`` is the one for this network, in one sentence with the step counts."""
    if net.p <= 1 or not algorithm:
        return "one device: nothing to all-reduce"
    if net.nodes == 1:
        return (f"one node of {net.p} devices: the ring is bandwidth-optimal "
                f"(2(p-1)/p of the gradients per device, {2 * (net.p - 1)} latency steps)")
    ring_i, ring_n = latency_steps(net, "ring")
    own_i, own_n = latency_steps(net, algorithm)
    if algorithm == "ring":
        return (f"ring: large messages are bandwidth-bound and the flat ring moves the least data; its "
                f"{ring_i + ring_n} latency steps ({ring_n} across nodes) cost less than the other schemes' extra")
    what = {"tree": "NCCL's tree (chains in the nodes, a double binary tree between them)",
            "hier-ring": "hierarchical (reduce-scatter in each node, a ring of nodes, all-gather)",
            "hier-hd": "hierarchical with recursive halving/doubling between nodes",
            "torus": "the 2D torus all-reduce between nodes"}[algorithm]
    return (f"{what}: {own_i + own_n} latency steps ({own_n} across nodes) instead of the flat ring's "
            f"{ring_i + ring_n} ({ring_n} across nodes), each node's data crossing the network once")
