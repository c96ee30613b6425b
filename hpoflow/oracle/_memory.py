"""Memory per device: model state (replicated or sharded), activations under a checkpointing
policy, FSDP's gathered units, the allocator's overhead and what the framework reserves.

Per device (``p`` data-parallel devices, ``k`` pipeline stages, ``P`` parameters; fp32 state):

* **replicated** (allreduce, ring, tree, ps, easgd, pipeline): weights ``4P/k``, gradients ``4P/k``,
  DDP's buckets ``4P/k`` (beside ``.grad`` unless ``gradient_as_bucket_view``; only with peers),
  optimizer state ``S/k`` (SGD 0, momentum 4P, Adam 8P);
* **zero1**: as replicated, but optimizer state ``S/p`` (``ZeroRedundancyOptimizer``);
* **fsdp**: weights ``4P/p``, gradients ``4P/p``, optimizer state ``S/p`` (sharded; in host memory
  with ``cpu_offload``), plus the **gathered** parameters in ``param_dtype``: the root unit's for
  the whole step (FSDP2 does not reshard the root after forward unless ``reshard_root``) and, with
  ``reshard_after_forward``, two units at a time (the one computing and the one prefetched);
  without it every unit stays gathered from its forward to its backward. Plus one unit's
  unsharded gradients (in ``param_dtype``) and the copy of them FSDP reduce-scatters (in
  ``reduce_dtype``), which exist together before its reduce-scatter.

**Start-up** (``startup``, before the first step: the model built and wrapped) is priced as the
step is, and the memory per device is the larger of the two: a replicated model (and ``zero1``'s) is
built whole (``4P/k``), and DDP's first broadcast of it from rank 0 copies it into buckets of up to
250 MiB (``min(4P/k, 250 MiB)``, with peers); ``fsdp`` builds each rank's shard only (the trainer's
``hpoflow.train.strategies._sharded_init``): the shards (``4P/p``, in host memory with
``cpu_offload``) plus one tensor whole at a time (the largest parameter, ``4·max tensor``: the
scratch its random initialisation runs on). Plus ``reserved`` in both.

**Activations** are the bytes autograd saves (the trace, per sample and fixed) plus the most bytes
backward's own tensors (activation gradients) hold at once, on top of them. Activation
checkpointing changes the saved part per unit (:attr:`hpoflow.oracle._trace.StepTrace.units`):
``full`` keeps only the input of every ``checkpoint_interval``-th unit; ``op`` keeps each unit's
input and the outputs of every other matrix product and of attention (torchtitan's selective
policy); on top of that, the larger of backward's gradients and one unit's other saved tensors
while it is recomputed. Autocast's 16-bit copies of parameters are not made when
FSDP gathers parameters in a 16-bit ``param_dtype`` (the model is traced in that dtype).
"""

from __future__ import annotations

from hpoflow.oracle.catalog import PRECISION_BYTES
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.facts import ModelFacts, optimizer_state_bytes
from hpoflow.oracle.plan import Plan

__all__ = ["activation_bytes", "max_batch", "memory_breakdown", "saved_bytes", "startup_bytes"]

_REPLICATED_WITH_BUCKETS = ("allreduce", "ring", "tree", "pipeline", "zero1")
#: DDP's ``broadcast_bucket_size``: its first broadcast of the model from rank 0 goes in buckets this big
DDP_BROADCAST_BUCKET = 250 * 2**20


def startup_bytes(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, p: int) -> float:
    """Bytes per device while the model is built and wrapped, before the first step (module docs)."""
    k = plan.stages if plan.strategy == "pipeline" else 1
    if plan.strategy == "fsdp":
        shards = 0.0 if plan.cpu_offload else facts.param_bytes / p
        return shards + 4.0 * facts.largest_param_tensor + cluster.device.reserved_bytes
    broadcast = min(facts.param_bytes / k, DDP_BROADCAST_BUCKET) if plan.strategy in _REPLICATED_WITH_BUCKETS \
        and p // k > 1 else 0.0
    return facts.param_bytes / k + broadcast + cluster.device.reserved_bytes


def activation_bytes(facts: ModelFacts, plan: Plan) -> tuple[float, float]:
    """(bytes per sample, fixed bytes) of activations at the peak of a step, under the plan's
    activation checkpointing policy (see the module docs)."""
    trace = facts.trace
    transient = (trace.transient_bytes, trace.transient_fixed_bytes) if trace is not None else (0.0, 0.0)
    per, fixed = saved_bytes(facts, plan)
    recompute = _recompute_peak(facts, plan)
    return per + max(transient[0], recompute[0]), fixed + max(transient[1], recompute[1])


