"""Predictions per parallelism strategy: step time, time-to-train, memory, bottleneck, speed-up.

One training step on each device (``b`` samples per device, ``p`` devices):

* compute   = 3 F b / R  +  T a b / W  +  overheads
  (F forward FLOPs per sample, R sustained FLOP/s, a activation bytes per sample, W memory
  bandwidth, T = :data:`ACTIVATION_TRAFFIC` passes over the activations; overheads = per step +
  per dispatched operator x operators + per parameter tensor x tensors + per
  convolution layer x layers + optimizer cost per parameter x parameters). With a device
  ``efficiency_table`` (fp32), each linear and conv layer's FLOP time is its training FLOPs over
  peak x the table's efficiency at its FLOPs per call (log-log interpolation); conv layers priced
  so pay no separate per-layer cost (the table's efficiencies include it). With a device
  ``layer_cost`` table (fp32), each memory-bound layer of a kind in the table (ReLU, pooling,
  normalisation, ...) costs its input elements x the table's seconds per element at its elements
  per call, and its output leaves the activation traffic term. Without tables, exactly the
  formula above.
* comm      = strategy's alpha-beta cost (:mod:`hpoflow.oracle._comm`)
* exposed   = max(0, comm - overlap x backward), backward = 2/3 of the FLOP and memory time
* wait      = sync_wait(compute) x E[max of p normals] / E[max of 2 normals]  (p > 1; divided by
  sqrt(period) for EASGD): the wait of a synchronous step measured on 2 devices, interpolated
  at this step's compute time
* step      = compute + exposed + wait; throughput = p b / step; epoch = N / (p b) x step
* memory    = (weights + grads + optimizer state) / k + a b / k + reserved   (k pipeline stages)

Speed-up is weak scaling (per-device batch fixed): throughput(p) / throughput(1). The maximum
speed-up is strong scaling of the same global batch G = p b over q devices (q <= G): the q with
the shortest step, which exists because compute shrinks as 1/q while communication does not.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from functools import lru_cache
from typing import Any

from hpoflow.oracle import _comm
from hpoflow.oracle.catalog import PRECISION_BYTES, STRATEGIES
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import ModelFacts, optimizer_state_bytes

__all__ = ["ACTIVATION_TRAFFIC", "STRATEGIES", "Plan", "Prediction", "StepCost", "predict",
           "step_cost"]

ACTIVATION_TRAFFIC = 4  # forward write + read, backward gradient write + read
#: layers whose output is a view of their input: no time and no traffic when a device has a
#: ``layer_cost`` table (without one, every leaf output counts as traffic, as before)
VIEW_KINDS = ("flatten", "unflatten", "identity")
DDP_BUCKET_BYTES = 25 * 2**20  # torch DDP's default bucket_cap_mb: one all-reduce per bucket
_SEARCH_LIMIT = 1 << 17


@dataclass(frozen=True)
class Plan:
    """What to predict: strategy, sizes and training length (typed once by the CLI/API)."""

    batch_size: int
    devices: int | None = None
    strategy: str = "ring"
    optimizer: str = "sgd"
    momentum: float = 0.9
    precision: str = "fp32"
    overlap: float | None = None
    servers: int = 1
    period: int = 4
    stages: int = 2
    micro_batches: int | None = None
    dataset_size: int = 1_281_167
    epochs: float = 90.0

    def validate(self, cluster: ClusterSpec) -> Plan:
        """This plan with ``devices`` filled in, or :class:`OracleError` naming the bad field."""
        devices = cluster.total_devices if self.devices is None else self.devices  # 0 is an error, not "all"
        checks = [
            (self.strategy in STRATEGIES, "strategy", f"one of {', '.join(STRATEGIES)}", self.strategy),
            (self.batch_size >= 1, "batch_size", "an integer >= 1", self.batch_size),
            (1 <= devices <= cluster.total_devices, "devices",
             f"between 1 and the {cluster.total_devices} devices of cluster {cluster.name!r}", devices),
            (self.servers >= 1, "servers", "an integer >= 1", self.servers),
            (self.period >= 1, "period", "an integer >= 1", self.period),
            (self.stages >= 1, "stages", "an integer >= 1", self.stages),
            (self.strategy != "pipeline" or devices % self.stages == 0, "devices",
             f"a multiple of the pipeline stages ({self.stages})", devices),
            (self.overlap is None or 0 <= self.overlap <= 1, "overlap", "in [0, 1]", self.overlap),
            (self.dataset_size >= 1, "dataset_size", "an integer >= 1", self.dataset_size),
            (self.epochs > 0, "epochs", "> 0", self.epochs),
        ]
        for ok, field, rule, value in checks:
            if not ok:
                raise OracleError(f"{field} must be {rule}, but got {value!r}; change {field}")
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

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["cost"] = self.cost.to_dict()
        d.update(self.cost.to_dict())
        return d


def step_cost(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, p: int,
              batch: float) -> StepCost:
    """Time of one step on ``p`` devices with ``batch`` samples per device (per replica when
    the strategy is ``pipeline``)."""
    dev, ov = cluster.device, cluster.overheads
    k = plan.stages if plan.strategy == "pipeline" else 1
    call_batch = batch / (plan.micro_batches or 4 * k) if plan.strategy == "pipeline" else batch
    flops_s = _flops_time(facts, cluster, plan.precision, batch, call_batch)
    layer_s, priced_bytes = _layer_time(facts, cluster, plan.precision, batch, call_batch)
    traffic_s = layer_s + ACTIVATION_TRAFFIC * max(0.0, facts.activation_bytes - priced_bytes) * batch \
        / dev.memory_bandwidth
    overhead = ov.step_s + ov.per_op_s * facts.ops_per_step + \
        ov.per_param_tensor_s * facts.param_tensors + ov.per_conv_s * _unpriced_convs(facts, cluster, plan.precision) \
        + ov.optimizer_cost(plan.optimizer, plan.momentum) * facts.params / k
    m_bytes = float(facts.grad_bytes)
    buckets = max(1, math.ceil(m_bytes / DDP_BUCKET_BYTES))
    bw, alpha = _comm.slowest_link(cluster, p)
    pipe_bw = pipe_lat = 0.0
    if plan.strategy == "pipeline":
        m = plan.micro_batches or 4 * k
        bubble = (m + k - 1) / m
        flops_s, traffic_s = flops_s / k * bubble, traffic_s / k * bubble
        stage_bw, stage_alpha = _comm.slowest_link(cluster, k)
        pipe_bw, pipe_lat = _comm.pipeline_p2p(k, batch / m, facts.boundary_bytes, stage_bw,
                                               stage_alpha)
        replicas = p // k
        comm = _comm.ring_allreduce(replicas, m_bytes / k, bw, alpha, buckets)
    elif plan.strategy == "ring":
        comm = _comm.ring_allreduce(p, m_bytes, bw, alpha, buckets)
    elif plan.strategy == "tree":
        comm = _comm.tree_allreduce(p, m_bytes, bw, alpha, buckets)
    else:
        comm = _comm.parameter_server(cluster, p, plan.servers, m_bytes)
        if plan.strategy == "easgd":
            comm = (comm[0] / plan.period, comm[1] / plan.period)
    collectives = (buckets if plan.strategy in ("ring", "tree", "pipeline") else 1) \
        if p // k > 1 else 0
    c_bw, c_lat = comm[0], comm[1] + ov.collective_s * collectives
    if plan.strategy == "easgd":
        c_lat = comm[1] + ov.collective_s * collectives / plan.period
    overlap = cluster.overlap if plan.overlap is None else plan.overlap
    busy = min(p, cluster.devices_per_node)
    if busy > 1 and dev.contention > 1:  # devices of one node slow each other down
        slow = 1 + (dev.contention - 1) * (busy - 1) / (cluster.devices_per_node - 1)
        flops_s, traffic_s, overhead = flops_s * slow, traffic_s * slow, overhead * slow
    hideable = overlap * 2 / 3 * (flops_s + traffic_s)
    total = c_bw + c_lat
    exposed = max(0.0, total - hideable)
    share = exposed / total if total > 0 else 0.0
    exposed_bw, exposed_lat = c_bw * share + pipe_bw, c_lat * share + pipe_lat
    compute = flops_s + traffic_s + overhead
    wait = 0.0
    if p > 1 and ov.sync_wait:
        wait = ov.sync_wait_at(compute) * expected_max_normal(p) / expected_max_normal(2)
        if plan.strategy == "easgd":  # one wait per period; a sum of tau steps spreads sqrt(tau)
            wait /= math.sqrt(plan.period)
    return StepCost(
        compute_s=compute, flops_s=flops_s, memory_traffic_s=traffic_s, overhead_s=overhead,
        comm_bandwidth_s=c_bw + pipe_bw, comm_latency_s=c_lat + pipe_lat,
        exposed_comm_s=exposed_bw + exposed_lat, step_s=compute + exposed_bw + exposed_lat + wait,
        sync_wait_s=wait,
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


def _layer_time(facts: ModelFacts, cluster: ClusterSpec, precision: str, batch: float,
                call_batch: float) -> tuple[float, float]:
    """(seconds of the memory-bound layers the device's ``layer_cost`` table prices, their
    output bytes per sample, which leave the activation traffic term)."""
    dev = cluster.device
    if not dev.layer_cost:
        return 0.0, 0.0
    seconds = priced = 0.0
    for kind, n_in, n_out, calls in facts.other_layers:
        # a view moves no data; other kinds cost what the table says, if it lists them
        cost = 0.0 if kind in VIEW_KINDS else dev.element_cost(kind, n_in * call_batch, precision)
        if cost is None:
            continue
        seconds += cost * n_in * calls * batch
        priced += n_out * calls * PRECISION_BYTES[facts.precision]
    return seconds, priced


def _unpriced_convs(facts: ModelFacts, cluster: ClusterSpec, precision: str) -> int:
    """Convolution layers that pay ``per_conv_s``: all of them, unless the device's conv
    efficiency table prices them (its efficiencies include a call's fixed cost)."""
    if facts.layers and cluster.device.layer_efficiency("conv", 1.0, precision) is not None:
        return 0
    return facts.conv_layers


def _flops_time(facts: ModelFacts, cluster: ClusterSpec, precision: str, batch: float,
                call_batch: float) -> float:
    """Seconds of FLOPs for ``batch`` samples: per layer from the device's efficiency table
    (by the layer's training FLOPs per call at ``call_batch`` samples) where it has one, the rest
    at the per-kind efficiency; without a table exactly ``train FLOPs / sustained FLOP/s``."""
    dev = cluster.device
    if not dev.efficiency_table or not facts.layers:
        return facts.train_flops * batch / dev.flops(precision, facts.conv_flops_fraction)
    peak = dev.peak_flops.get(precision, dev.peak_flops["fp32"])
    eff, ceff = dev.kind_efficiency(precision)
    conv_rest = facts.forward_flops * facts.conv_flops_fraction
    other_rest = facts.forward_flops - conv_rest
    seconds = 0.0
    for kind, fwd, calls in facts.layers:
        e = dev.layer_efficiency(kind, 3 * fwd * call_batch, precision)
        if e is None:
            continue
        seconds += 3 * fwd * calls * batch / (peak * e)
        if kind == "conv":
            conv_rest -= fwd * calls
        else:
            other_rest -= fwd * calls
    rest = max(0.0, conv_rest) / ceff + max(0.0, other_rest) / eff
    return seconds + 3 * batch * rest / peak


def _memory(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, batch: float) -> float:
    k = plan.stages if plan.strategy == "pipeline" else 1
    static = facts.param_bytes + facts.grad_bytes + \
        optimizer_state_bytes(facts.params, plan.optimizer, plan.momentum)
    return static / k + facts.activation_bytes * batch / k + cluster.device.reserved_bytes


def _max_batch(facts: ModelFacts, cluster: ClusterSpec, plan: Plan) -> int:
    k = plan.stages if plan.strategy == "pipeline" else 1
    free = cluster.device.memory_bytes - _memory(facts, cluster, plan, 0)
    per_sample = facts.activation_bytes / k
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
             "latency": cost.comm_latency_s * share + cost.sync_wait_s}
    return max(parts, key=lambda name: parts[name])


