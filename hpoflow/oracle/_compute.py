"""Device time of one training step: a roofline per kernel, or the calibrated per-layer tables.

**Roofline** (a device described by datasheet figures, no calibrated tables): every kernel of the
traced step (:mod:`hpoflow.oracle._trace`) takes

    max(FLOPs / (peak(precision) x efficiency),  bytes / (memory_bandwidth x memory_efficiency))
    + kernel_s

Matrix kernels (convolutions, matrix products) run at the precision of their inputs: 16-bit ones
at the ``fp16``/``bf16`` peak, fp32 ones at the ``tf32`` peak when the plan asks for TF32 and, for
convolutions only, when the device has TF32 units (PyTorch's defaults:
``torch.backends.cudnn.allow_tf32`` is true, ``torch.backends.cuda.matmul.allow_tf32`` false),
else at the fp32 peak. Every other kernel is memory-bound. Tensor cores convolve channels-last
(NHWC) data: with PyTorch's default NCHW layout a tensor-core convolution also transposes its
activations in and out (two more passes over them). The optimizer step reads and writes its
fp32 state once per step: 12 bytes per parameter for SGD, 20 with momentum, 28 for Adam, plus 12
for the gradient scaler's unscale and overflow check under fp16.

**Calibrated** (``hpoflow oracle calibrate`` measured tables for this device): FLOP time from the
``efficiency_table``/per-kind efficiencies, memory-bound layers from ``layer_cost`` and the rest of
the activations moved ``ACTIVATION_TRAFFIC`` times at the memory bandwidth, the optimizer at its
measured seconds per parameter: exactly the model validated on CPU (docs/oracle.md section 7).
Gradient readiness inside its backward pass follows the roofline's shares of the traced kernels.

Both add the CPU-side overheads (per step, per dispatched operator, per parameter tensor, per
convolution layer when no conv table prices it).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from hpoflow.oracle.catalog import PRECISION_BYTES
from hpoflow.oracle.cluster import ClusterSpec, DeviceSpec
from hpoflow.oracle.facts import ModelFacts

__all__ = ["ACTIVATION_TRAFFIC", "VIEW_KINDS", "Compute", "compute"]

ACTIVATION_TRAFFIC = 4  # forward write + read, backward gradient write + read
#: layers whose output is a view of their input: no time and no traffic when a device has a
#: ``layer_cost`` table (without one, every leaf output counts as traffic)
VIEW_KINDS = ("flatten", "unflatten", "identity")
#: bytes per parameter one optimizer step reads and writes (fp32 weights, gradients, state)
OPTIMIZER_BYTES = {"sgd": 12, "momentum": 20, "adam": 28}
GRAD_SCALER_BYTES = 12  # fp16: unscale (read + write the gradients) and the overflow check (read)


@dataclass(frozen=True)
class Compute:
    """Seconds of one step's device work for ``batch`` samples (before contention)."""

    flops_s: float
    traffic_s: float
    overhead_s: float
    optimizer_s: float
    forward_s: float
    backward_s: float
    #: for each entry of the trace's ``grad_ready``: seconds from the start of the backward pass
    #: until that gradient is ready (empty without a trace)
    grad_ready_s: tuple[float, ...] = ()

    @property
    def total_s(self) -> float:
        return self.flops_s + self.traffic_s + self.overhead_s + self.optimizer_s


def optimizer_key(optimizer: str, momentum: float) -> str:
    name = optimizer.lower()
    return "adam" if name in ("adam", "adamw") else "momentum" if momentum > 0 else "sgd"


def matrix_precision(half: bool, precision: str, kind: str, dev: DeviceSpec) -> str:
    """The precision a matrix kernel runs at (see the module docs)."""
    if half:
        return precision
    if precision == "tf32" or (kind == "conv" and "tf32" in dev.peak_flops):
        return "tf32"
    return "fp32"


def _kernel_times(facts: ModelFacts, dev: DeviceSpec, precision: str, call_batch: float,
                  channels_last: bool = False) -> list[tuple[float, bool]]:
    """(seconds, compute-bound) of every traced kernel at ``call_batch`` samples per call."""
    trace = facts.trace
    if trace is None:
        return []
    mem_rate = dev.memory_bandwidth * dev.memory_efficiency
    # 16-bit matrix kernels: autocast's dtype, else the dtype the parameters compute in (FSDP)
    half = precision if precision in ("fp16", "bf16") else facts.param_dtype if facts.param_dtype != "fp32" \
        else "fp16"
    out = []
    for k in trace.kernels:
        t_mem = (k.bytes * call_batch + k.fixed_bytes) / mem_rate
        t_flop = extra = 0.0
        if k.kind != "mem" and k.flops > 0:
            at = matrix_precision(k.half, half if k.half else precision, k.kind, dev)
            t_flop = k.flops * call_batch / dev.matrix_rate(at)
            if k.kind == "conv" and at != "fp32" and at in dev.peak_flops and not channels_last:
                # tensor cores convolve channels-last data: NCHW tensors are transposed in and out
                extra = 2 * k.bytes * call_batch / mem_rate
        out.append((max(t_flop, t_mem) + extra + dev.kernel_s, t_flop >= t_mem))
    return out


