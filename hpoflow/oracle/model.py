"""Predictions per parallelism strategy: step time, time-to-train, memory, bottleneck, speed-up.

One training step on each device (``b`` samples per device, ``p`` devices):

* compute  = forward + backward + optimizer + CPU-side overheads (:mod:`hpoflow.oracle._compute`:
  a roofline per traced kernel, or the calibrated tables), x contention when a node's devices
  share cores
* comm     (data parallel) DDP's buckets: gradients in the order backward produces them, the
  first bucket closed at 1 MiB, the others at ``bucket_mb`` MiB (``0``: one collective per
  parameter tensor); each bucket's all-reduce of ``elements x grad_dtype bytes`` priced by the
  fastest algorithm on the two-level network (:mod:`hpoflow.oracle._comm`) or the one forced
* exposed  buckets run one after another, each when its last gradient is ready and the previous
  bucket is done; exposed = what runs past the end of backward (x ``overlap``; the rest of the
  communication is exposed in full: ``overlap`` 0 puts it all after backward). Parameter server
  and EASGD exchange after the step (not hidden); a pipeline all-reduces its stages' gradients in
  buckets as above and adds its stage-to-stage transfers of the fill and drain in full
* wait     = sync_wait(compute) x E[max of p normals] / E[max of 2 normals] with a calibrated
  table, else step_jitter x compute x E[max of p normals] (p > 1; / sqrt(period) for EASGD)
* loader   = max(0, b / loader_samples_per_s - the rest of the step) when the input pipeline is
  slower
* step     = compute + exposed + wait + loader; throughput = p b / step; epoch = N / (p b) x step
* memory   = (weights + grads + DDP buckets + optimizer state) / k
             + (saved activations x b + fixed saved bytes) x (1 + memory_overhead) / k + reserved,
             or the start-up's peak (the model built and wrapped) where that is higher
             (:mod:`hpoflow.oracle._memory`)

Speed-up is weak scaling (per-device batch fixed): throughput(p) / throughput(1). The maximum
speed-up is strong scaling of the same global batch G = p b over q devices (q <= G): the q with
the shortest step, which exists because compute shrinks as 1/q while communication does not.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

from hpoflow.oracle import _comm
from hpoflow.oracle._compute import ACTIVATION_TRAFFIC, OPTIMIZER_BYTES, VIEW_KINDS, Compute, compute, optimizer_key
from hpoflow.oracle._ddp import NO_COMM, Comm, allreduce_overlap, ddp_buckets
from hpoflow.oracle._memory import max_batch, memory_breakdown
from hpoflow.oracle._sharded import HOST_BANDWIDTH, fsdp_comm, recompute_seconds, zero1_comm
from hpoflow.oracle.catalog import ALGORITHMS, PRECISION_BYTES, STRATEGIES
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import ModelFacts
from hpoflow.oracle.plan import GRAD_DTYPES, Plan

__all__ = ["ACTIVATION_TRAFFIC", "ALGORITHMS", "GRAD_DTYPES", "STRATEGIES", "VIEW_KINDS", "Plan", "Prediction",
           "StepCost", "ddp_buckets", "memory_breakdown", "predict", "step_cost"]

_DATA_PARALLEL = ("allreduce", "ring", "tree")
_SEARCH_LIMIT = 1 << 17


@dataclass(frozen=True)
class StepCost:
    """Time components of one step at one device count and per-device batch (seconds)."""

    compute_s: float
    flops_s: float
    memory_traffic_s: float
    overhead_s: float
    comm_bandwidth_s: float
    comm_latency_s: float
    exposed_comm_s: float
    step_s: float
    sync_wait_s: float = 0.0
    forward_s: float = 0.0
    backward_s: float = 0.0
    optimizer_s: float = 0.0
    loader_wait_s: float = 0.0
    #: the all-reduce algorithm that moved the most bytes ("" without an all-reduce)
    algorithm: str = ""
    collectives: int = 0
    #: communication seconds of this step had every collective used each applicable algorithm
    algorithm_costs: dict[str, float] = field(default_factory=dict)
    #: forward recomputed in backward (activation checkpointing), inside ``compute_s``
    recompute_s: float = 0.0
    #: bytes each device sends per step (what hpoflow's meter counts per rank), and bytes each
    #: node sends across the network
    bytes_per_step: float = 0.0
    network_bytes_per_node: float = 0.0
    #: the factor the inter-node bandwidth was divided by (network_levels' oversubscription)
    congestion: float = 1.0

    @property
    def comm_s(self) -> float:
        return self.comm_bandwidth_s + self.comm_latency_s

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "comm_s": self.comm_s}


@dataclass(frozen=True)
class Prediction:
    """Everything the oracle predicts for one model, cluster and plan."""

    model: str
    cluster: str
    strategy: str
    devices: int
    nodes: int
    batch_per_device: int
    global_batch: int
    cost: StepCost
    throughput: float
    epoch_s: float
    time_to_train_s: float
    memory_per_device_bytes: float
    memory_available_bytes: float
    fits: bool
    max_batch_per_device: int
    speedup: float
    scaling_efficiency: float
    bottleneck: str
    max_speedup: float
    max_speedup_devices: int
    useful_devices: int
    memory: dict[str, float] = field(default_factory=dict)
    #: why the all-reduce algorithm is the one it is ("" without an all-reduce)
    algorithm_note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"] = self.cost.to_dict()
        d.update(self.cost.to_dict())
        return d


def _scaled(comp: Compute, factor: float) -> Compute:
    """``comp`` with every time multiplied by ``factor`` (a measured baseline's calibration)."""
    if factor == 1.0:
        return comp
    return Compute(flops_s=comp.flops_s * factor, traffic_s=comp.traffic_s * factor,
                   overhead_s=comp.overhead_s * factor, optimizer_s=comp.optimizer_s * factor,
                   forward_s=comp.forward_s * factor, backward_s=comp.backward_s * factor,
                   grad_ready_s=tuple(t * factor for t in comp.grad_ready_s))


def _with_recompute(comp: Compute, extra_s: float) -> Compute:
    """``comp`` with ``extra_s`` of recomputed forward at the start of backward (the gradients
    become ready that much later)."""
    if extra_s <= 0:
        return comp
    return Compute(flops_s=comp.flops_s, traffic_s=comp.traffic_s, overhead_s=comp.overhead_s,
                   optimizer_s=comp.optimizer_s, forward_s=comp.forward_s, backward_s=comp.backward_s + extra_s,
                   grad_ready_s=tuple(t + extra_s for t in comp.grad_ready_s))


def _offloaded_optimizer_s(facts: ModelFacts, plan: Plan, p: int) -> float:
    """FSDP with ``cpu_offload``: the optimizer steps the shard on the host."""
    key = optimizer_key(plan.optimizer, plan.momentum)
    return OPTIMIZER_BYTES[key] * facts.params / p / HOST_BANDWIDTH


def step_cost(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, p: int, batch: float) -> StepCost:
    """Time of one step on ``p`` devices with ``batch`` samples per device (per replica when
    the strategy is ``pipeline``)."""
    dev, ov = cluster.device, cluster.overheads
    k = plan.stages if plan.strategy == "pipeline" else 1
    m = plan.micro_batches or 4 * k
    call_batch = batch / m if plan.strategy == "pipeline" else batch
    shards = p if plan.sharded else k  # the optimizer steps this fraction of the parameters
    comp = _scaled(compute(facts, cluster, plan.precision, plan.optimizer, plan.momentum, batch, call_batch,
                           shards, plan.channels_last), plan.compute_scale)
    if plan.strategy == "fsdp" and plan.cpu_offload:
        comp = replace(comp, optimizer_s=_offloaded_optimizer_s(facts, plan, p) * plan.compute_scale)
    recompute = {u: t * plan.compute_scale for u, t in
                 recompute_seconds(facts, cluster, plan, _scaled(comp, 1 / plan.compute_scale), call_batch).items()}
    redo = sum(recompute.values())
    flops_s, traffic_s, overhead = comp.flops_s, comp.traffic_s, comp.overhead_s + comp.optimizer_s
    slow = 1.0
    busy = min(p, cluster.devices_per_node)
    if busy > 1 and dev.contention > 1:  # devices of one node slow each other down
        slow = 1 + (dev.contention - 1) * (busy - 1) / (cluster.devices_per_node - 1)
        flops_s, traffic_s, overhead = flops_s * slow, traffic_s * slow, overhead * slow
    redo *= slow
    replicas = p // k
    net = _comm.network(cluster, replicas)
    pipe_bw = pipe_lat = 0.0
    timed = _with_recompute(comp, redo / slow)
    if plan.strategy == "pipeline":
        bubble = (m + k - 1) / m
        flops_s, traffic_s, redo = flops_s / k * bubble, traffic_s / k * bubble, redo / k * bubble
        pipe_bw, pipe_lat = _comm.pipeline_p2p(k, batch / m, facts.boundary_bytes, _comm.network(cluster, k))
        if replicas > 1:
            name, (b, a) = _comm.allreduce(net, 4.0 * facts.params / k, plan.algorithm)
            a += ov.collective_s
            hideable = (cluster.overlap if plan.overlap is None else plan.overlap) * timed.backward_s * slow / k
            sent, node = _comm.volume(net, "allreduce", 4.0 * facts.params / k, name)
            comm = Comm(b, a, max(0.0, b + a - hideable), name, 1, {}, sent, node)
        else:
            comm = NO_COMM
    elif p <= 1 and plan.strategy != "ps":
        comm = NO_COMM
    elif plan.strategy in _DATA_PARALLEL:
        forced = replace(plan, algorithm="ring") if plan.strategy == "ring" else \
            replace(plan, algorithm="tree") if plan.strategy == "tree" else plan
        comm = allreduce_overlap(facts, cluster, forced, net, timed, slow)
    elif plan.strategy == "zero1":
        comm = zero1_comm(facts, cluster, plan, net, timed, slow)
    elif plan.strategy == "fsdp":
        comm = fsdp_comm(facts, cluster, plan, net, comp, slow, call_batch, {u: t * slow for u, t in recompute.items()})
    elif plan.strategy == "ps":
        m_ps = float(PRECISION_BYTES[plan.grad_dtype] * facts.params)
        b, a = _comm.parameter_server(net, plan.servers, m_ps)
        a += ov.collective_s if p > 1 else 0.0
        comm = Comm(b, a, b + a, "", 1 if p > 1 else 0, {}, 2 * m_ps if p > 1 else 0.0,
                    2 * m_ps * net.per_node if p > 1 and net.nodes > 1 else 0.0)
    else:  # easgd: every period steps one all-reduce of the fp32 parameters, after the step
        name, (b, a) = _comm.allreduce(net, 4.0 * facts.params, plan.algorithm)
        b, a = b / plan.period, (a + (ov.collective_s if p > 1 else 0.0)) / plan.period
        sent, node = _comm.volume(net, "allreduce", 4.0 * facts.params, name)
        comm = Comm(b, a, b + a, name, 1 if p > 1 else 0, {}, sent / plan.period, node / plan.period)
    compute_s = flops_s + traffic_s + overhead + redo
    wait = 0.0
    if p > 1 and ov.sync_wait:
        wait = ov.sync_wait_at(compute_s) * expected_max_normal(p) / expected_max_normal(2)
    elif p > 1 and ov.step_jitter > 0:
        wait = ov.step_jitter * compute_s * expected_max_normal(p)
    if plan.strategy == "easgd":  # one wait per period; a sum of tau steps spreads sqrt(tau)
        wait /= math.sqrt(plan.period)
    exposed = comm.exposed_s + pipe_bw + pipe_lat
    step = compute_s + exposed + wait
    loader = 0.0
    if cluster.loader_samples_per_s:
        loader = max(0.0, batch / cluster.loader_samples_per_s - step)
    return StepCost(
        compute_s=compute_s, flops_s=flops_s, memory_traffic_s=traffic_s, overhead_s=overhead,
        comm_bandwidth_s=comm.bandwidth_s + pipe_bw, comm_latency_s=comm.latency_s + pipe_lat,
        exposed_comm_s=exposed, step_s=step + loader, sync_wait_s=wait,
        forward_s=comp.forward_s * slow, backward_s=comp.backward_s * slow, optimizer_s=comp.optimizer_s * slow,
        loader_wait_s=loader, algorithm=comm.algorithm, collectives=comm.collectives,
        algorithm_costs=comm.per_algorithm, recompute_s=redo, bytes_per_step=comm.sent_bytes,
        network_bytes_per_node=comm.network_bytes, congestion=net.congestion,
    )


@lru_cache(maxsize=256)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normal draws] (0 for n = 1, 1/sqrt(pi) for n = 2), by
    integrating x n phi(x) Phi(x)^(n-1) on a fine grid."""
    if n <= 1:
        return 0.0
    step, total = 5e-3, 0.0
    for i in range(-1800, 1801):
        x = i * step
        phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * n * phi * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1)
    return total * step


def _candidates(limit: int, per_node: int, multiple: int) -> list[int]:
    out = {1 << i for i in range(limit.bit_length())}
    out |= {per_node << i for i in range(limit.bit_length())}
    out.add(limit)
    return sorted(q for q in out if q <= limit and q % multiple == 0)


def _bottleneck(cost: StepCost, fits: bool) -> str:
    if not fits:
        return "memory"
    share = cost.exposed_comm_s / cost.comm_s if cost.comm_s > 0 else 0.0
    parts = {"compute": cost.compute_s, "communication": cost.comm_bandwidth_s * share,
             "latency": cost.comm_latency_s * share + cost.sync_wait_s, "input": cost.loader_wait_s}
    return max(parts, key=lambda name: parts[name])


def _check_precision(facts: ModelFacts, plan: Plan) -> None:
    half = {"fp16", "bf16"}
    if (facts.precision in half or plan.precision in half) and facts.precision != plan.precision:
        raise OracleError(
            f"the model facts were measured at precision {facts.precision!r} but the plan asks for "
            f"{plan.precision!r}; measure the facts at the plan's precision "
            f"(model_facts(..., precision={plan.precision!r}))"
        )
    if facts.param_dtype != plan.compute_dtype:
        raise OracleError(
            f"the model facts were measured with parameters in {facts.param_dtype!r} but the plan computes in "
            f"{plan.compute_dtype!r} (FSDP's param_dtype); measure the facts with "
            f"model_facts(..., param_dtype={plan.compute_dtype!r})"
        )


def predict(facts: ModelFacts, cluster: ClusterSpec, plan: Plan) -> Prediction:
    """Predict one training configuration; raises :class:`OracleError` on an impossible plan."""
    plan = plan.validate(cluster)
    _check_precision(facts, plan)
    p = plan.devices or 1
    b = plan.batch_size
    k = plan.stages if plan.strategy == "pipeline" else 1
    cost = step_cost(facts, cluster, plan, p, b)
    global_batch = b * (p // k)
    throughput = global_batch / cost.step_s
    single = replace(plan, strategy="allreduce", devices=1)
    base = b / step_cost(facts, cluster, single, 1, b).step_s
    epoch_s = plan.dataset_size / global_batch * cost.step_s
    memory = memory_breakdown(facts, cluster, plan, b, p)
    fits = memory["total"] <= cluster.device.memory_bytes
    # strong scaling of the same global batch: the device count with the shortest step
    limit = min(global_batch * k, _SEARCH_LIMIT)
    t1 = step_cost(facts, cluster, replace(plan, strategy="allreduce"), 1, global_batch).step_s
    curve = [(q, t1 / step_cost(facts, cluster, plan, q, global_batch / (q // k)).step_s)
             for q in _candidates(limit, cluster.devices_per_node, k)]
    best_q, best = max(curve, key=lambda qs: qs[1])
    useful = min(q for q, s in curve if s >= 0.9 * best)
    return Prediction(
        model=facts.name, cluster=cluster.name, strategy=plan.strategy, devices=p,
        nodes=math.ceil(p / cluster.devices_per_node), batch_per_device=b,
        global_batch=global_batch, cost=cost, throughput=throughput, epoch_s=epoch_s,
        time_to_train_s=plan.epochs * epoch_s, memory_per_device_bytes=memory["total"],
        memory_available_bytes=cluster.device.memory_bytes, fits=fits,
        max_batch_per_device=max_batch(facts, cluster, plan, p),
        speedup=throughput / base, scaling_efficiency=throughput / base / p,
        bottleneck=_bottleneck(cost, fits), max_speedup=best, max_speedup_devices=best_q,
        useful_devices=useful, memory=memory,
        algorithm_note=_comm.explain(_comm.network(cluster, p // k), cost.algorithm) if cost.algorithm else "",
    )