def predict(facts: ModelFacts, cluster: ClusterSpec, plan: Plan) -> Prediction:
    """Predict one training configuration; raises :class:`OracleError` on an impossible plan."""
    plan = plan.validate(cluster)
    p = plan.devices or 1
    b = plan.batch_size
    k = plan.stages if plan.strategy == "pipeline" else 1
    cost = step_cost(facts, cluster, plan, p, b)
    global_batch = b * (p // k)
    throughput = global_batch / cost.step_s
    single = replace(plan, strategy="ring", devices=1)
    base = b / step_cost(facts, cluster, single, 1, b).step_s
    epoch_s = plan.dataset_size / global_batch * cost.step_s
    mem = _memory(facts, cluster, plan, b)
    fits = mem <= cluster.device.memory_bytes
    # strong scaling of the same global batch: the device count with the shortest step
    limit = min(global_batch * k, _SEARCH_LIMIT)
    t1 = step_cost(facts, cluster, replace(plan, strategy="ring"), 1, global_batch).step_s
    curve = [(q, t1 / step_cost(facts, cluster, plan, q, global_batch / (q // k)).step_s)
             for q in _candidates(limit, cluster.devices_per_node, k)]
    best_q, best = max(curve, key=lambda qs: qs[1])
    useful = min(q for q, s in curve if s >= 0.9 * best)
    return Prediction(
        model=facts.name, cluster=cluster.name, strategy=plan.strategy, devices=p,
        nodes=math.ceil(p / cluster.devices_per_node), batch_per_device=b,
        global_batch=global_batch, cost=cost, throughput=throughput, epoch_s=epoch_s,
        time_to_train_s=plan.epochs * epoch_s, memory_per_device_bytes=mem,
        memory_available_bytes=cluster.device.memory_bytes, fits=fits,
        max_batch_per_device=_max_batch(facts, cluster, plan),
        speedup=throughput / base, scaling_efficiency=throughput / base / p,
        bottleneck=_bottleneck(cost, fits), max_speedup=best, max_speedup_devices=best_q,
        useful_devices=useful,
    )
