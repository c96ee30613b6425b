"""What to change, with the predicted gain: the oracle's answer after naming the bottleneck.

Each candidate is the same plan with one change, predicted the same way (step time and memory);
a change is advised when it makes a plan that does not fit fit, or when it raises samples/s by at
least :data:`MIN_GAIN`:

* does not fit: the largest batch that fits; activation checkpointing (``op``, ``full``), sharding
  (``fsdp``, ``zero1``) and the two together, each with the largest batch that fits when the
  plan's batch does not; 16-bit mixed precision;
* fits: a larger batch (twice, if it fits: the global batch changes, so the learning rate needs
  retuning); DDP's bucket size (the best of 1 to 200 MiB); channels-last activations (tensor-core
  convolutions skip their transposes); 16-bit mixed precision on a device whose 16-bit peak is
  higher; FSDP without resharding after forward; no activation checkpointing when it fits
  without.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from hpoflow.oracle._memory import max_batch
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import ModelFacts
from hpoflow.oracle.model import Prediction, memory_breakdown, step_cost
from hpoflow.oracle.plan import Plan

__all__ = ["MIN_GAIN", "Advice", "advise"]

MIN_GAIN = 0.03
_BUCKETS = (1.0, 5.0, 10.0, 25.0, 50.0, 100.0, 200.0)
#: facts of the same model at (precision, param_dtype)
FactsFor = Callable[[str, str], ModelFacts]


@dataclass(frozen=True)
class Advice:
    """One change: the option to pass, why, and what it does (``gain``: samples/s ratio - 1;
    ``fits``: the changed plan fits the device)."""

    change: str
    why: str
    gain: float
    fits: bool

    def to_dict(self) -> dict[str, object]:
        return {"change": self.change, "why": self.why, "gain": self.gain, "fits": self.fits}


def _quick(facts: ModelFacts, cluster: ClusterSpec, plan: Plan) -> tuple[float, bool, float]:
    """(samples/s over all devices, fits, step seconds) of ``plan``."""
    p = plan.devices or 1
    k = plan.stages if plan.strategy == "pipeline" else 1
    cost = step_cost(facts, cluster, plan, p, plan.batch_size)
    memory = memory_breakdown(facts, cluster, plan, plan.batch_size, p)["total"]
    return plan.batch_size * (p // k) / cost.step_s, memory <= cluster.device.memory_bytes, cost.step_s


def _half(cluster: ClusterSpec) -> str | None:
    """The 16-bit precision worth switching to on this device (bf16 where it has it), or None."""
    peaks = cluster.device.peak_flops
    for name in ("bf16", "fp16"):
        if peaks.get(name, 0.0) >= 1.5 * peaks["fp32"]:
            return name
    return None


def advise(facts: ModelFacts, cluster: ClusterSpec, plan: Plan, pred: Prediction,
           facts_for: FactsFor | None = None) -> list[Advice]:
    """Changes to ``plan`` worth making, best first (see the module docs)."""
    plan = plan.validate(cluster)
    base, fits, step = _quick(facts, cluster, plan)
    out: list[Advice] = []

    def consider(change: str, why: str, variant: Plan, vfacts: ModelFacts | None = None) -> None:
        try:
            rate, ok, vstep = _quick(vfacts or facts, cluster, variant.validate(cluster))
        except OracleError:
            return
        gain = rate / base - 1
        if (not fits and ok) or (fits and ok and gain >= MIN_GAIN):
            out.append(Advice(change, f"{why}: step {step * 1e3:.4g} ms -> {vstep * 1e3:.4g} ms", gain, ok))

    def with_precision(precision: str, variant: Plan) -> ModelFacts | None:
        if facts_for is None:
            return None
        try:
            return facts_for(precision, variant.compute_dtype)
        except OracleError:
            return None

    b = plan.batch_size
    if not fits:
        if 1 <= pred.max_batch_per_device < b:
            consider(f"--batch-size {pred.max_batch_per_device}", "the largest batch that fits",
                     replace(plan, batch_size=pred.max_batch_per_device))
        policies = ("none", "op", "full") if plan.activation_checkpointing == "none" \
            else (plan.activation_checkpointing,)
        strategies = (plan.strategy,) if plan.sharded else (plan.strategy, "fsdp", "zero1")
        why = {"op": "recompute what the selective policy does not keep", "full": "recompute every block in "
               "backward, keeping only its input", "fsdp": "shard parameters, gradients and optimizer state over "
               "the devices", "zero1": "shard the optimizer state over the devices"}
        for strategy in strategies:
            for policy in policies:
                if (strategy, policy) == (plan.strategy, plan.activation_checkpointing):
                    continue
                flags = [f"--strategy {strategy}"] if strategy != plan.strategy else []
                flags += [f"--activation-checkpointing {policy}"] if policy != plan.activation_checkpointing else []
                variant = replace(plan, strategy=strategy, activation_checkpointing=policy)
                reasons = "; ".join(why[x] for x in (strategy, policy) if x in why)
                try:
                    largest = max_batch(facts, cluster, variant.validate(cluster), plan.devices or 1)
                except OracleError:
                    continue
                if largest >= b:
                    consider(" ".join(flags), reasons, variant)
                elif largest >= 1:  # fits only with a smaller batch too
                    consider(" ".join([*flags, f"--batch-size {largest}"]), f"{reasons}; the largest batch that "
                             "fits then", replace(variant, batch_size=largest))
    else:
        if 2 * b <= pred.max_batch_per_device:
            consider(f"--batch-size {2 * b}", f"a larger batch per device (global batch {2 * pred.global_batch}: "
                     "retune the learning rate)", replace(plan, batch_size=2 * b))
        if plan.strategy in ("allreduce", "zero1") and (plan.devices or 1) > 1 and pred.cost.exposed_comm_s > 0:
            best = max(_BUCKETS, key=lambda mb: _quick(facts, cluster, replace(plan, bucket_mb=mb))[0])
            if best != plan.bucket_mb:
                consider(f"--bucket-mb {best:g}", "DDP buckets that overlap backward better",
                         replace(plan, bucket_mb=best))
        if plan.strategy == "fsdp" and plan.reshard_after_forward:
            consider("--no-reshard-after-forward", "keep gathered parameters from forward to backward "
                     "(one all-gather per unit instead of two)", replace(plan, reshard_after_forward=False))
        if plan.activation_checkpointing != "none":
            consider("--activation-checkpointing none", "no recomputation (it fits without)",
                     replace(plan, activation_checkpointing="none"))
    half = _half(cluster)
    if facts.conv_layers and not plan.channels_last and (plan.precision in ("fp16", "bf16", "tf32") or half) \
            and plan.precision != "fp32":
        consider("--channels-last", "NHWC activations: tensor-core convolutions skip their transposes",
                 replace(plan, channels_last=True))
    if plan.precision in ("fp32", "tf32") and half is not None and plan.compute_dtype == "fp32":
        variant = replace(plan, precision=half)
        vfacts = with_precision(half, variant)
        if vfacts is not None:
            consider(f"--precision {half}", f"mixed precision: matrix kernels at the {half} peak, 16-bit activations",
                     variant, vfacts)
    out.sort(key=lambda a: (not a.fits, -a.gain))
    return out
