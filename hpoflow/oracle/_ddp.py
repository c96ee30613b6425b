"""Data parallelism's communication: DDP's buckets on the backward pass's timeline.

DDP fills buckets in the order backward makes gradients ready (the first closed at 1 MiB, the
others at ``bucket_mb`` MiB; 0: one all-reduce per parameter tensor) and all-reduces each as soon as
it is full, one after another: ``start_i = max(ready_i, end_(i-1))``. What runs past the end of
backward is exposed (x ``overlap``; the rest of the communication is exposed in full).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from hpoflow.oracle import _comm
from hpoflow.oracle._compute import Compute
from hpoflow.oracle.catalog import PRECISION_BYTES
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.facts import ModelFacts
from hpoflow.oracle.plan import Plan

__all__ = ["DDP_FIRST_BUCKET_BYTES", "MIB", "NO_COMM", "Comm", "allreduce_overlap", "ddp_buckets"]

MIB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


@dataclass(frozen=True)
class Comm:
    """One step's communication: seconds (bandwidth, latency, exposed after compute), the main
    algorithm, collectives, seconds per algorithm, and bytes (each device sends; each node sends
    across the network)."""

    bandwidth_s: float
    latency_s: float
    exposed_s: float
    algorithm: str
    collectives: int
    per_algorithm: dict[str, float] = field(default_factory=dict)
    sent_bytes: float = 0.0
    network_bytes: float = 0.0


NO_COMM = Comm(0.0, 0.0, 0.0, "", 0)


def ddp_buckets(facts: ModelFacts, plan: Plan) -> list[tuple[int, ...]]:
    """DDP's buckets in the order backward fills them, each as the indices (into the trace's
    ``grad_ready``) of its gradients: DDP rebuilds its buckets after the first step in the order
    gradients became ready, closing the first at 1 MiB of fp32 gradients and the others at
    ``bucket_mb`` MiB (a bucket closes once it reaches its limit). One bucket without a trace."""
    trace = facts.trace
    if trace is None or not trace.grad_ready:
        return []
    cap = plan.bucket_mb * MIB
    limit = min(DDP_FIRST_BUCKET_BYTES, cap) if cap > 0 else 0.0
    out: list[tuple[int, ...]] = []
    current: list[int] = []
    nbytes = 0.0
    for i, (_, numel, _) in enumerate(trace.grad_ready):
        current.append(i)
        nbytes += 4 * numel
        if nbytes >= limit:
            out.append(tuple(current))
            current, nbytes, limit = [], 0.0, cap
    if current:
        out.append(tuple(current))
    return out


def _bucket_list(facts: ModelFacts, plan: Plan) -> list[tuple[int, float]]:
    """(index in ``grad_ready`` of the gradient that completes the bucket, elements) per bucket."""
    trace = facts.trace
    buckets = ddp_buckets(facts, plan)
    if trace is None or not buckets:
        return [(-1, float(facts.params))]
    return [(b[-1], float(sum(trace.grad_ready[i][1] for i in b))) for b in buckets]


def allreduce_overlap(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, net: _comm.Network, comp: Compute,
                      slow: float, elements_scale: float = 1.0) -> Comm:
    """The bucket timeline of a data-parallel step (see the module docs)."""
    wire = PRECISION_BYTES[plan.grad_dtype]
    fixed = cluster.overheads.collective_s
    bw = lat = sent = network = 0.0
    end = 0.0
    moved: dict[str, float] = defaultdict(float)
    per_algorithm: dict[str, float] = defaultdict(float)
    buckets = _bucket_list(facts, plan)
    backward = comp.backward_s * slow
    for last, elements in buckets:
        nbytes = elements * elements_scale * wire
        name, (b, a) = _comm.allreduce(net, nbytes, plan.algorithm)
        for alg, (ab, aa) in _comm.allreduce_costs(net, nbytes).items():
            per_algorithm[alg] += ab + aa + fixed
        ready = comp.grad_ready_s[last] * slow if 0 <= last < len(comp.grad_ready_s) else backward
        end = max(end, ready) + b + a + fixed
        bw, lat = bw + b, lat + a + fixed
        moved[name] += nbytes
        s_dev, s_node = _comm.volume(net, "allreduce", nbytes, name)
        sent, network = sent + s_dev, network + s_node
    total = bw + lat
    timeline = max(0.0, end - backward)
    overlap = cluster.overlap if plan.overlap is None else plan.overlap
    exposed = overlap * min(timeline, total) + (1 - overlap) * total
    algorithm = max(moved, key=lambda a: moved[a]) if moved else ""
    return Comm(bw, lat, exposed, algorithm, len(buckets), dict(per_algorithm), sent, network)