def _ready_times(facts: ModelFacts, times: list[float], backward_s: float) -> tuple[float, ...]:
    """Seconds from the backward's start until each gradient of ``grad_ready`` is ready, the
    kernels' shares scaled to ``backward_s``."""
    trace = facts.trace
    if trace is None or not times:
        return ()
    first = trace.forward_kernels
    cum = list(itertools.accumulate(times[first:]))
    scale = backward_s / cum[-1] if cum and cum[-1] > 0 else 0.0
    return tuple(cum[max(0, i - first)] * scale if i >= first else 0.0 for _, _, i in trace.grad_ready)


def _overheads(facts: ModelFacts, cluster: ClusterSpec, precision: str) -> float:
    ov = cluster.overheads
    return ov.step_s + ov.per_op_s * facts.ops_per_step + ov.per_param_tensor_s * facts.param_tensors \
        + ov.per_conv_s * _unpriced_convs(facts, cluster, precision)


def compute(facts: ModelFacts, cluster: ClusterSpec, precision: str, optimizer: str, momentum: float,
            batch: float, call_batch: float, stages: int = 1, channels_last: bool = False) -> Compute:
    """Device time of a step over ``batch`` samples run in calls of ``call_batch`` samples; the
    optimizer updates ``1/stages`` of the parameters (a pipeline stage's share); ``channels_last``
    says activations are stored NHWC (PyTorch's default is NCHW)."""
    dev = cluster.device
    calls = batch / call_batch if call_batch > 0 else 0.0
    key = optimizer_key(optimizer, momentum)
    rate = cluster.overheads.optimizer_per_param_s.get(key)
    if dev.calibrated:
        flops_s = _flops_time(facts, cluster, precision, batch, call_batch)
        layer_s, priced = _layer_time(facts, cluster, precision, batch, call_batch)
        traffic_s = layer_s + ACTIVATION_TRAFFIC * max(0.0, facts.leaf_output_bytes - priced) * batch \
            / dev.memory_bandwidth
        backward_s = 2 / 3 * (flops_s + traffic_s)
        forward_s = flops_s + traffic_s - backward_s
        shares = [t for t, _ in _kernel_times(facts, dev, precision, call_batch, channels_last)]
    else:
        timed = _kernel_times(facts, dev, precision, call_batch, channels_last)
        if not timed:  # facts made without a trace: FLOPs at the sustained rate, leaf traffic
            flops_s = facts.train_flops * batch / dev.flops(precision, facts.conv_flops_fraction)
            traffic_s = ACTIVATION_TRAFFIC * facts.leaf_output_bytes * batch / dev.memory_bandwidth
        else:
            flops_s = calls * sum(t for t, bound in timed if bound)
            traffic_s = calls * sum(t for t, bound in timed if not bound)
        first = facts.trace.forward_kernels if facts.trace else 0
        backward_s = calls * sum(t for t, _ in timed[first:]) if timed else 2 / 3 * (flops_s + traffic_s)
        forward_s = flops_s + traffic_s - backward_s
        shares = [t for t, _ in timed]
    if rate is None and not dev.calibrated:
        per_param = OPTIMIZER_BYTES[key] + (GRAD_SCALER_BYTES if precision == "fp16" else 0)
        optimizer_s = per_param * facts.params / stages / (dev.memory_bandwidth * dev.memory_efficiency)
    else:
        optimizer_s = (rate or 0.0) * facts.params / stages
    return Compute(flops_s=flops_s, traffic_s=traffic_s, overhead_s=_overheads(facts, cluster, precision),
                   optimizer_s=optimizer_s, forward_s=forward_s, backward_s=backward_s,
                   grad_ready_s=_ready_times(facts, shares, backward_s))


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
    peak = dev.peak(precision)
    eff, ceff = dev.kind_efficiency(precision)
    # the rest, at the per-kind efficiency: training FLOPs outside the leaf conv/linear layers
    # (3 x forward: attention's matrix products, ...) and the layers the table does not price
    conv_rest = 3 * facts.forward_flops * facts.conv_flops_fraction
    other_rest = 3 * facts.forward_flops - conv_rest
    seconds = 0.0
    for kind, fwd, calls, train in facts.layers:
        e = dev.layer_efficiency(kind, train * call_batch, precision)
        if e is not None:
            seconds += train * calls * batch / (peak * e)
        unpriced = (train if e is None else 0.0) - 3 * fwd  # the layer's own part of the rest
        if kind == "conv":
            conv_rest += unpriced * calls
        else:
            other_rest += unpriced * calls
    rest = max(0.0, conv_rest) / ceff + max(0.0, other_rest) / eff
    return seconds + batch * rest / peak
