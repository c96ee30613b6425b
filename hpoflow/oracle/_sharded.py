"""Sharded data parallelism on the step's timeline: ZeRO-1 and FSDP, and activation recomputation.

**zero1** (``ZeroRedundancyOptimizer``): DDP's bucketed all-reduce of the gradients, overlapped
with backward as for ``allreduce`` (:mod:`hpoflow.oracle._ddp`); each rank steps the optimizer on
its 1/p share and broadcasts the updated share: an all-gather of the fp32 parameters after the
step, not hidden.

**fsdp** (FSDP2 ``fully_shard`` per unit, :func:`hpoflow.oracle._trace.sharding_units`, and the
root): the traced kernels, grouped into runs of one unit, are laid on a timeline with one
collective at a time on the network:

* forward: the root's parameters are all-gathered first; each unit's all-gather must end before
  its first kernel; the next unit's all-gather is issued when a unit starts (FSDP2 prefetches one
  unit ahead);
* backward (units in reverse): with ``reshard_after_forward`` every unit is gathered again (the
  root too with ``reshard_root``: FSDP2 keeps the root gathered unless told), the next one issued
  when a unit's backward starts; a unit's gradients are reduce-scattered
  when its last backward kernel ends, the root's at the end of backward;
* the step ends when backward and the last reduce-scatter have; what the collectives add beyond
  the compute is exposed.

All-gathers move ``param_dtype`` bytes, reduce-scatters ``reduce_dtype`` bytes (by default the
same, as FSDP2's ``MixedPrecisionPolicy``). ``cpu_offload`` adds the
shard's copy over PCIe (``PCIE_BANDWIDTH``) to every all-gather and reduce-scatter and runs the
optimizer on the host (``HOST_BANDWIDTH`` per process): estimates, marked so in docs/oracle.md.

**Activation checkpointing** recomputes, at the start of a unit's backward, the forward kernels
whose outputs were not kept (:func:`recompute_seconds`).
"""

from __future__ import annotations

from dataclasses import dataclass

from hpoflow.oracle import _comm
from hpoflow.oracle._compute import Compute, _kernel_times
from hpoflow.oracle._ddp import Comm, allreduce_overlap
from hpoflow.oracle.catalog import PRECISION_BYTES
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.facts import ModelFacts
from hpoflow.oracle.plan import Plan

__all__ = ["HOST_BANDWIDTH", "PCIE_BANDWIDTH", "fsdp_comm", "recompute_seconds", "zero1_comm"]

PCIE_BANDWIDTH = 31.5e9  # PCIe 4.0 x16 per direction (catalogue ``pcie4``): offloaded shards cross it
HOST_BANDWIDTH = 25e9  # estimate: a host's memory bandwidth shared by its GPUs' processes (CPU Adam)


def zero1_comm(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, net: _comm.Network, comp: Compute,
               slow: float) -> Comm:
    """DDP's all-reduce (overlapped) plus the updated parameters' all-gather after the step."""
    ddp = allreduce_overlap(facts, cluster, plan, net, comp, slow)
    m = 4.0 * facts.params
    b, a = _comm.allgather(net, m)
    a += cluster.overheads.collective_s
    sent, node = _comm.volume(net, "broadcast_shards", m)
    return Comm(ddp.bandwidth_s + b, ddp.latency_s + a, ddp.exposed_s + b + a, ddp.algorithm,
                ddp.collectives + 1, ddp.per_algorithm, ddp.sent_bytes + sent, ddp.network_bytes + node)


def _shares(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, call_batch: float) -> list[float]:
    """Roofline seconds of every traced kernel: how a step's time divides among kernels."""
    return [t for t, _ in _kernel_times(facts, cluster.device, plan.precision, call_batch, plan.channels_last)]


def recompute_seconds(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, comp: Compute,
                      call_batch: float) -> dict[int, float]:
    """Seconds of forward each unit recomputes in backward under the plan's checkpointing policy
    (its share of ``comp.forward_s``); empty without checkpointing or units."""
    trace = facts.trace
    if plan.activation_checkpointing == "none" or trace is None or not trace.units:
        return {}
    shares = _shares(facts, cluster, plan, call_batch)
    first = trace.forward_kernels
    total = sum(shares[:first])
    if total <= 0:
        return {}
    out: dict[int, float] = {}
    for k, t in zip(trace.kernels[:first], shares[:first], strict=True):
        u = k.unit
        if u < 0:
            continue
        redo = not k.kept if plan.activation_checkpointing == "op" else u % plan.checkpoint_interval == 0
        if redo:
            out[u] = out.get(u, 0.0) + t / total * comp.forward_s
    return out


@dataclass
class _Channel:
    """The network, one collective at a time in the order they are issued."""

    free_at: float = 0.0
    bandwidth_s: float = 0.0
    latency_s: float = 0.0
    sent: float = 0.0
    network: float = 0.0
    count: int = 0

    def run(self, at: float, cost: tuple[float, float], extra_s: float, volume: tuple[float, float]) -> float:
        start = max(at, self.free_at)
        self.free_at = start + cost[0] + cost[1] + extra_s
        self.bandwidth_s += cost[0] + extra_s
        self.latency_s += cost[1]
        self.sent, self.network = self.sent + volume[0], self.network + volume[1]
        self.count += 1
        return self.free_at


