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
             + (saved activations x b + fixed saved bytes) x (1 + memory_overhead) / k + reserved

Speed-up is weak scaling (per-device batch fixed): throughput(p) / throughput(1). The maximum
speed-up is strong scaling of the same global batch G = p b over q devices (q <= G): the q with
the shortest step, which exists because compute shrinks as 1/q while communication does not.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any

from hpoflow.oracle import _comm
from hpoflow.oracle._compute import ACTIVATION_TRAFFIC, VIEW_KINDS, Compute, compute
from hpoflow.oracle.catalog import ALGORITHMS, PRECISION_BYTES, STRATEGIES
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import ModelFacts, optimizer_state_bytes

__all__ = ["ACTIVATION_TRAFFIC", "ALGORITHMS", "STRATEGIES", "VIEW_KINDS", "Plan", "Prediction", "StepCost",
           "ddp_buckets", "memory_breakdown", "predict", "step_cost"]

MIB = 2**20
DDP_FIRST_BUCKET_BYTES = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
_DATA_PARALLEL = ("allreduce", "ring", "tree")
_SEARCH_LIMIT = 1 << 17
GRAD_DTYPES = ("fp32", "fp16", "bf16")


@dataclass(frozen=True)
class Plan:
    """What to predict: strategy, sizes and training length (typed once by the CLI/API).

    ``algorithm`` forces the all-reduce algorithm of ``allreduce`` (``auto``: the fastest);
    ``grad_dtype`` is the all-reduce's dtype (``fp16``/``bf16``: DDP's compression hooks);
    ``bucket_mb`` is DDP's ``bucket_cap_mb`` (0: one all-reduce per parameter tensor);
    ``channels_last``: activations in NHWC (``memory_format=torch.channels_last``).
    """

    batch_size: int
    devices: int | None = None
    strategy: str = "allreduce"
    algorithm: str = "auto"
    optimizer: str = "sgd"
    momentum: float = 0.9
    precision: str = "fp32"
    grad_dtype: str = "fp32"
    bucket_mb: float = 25.0
    channels_last: bool = False
    overlap: float | None = None
    servers: int = 1
    period: int = 4
    stages: int = 2
    micro_batches: int | None = None
    dataset_size: int = 1_281_167
    epochs: float = 90.0
    reshard_after_forward: bool = True
    param_dtype: str = "fp32"
    cpu_offload: bool = False

    def validate(self, cluster: ClusterSpec) -> Plan:
        """This plan with ``devices`` filled in (None: every device of the cluster), or
        :class:`OracleError` naming the bad field, its value and the fix."""
        devices = cluster.total_devices if self.devices is None else self.devices
        checks: list[tuple[bool, str, object, str]] = [
            (self.strategy in STRATEGIES, "strategy", self.strategy, f"one of {', '.join(STRATEGIES)}"),
            (self.algorithm == "auto" or self.algorithm in ALGORITHMS, "algorithm", self.algorithm,
             f"auto or one of {', '.join(ALGORITHMS)}"),
            (self.precision in PRECISION_BYTES, "precision", self.precision, f"one of {', '.join(PRECISION_BYTES)}"),
            (self.grad_dtype in GRAD_DTYPES, "grad_dtype", self.grad_dtype, f"one of {', '.join(GRAD_DTYPES)}"),
            (self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1"),
            (1 <= devices <= cluster.total_devices, "devices", devices,
             f"between 1 and the {cluster.total_devices} devices of cluster {cluster.name!r}"),
            (self.servers >= 1, "servers", self.servers, "an integer >= 1"),
            (self.period >= 1, "period", self.period, "an integer >= 1"),
            (self.stages >= 1, "stages", self.stages, "an integer >= 1"),
            (self.micro_batches is None or self.micro_batches >= 1, "micro_batches", self.micro_batches,
             "an integer >= 1"),
            (self.strategy != "pipeline" or devices % self.stages == 0, "devices", devices,
             f"a multiple of the pipeline stages ({self.stages})"),
            (self.overlap is None or 0 <= self.overlap <= 1, "overlap", self.overlap, "in [0, 1]"),
            (self.bucket_mb >= 0, "bucket_mb", self.bucket_mb, ">= 0 (0: one all-reduce per parameter tensor)"),
            (self.dataset_size >= 1, "dataset_size", self.dataset_size, "an integer >= 1"),
            (self.epochs > 0, "epochs", self.epochs, "> 0"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise OracleError(f"{name} must be {rule}, but got {value!r}; change {name}")
        return replace(self, devices=devices)


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


@dataclass(frozen=True)
class _Comm:
    bandwidth_s: float
    latency_s: float
    exposed_s: float
    algorithm: str
    collectives: int
    per_algorithm: dict[str, float]


def _allreduce_overlap(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, net: _comm.Network, comp: Compute,
                       slow: float, elements_scale: float = 1.0) -> _Comm:
    """The bucket timeline of a data-parallel step (see the module docs)."""
    wire = PRECISION_BYTES[plan.grad_dtype]
    fixed = cluster.overheads.collective_s
    bw = lat = 0.0
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
    total = bw + lat
    timeline = max(0.0, end - backward)
    overlap = cluster.overlap if plan.overlap is None else plan.overlap
    exposed = overlap * min(timeline, total) + (1 - overlap) * total
    algorithm = max(moved, key=lambda a: moved[a]) if moved else ""
    return _Comm(bw, lat, exposed, algorithm, len(buckets), dict(per_algorithm))


def step_cost(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, p: int, batch: float) -> StepCost:
    """Time of one step on ``p`` devices with ``batch`` samples per device (per replica when
    the strategy is ``pipeline``)."""
    dev, ov = cluster.device, cluster.overheads
    k = plan.stages if plan.strategy == "pipeline" else 1
    m = plan.micro_batches or 4 * k
    call_batch = batch / m if plan.strategy == "pipeline" else batch
    comp = compute(facts, cluster, plan.precision, plan.optimizer, plan.momentum, batch, call_batch, k,
                   plan.channels_last)
    flops_s, traffic_s, overhead = comp.flops_s, comp.traffic_s, comp.overhead_s + comp.optimizer_s
    slow = 1.0
    busy = min(p, cluster.devices_per_node)
    if busy > 1 and dev.contention > 1:  # devices of one node slow each other down
        slow = 1 + (dev.contention - 1) * (busy - 1) / (cluster.devices_per_node - 1)
        flops_s, traffic_s, overhead = flops_s * slow, traffic_s * slow, overhead * slow
    replicas = p // k
    net = _comm.network(cluster, replicas)
    pipe_bw = pipe_lat = 0.0
    if plan.strategy == "pipeline":
        bubble = (m + k - 1) / m
        flops_s, traffic_s = flops_s / k * bubble, traffic_s / k * bubble
        pipe_bw, pipe_lat = _comm.pipeline_p2p(k, batch / m, facts.boundary_bytes, _comm.network(cluster, k))
        if replicas > 1:
            name, (b, a) = _comm.allreduce(net, 4.0 * facts.params / k, plan.algorithm)
            a += ov.collective_s
            hideable = (cluster.overlap if plan.overlap is None else plan.overlap) * comp.backward_s * slow / k
            comm = _Comm(b, a, max(0.0, b + a - hideable), name, 1, {})
        else:
            comm = _Comm(0.0, 0.0, 0.0, "", 0, {})
    elif plan.strategy in _DATA_PARALLEL:
        forced = replace(plan, algorithm="ring") if plan.strategy == "ring" else \
            replace(plan, algorithm="tree") if plan.strategy == "tree" else plan
        comm = _allreduce_overlap(facts, cluster, forced, net, comp, slow) if p > 1 else \
            _Comm(0.0, 0.0, 0.0, "", 0, {})
    elif plan.strategy == "ps":
        b, a = _comm.parameter_server(net, plan.servers, float(PRECISION_BYTES[plan.grad_dtype] * facts.params))
        a += ov.collective_s if p > 1 else 0.0
        comm = _Comm(b, a, b + a, "", 1 if p > 1 else 0, {})
    else:  # easgd: every period steps one all-reduce of the fp32 parameters, after the step
        name, (b, a) = _comm.allreduce(net, 4.0 * facts.params, plan.algorithm)
        b, a = b / plan.period, (a + (ov.collective_s if p > 1 else 0.0)) / plan.period
        comm = _Comm(b, a, b + a, name, 1 if p > 1 else 0, {})
    compute_s = flops_s + traffic_s + overhead
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
        algorithm_costs=comm.per_algorithm,
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


def memory_breakdown(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, batch: float, p: int) -> dict[str, float]:
    """Bytes per device by kind (see the module docs); ``total`` is their sum."""
    k = plan.stages if plan.strategy == "pipeline" else 1
    dev = cluster.device
    data_parallel = plan.strategy in (*_DATA_PARALLEL, "pipeline") and p // k > 1
    activations = facts.activation_bytes * batch + facts.activation_fixed_bytes
    parts = {
        "weights": facts.param_bytes / k,
        "gradients": facts.grad_bytes / k,
        # DDP keeps its own flat buckets beside .grad (gradient_as_bucket_view=False, the default)
        "ddp_buckets": facts.grad_bytes / k if data_parallel else 0.0,
        "optimizer_state": optimizer_state_bytes(facts.params, plan.optimizer, plan.momentum) / k,
        "activations": activations / k,
        "allocator": activations * dev.memory_overhead / k,
        "reserved": dev.reserved_bytes,
    }
    parts["total"] = sum(parts.values())
    return parts


def _max_batch(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, p: int) -> int:
    k = plan.stages if plan.strategy == "pipeline" else 1
    free = cluster.device.memory_bytes - memory_breakdown(facts, cluster, plan, 0, p)["total"]
    per_sample = facts.activation_bytes * (1 + cluster.device.memory_overhead) / k
    return max(0, int(free // per_sample)) if per_sample > 0 else 1 << 30


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
        max_batch_per_device=_max_batch(facts, cluster, plan, p),
        speedup=throughput / base, scaling_efficiency=throughput / base / p,
        bottleneck=_bottleneck(cost, fits), max_speedup=best, max_speedup_devices=best_q,
        useful_devices=useful, memory=memory,
        algorithm_note=_comm.explain(_comm.network(cluster, p // k), cost.algorithm) if cost.algorithm else "",
    )