def _recompute_peak(facts: ModelFacts, plan: Plan) -> tuple[float, float]:
    """The most one unit's recomputation holds again in backward (its saved tensors it did not
    keep): (per sample, fixed); 0 without checkpointing."""
    trace = facts.trace
    policy = plan.activation_checkpointing
    if policy == "none" or trace is None:
        return 0.0, 0.0
    peak_per = peak_fixed = 0.0
    for i, u in enumerate(trace.units):
        if policy == "full" and i % plan.checkpoint_interval:
            continue
        keep_per, keep_fixed = (u.kept + u.input, u.kept_fixed + u.input_fixed) if policy == "op" \
            else (u.input, u.input_fixed)
        peak_per, peak_fixed = max(peak_per, u.saved - keep_per), max(peak_fixed, u.saved_fixed - keep_fixed)
    return peak_per, peak_fixed


def saved_bytes(facts: ModelFacts, plan: Plan) -> tuple[float, float]:
    """(bytes per sample, fixed bytes) held from forward to backward: autograd's saved tensors, or
    under checkpointing what each checkpointed unit keeps instead of them."""
    per, fixed = float(facts.activation_bytes), float(facts.activation_fixed_bytes)
    trace = facts.trace
    policy = plan.activation_checkpointing
    if policy == "none" or trace is None or not trace.units:
        return per, fixed
    for i, u in enumerate(trace.units):
        if policy == "full" and i % plan.checkpoint_interval:
            continue
        keep_per, keep_fixed = (u.kept + u.input, u.kept_fixed + u.input_fixed) if policy == "op" \
            else (u.input, u.input_fixed)
        per += keep_per - u.saved
        fixed += keep_fixed - u.saved_fixed
    return max(0.0, per), max(0.0, fixed)


def _gathered(facts: ModelFacts, plan: Plan) -> tuple[float, float]:
    """(gathered parameter bytes, unsharded gradient bytes) FSDP holds at its peak: the gradients of
    the largest unit twice, computed (``param_dtype``) and copied for the reduce-scatter (``reduce_dtype``)."""
    trace = facts.trace
    wire = PRECISION_BYTES[plan.param_dtype]
    grads = wire + PRECISION_BYTES[plan.reduce_dtype or plan.param_dtype]
    if trace is None or not trace.units:
        return wire * facts.params, grads * facts.params
    sizes = sorted((u.params for u in trace.units), reverse=True)
    root = trace.root_params
    if plan.reshard_after_forward and plan.reshard_root:  # the root is one more unit
        sizes, root = sorted([*sizes, root], reverse=True), 0
    units = sum(sizes[:2]) if plan.reshard_after_forward else sum(sizes)
    return wire * (root + units), grads * max(sizes[0], root)


def memory_breakdown(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, batch: float, p: int) -> dict[str, float]:
    """Bytes per device by kind at the step's peak (see the module docs), ``step`` their sum,
    ``startup`` the start-up's peak, and ``total`` the larger of the two."""
    k = plan.stages if plan.strategy == "pipeline" else 1
    dev = cluster.device
    per, fixed = activation_bytes(facts, plan)
    if plan.strategy == "fsdp" and plan.param_dtype != "fp32" and facts.trace is not None:
        fixed = max(0.0, fixed - facts.trace.saved_weight_copy_bytes)  # no autocast copies to keep
    activations = per * batch + fixed
    state = optimizer_state_bytes(facts.params, plan.optimizer, plan.momentum)
    parts = {"weights": facts.param_bytes / k, "gradients": facts.grad_bytes / k, "ddp_buckets": 0.0,
             "optimizer_state": state / k, "gathered_params": 0.0, "gathered_grads": 0.0}
    if plan.strategy in _REPLICATED_WITH_BUCKETS and p // k > 1:
        # DDP keeps its own flat buckets beside .grad (gradient_as_bucket_view=False, the default)
        parts["ddp_buckets"] = facts.grad_bytes / k
    if plan.strategy == "zero1":
        parts["optimizer_state"] = state / p
    elif plan.strategy == "fsdp":
        offload = 0.0 if plan.cpu_offload else 1.0
        parts.update(weights=offload * facts.param_bytes / p, gradients=offload * facts.grad_bytes / p,
                     optimizer_state=offload * state / p)
        parts["gathered_params"], parts["gathered_grads"] = _gathered(facts, plan)
    parts["activations"] = activations / k
    parts["allocator"] = activations * dev.memory_overhead / k
    parts["reserved"] = dev.reserved_bytes
    step = sum(parts.values())
    parts["step"] = step
    parts["startup"] = startup_bytes(facts, cluster, plan, p)
    parts["total"] = max(step, parts["startup"])
    return parts


def max_batch(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, p: int) -> int:
    """The largest batch per device whose memory fits the device (0: not even one sample, or the
    start-up does not fit)."""
    k = plan.stages if plan.strategy == "pipeline" else 1
    empty = memory_breakdown(facts, cluster, plan, 0, p)
    if empty["startup"] > cluster.device.memory_bytes:
        return 0
    free = cluster.device.memory_bytes - empty["step"]
    per_sample = activation_bytes(facts, plan)[0] * (1 + cluster.device.memory_overhead) / k
    return max(0, int(free // per_sample)) if per_sample > 0 else 1 << 30