def _runs(units: list[int], seconds: list[float]) -> list[tuple[int, float, bool]]:
    """Consecutive kernels of one unit merged: (unit, seconds, last run of that unit)."""
    runs: list[list[float]] = []
    for u, t in zip(units, seconds, strict=True):
        if runs and runs[-1][0] == u:
            runs[-1][1] += t
        else:
            runs.append([u, t])
    last = {int(u): i for i, (u, _) in enumerate(runs)}
    return [(int(u), t, last[int(u)] == i) for i, (u, t) in enumerate(runs)]


def fsdp_comm(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, net: _comm.Network, comp: Compute,
              slow: float, call_batch: float, recompute: dict[int, float]) -> Comm:
    """FSDP's all-gathers and reduce-scatters on the step's timeline (see the module docs)."""
    trace = facts.trace
    if net.p <= 1:
        return Comm(0.0, 0.0, 0.0, "", 0)
    wire = PRECISION_BYTES[plan.param_dtype]
    reduce_wire = PRECISION_BYTES[plan.reduce_dtype or plan.param_dtype]
    fixed = cluster.overheads.collective_s
    if trace is None or not trace.units:  # one unit: gather everything, compute, reduce-scatter
        m, g = wire * facts.params, reduce_wire * facts.params
        ag, rs = _comm.allgather(net, m), _comm.reduce_scatter(net, g)
        ag = (ag[0], ag[1] + fixed)
        rs = (rs[0], rs[1] + fixed)
        sent = _comm.volume(net, "allgather", m)[0] + _comm.volume(net, "reduce_scatter", g)[0]
        node = _comm.volume(net, "allgather", m)[1] + _comm.volume(net, "reduce_scatter", g)[1]
        return Comm(ag[0] + rs[0], ag[1] + rs[1], sum(ag) + sum(rs), "ring", 2, {}, sent, node)
    params = {u: x.params for u, x in enumerate(trace.units)}
    params[-1] = trace.root_params
    offload = plan.cpu_offload

    def collective(kind: str, u: int) -> tuple[tuple[float, float], float, tuple[float, float]]:
        m = (wire if kind == "allgather" else reduce_wire) * params[u]
        b, a = _comm.allgather(net, m) if kind == "allgather" else _comm.reduce_scatter(net, m)
        extra = 4.0 * params[u] / net.p / PCIE_BANDWIDTH if offload else 0.0
        return (b, a + fixed), extra, _comm.volume(net, kind, m)

    shares = _shares(facts, cluster, plan, call_batch)
    first = trace.forward_kernels
    f_total, b_total = sum(shares[:first]) or 1.0, sum(shares[first:]) or 1.0
    fwd = _runs([k.unit for k in trace.kernels[:first]],
                [t / f_total * comp.forward_s * slow for t in shares[:first]])
    bwd = _runs([k.unit for k in trace.kernels[first:]],
                [t / b_total * comp.backward_s * slow for t in shares[first:]])
    net_ch = _Channel()
    gathered: dict[int, float] = {}

    def gather(u: int, at: float) -> float:
        if u not in gathered:
            gathered[u] = net_ch.run(at, *collective("allgather", u)) if params[u] > 0 else at
        return gathered[u]

    # forward: the root first, then units in the order they run, one prefetched ahead
    order = list(dict.fromkeys(u for u, _, _ in fwd if u >= 0))
    after = {u: order[i + 1] for i, u in enumerate(order[:-1])}
    t = 0.0
    gather(-1, 0.0)
    if order:
        gather(order[0], 0.0)
    started: set[int] = set()
    for u, seconds, _ in fwd:
        t = max(t, gather(u, t))
        if u >= 0 and u not in started:
            started.add(u)
            if u in after:
                gather(after[u], t)
        t += seconds
    forward_end = t
    # backward: units again (resharded), prefetched one ahead; reduce-scatter after each unit's last kernel
    border = list(dict.fromkeys(u for u, _, _ in bwd if u >= 0))
    bafter = {u: border[i + 1] for i, u in enumerate(border[:-1])}
    if plan.reshard_after_forward:
        for u in border:
            gathered.pop(u, None)
        if plan.reshard_root:
            gathered.pop(-1, None)
            gather(-1, forward_end)
        if border:
            gather(border[0], forward_end)
    started.clear()
    for u, seconds, last in bwd:
        t = max(t, gather(u, t)) if u >= 0 else t
        if u >= 0 and u not in started:
            started.add(u)
            if u in bafter and plan.reshard_after_forward:
                gather(bafter[u], t)
            seconds += recompute.get(u, 0.0)
        t += seconds
        if u >= 0 and last and params[u] > 0:
            net_ch.run(t, *collective("reduce_scatter", u))
    if params[-1] > 0:
        net_ch.run(t, *collective("reduce_scatter", -1))
    compute_s = comp.forward_s * slow + comp.backward_s * slow + sum(recompute.values())
    exposed = max(0.0, max(t, net_ch.free_at) - compute_s)
    return Comm(net_ch.bandwidth_s, net_ch.latency_s, exposed, "ring", net_ch.count, {}, net_ch.sent,
                net_ch.network)
