"""Model facts measured from the real ``nn.Module`` on the meta device (no weights, no data).

Conventions (stated once, used everywhere in the oracle):

* **FLOPs** count a multiply-add as 2 floating-point operations, which is what
  ``torch.utils.flop_counter.FlopCounterMode`` reports. ``forward_macs`` is half of it and is the
  number papers usually call "GFLOPs" (ResNet-50: 4.1 GMACs = 8.2 GFLOPs per 224x224 image).
* **Training FLOPs** per sample are the traced step's: forward, plus a backward pass that computes
  gradients for activations and weights, each about as costly as the forward (``3 x
  forward_flops``), less the input gradient of a first layer, which autograd does not compute
  because the data needs none (ResNet-50: 2.97 x forward; the built-in ``mlp``: 2.68 x).
* **Activation memory** per sample is the bytes of the tensors autograd saves for the backward
  pass (``torch.autograd.graph.saved_tensors_hooks`` on the meta device, each storage counted
  once, so views and in-place results count once; parameters and buffers excluded), measured at
  two batch sizes and split into a part per sample and a fixed part (fp16 copies of the weights
  under mixed precision, per-channel statistics); see :mod:`hpoflow.oracle._trace`.
* **Kernels**: every ATen operator of forward + loss + backward with its FLOPs and bytes moved,
  the layer it belongs to, and when each parameter's gradient is ready (the same trace): what
  the roofline and the backward/all-reduce overlap are priced from.
* **Leaf output bytes** per sample: the output sizes of every leaf module (plus the input), times
  the element size; the memory traffic term of a calibrated CPU device. **Boundary bytes** (what a
  pipeline stage sends to the next) is their mean: the oracle does not know where a real
  partition would cut.
* **Operator count** is the number of ATen operators dispatched by one forward + loss + backward;
  the oracle multiplies it by a calibrated per-operator overhead (matters for tiny models on CPU).
* Weights, gradients and optimizer state are fp32 in every precision (mixed precision keeps fp32
  master weights and gradients); under fp16/bf16 activations and the inputs of matrix kernels are
  16-bit, as ``torch.autocast`` makes them (softmax, norms and the loss stay fp32).
"""

from __future__ import annotations

import importlib
import inspect
from collections import defaultdict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from hpoflow.oracle._modes import FusedAttention
from hpoflow.oracle._trace import StepTrace, step_loss, trace_step
from hpoflow.oracle._zoo import ZOO
from hpoflow.oracle.catalog import PRECISION_BYTES
from hpoflow.oracle.errors import OracleError

__all__ = [
    "BUILTIN_MODELS",
    "ModelFacts",
    "model_facts",
    "optimizer_state_bytes",
    "resolve_model",
]

PROJECT_MODELS: dict[str, tuple[tuple[int, ...], int]] = {
    "mlp": ((1, 8, 8), 10), "cnn": ((1, 8, 8), 10),
}
BUILTIN_MODELS: tuple[str, ...] = (*PROJECT_MODELS, *ZOO)
_CONV_OPS = ("convolution",)
_PROBE_BATCH = 2  # batch norm in training mode needs more than one value per channel


@dataclass(frozen=True)
class ModelFacts:
    """Per-sample compute and memory facts of one model at one input shape (see module docs)."""

    name: str
    input_shape: tuple[int, ...]
    n_classes: int
    precision: str
    params: int
    param_tensors: int
    forward_flops: float
    conv_flops_fraction: float
    activation_bytes: int
    boundary_bytes: int
    ops_per_step: int
    conv_layers: int
    #: (kind, forward FLOPs per sample of one call, calls per forward, training FLOPs per sample
    #: of one call) of every leaf ``nn.Linear`` ("linear") and convolution ("conv") module, in
    #: module order; lets a size-dependent efficiency table price each layer by its own work per
    #: call. Training FLOPs are forward plus backward as autograd runs it (traced): 3 x forward,
    #: but 2 x for a first layer, whose input needs no gradient
    layers: tuple[tuple[str, float, int, float], ...] = ()
    #: (kind, input elements per sample of one call, output elements per sample of one call,
    #: calls per forward) of every other leaf module, in module order; kind is the lower-case
    #: class name (``relu``, ``maxpool2d``, ``batchnorm2d``, ...). Lets a device ``layer_cost``
    #: table price memory-bound layers by the elements they touch
    other_layers: tuple[tuple[str, int, int, int], ...] = ()
    #: bytes autograd saves for backward that do not grow with the batch (see module docs)
    activation_fixed_bytes: int = 0
    #: leaf module outputs (plus the input) per sample, times the element size
    leaf_output_bytes: int = 0
    #: the traced training step (kernels, gradient order); None for facts made by hand
    trace: StepTrace | None = None
    #: the dtype parameters compute in (FSDP's ``param_dtype``; fp32 otherwise)
    param_dtype: str = "fp32"
    #: predictions per sample: the tokens of a language model's sequence, else 1
    tokens_per_sample: int = 1
    #: elements of the largest parameter tensor (a sharded build holds it whole while it initialises it)
    largest_param_tensor: int = 0

    @property
    def param_bytes(self) -> int:
        """fp32 weights."""
        return 4 * self.params

    @property
    def grad_bytes(self) -> int:
        """fp32 gradients: the bytes every data-parallel step all-reduces."""
        return 4 * self.params

    @property
    def forward_macs(self) -> float:
        """Multiply-accumulates per sample forward: the customary "GFLOPs" figure of papers."""
        return self.forward_flops / 2

    @property
    def train_flops(self) -> float:
        """FLOPs per sample of one training step (forward + backward): the traced step's, which
        is 3 x forward less the input gradient of a first layer (its input needs none); 3 x
        forward for facts made without a trace."""
        if self.trace is not None:
            traced = sum(k.flops for k in self.trace.kernels)
            if traced > 0:
                return traced
        return 3 * self.forward_flops

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "trace"}
        d["kernels_per_step"] = len(self.trace.kernels) if self.trace else None
        d["input_shape"] = list(self.input_shape)
        d["layers"] = [list(layer) for layer in self.layers]
        d["other_layers"] = [list(layer) for layer in self.other_layers]
        d.update(param_bytes=self.param_bytes, grad_bytes=self.grad_bytes,
                 forward_macs=self.forward_macs, train_flops=self.train_flops)
        return d


def optimizer_state_bytes(params: int, optimizer: str, momentum: float = 0.0) -> int:
    """fp32 optimizer state: SGD 0, SGD with momentum 1 x params, Adam/AdamW 2 x params."""
    name = optimizer.lower()
    if name == "sgd":
        return 4 * params if momentum > 0 else 0
    if name in ("adam", "adamw"):
        return 8 * params
    raise OracleError(
        f"optimizer must be one of sgd, adam, adamw, but got {optimizer!r}; "
        "pick one of those (its state size decides the memory per device)"
    )


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_step_ops(model: nn.Module, sample: torch.Tensor, n_classes: int) -> int:
    """ATen operators dispatched by forward + cross-entropy + backward of ``model``."""
    counter = OpCounter()
    with counter:
        step_loss(model(sample), n_classes).backward()
    return counter.count


def _import_builder(spec: str) -> Callable[..., nn.Module]:
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise OracleError(
            f"a model given as 'module:function' must name an importable function, but "
            f"{spec!r} failed ({type(exc).__name__}: {exc}); check the module is on PYTHONPATH"
        ) from exc
    if not callable(fn):
        raise OracleError(f"model {spec!r} is not callable; give a function returning nn.Module")
    return fn  # type: ignore[no-any-return,unused-ignore]


def resolve_model(
    name: str, input_shape: tuple[int, ...] | None, n_classes: int | None,
    options: Mapping[str, Any], token_input: bool | None = None,
) -> tuple[Callable[[], nn.Module], tuple[int, ...], int, bool]:
    """Turn a model name into (builder without arguments, input shape, classes, token input).

    Built-in names are the oracle's zoo and the models registered for training
    (``hpoflow.registry.MODELS``: ``mlp``, ``cnn`` and any plug-in's; their input shape and classes
    come from the data set, and ``token_input`` says the data set holds token ids)."""
    from hpoflow.registry import MODELS

    if name in ZOO:
        entry = ZOO[name]
        shape, classes = input_shape or entry.input_shape, n_classes or entry.n_classes
        tokens = entry.token_input if token_input is None else token_input
        return (lambda: entry.builder(shape, classes, **options)), shape, classes, tokens
    if name in PROJECT_MODELS or name in MODELS.names():
        from hpoflow.train.models import build_model

        shape, classes = PROJECT_MODELS.get(name, (input_shape or (1, 8, 8), n_classes or 10))
        shape, classes = input_shape or shape, n_classes or classes
        return (lambda: build_model(name, shape, classes, **options)), shape, classes, bool(token_input)
    if ":" in name:
        if input_shape is None:
            raise OracleError(
                f"a user model ({name!r}) needs its input shape, but none was given; "
                "pass --input-shape C,H,W (per sample, without the batch dimension)"
            )
        fn = _import_builder(name)
        classes = n_classes or 10
        sig = inspect.signature(fn).parameters
        if "input_shape" in sig and "n_classes" in sig:
            return (lambda: fn(input_shape=input_shape, n_classes=classes, **options)), \
                input_shape, classes, False
        return (lambda: fn(**options)), input_shape, classes, False
    raise OracleError(
        f"model must be a built-in name or 'module:function', but got {name!r}; "
        f"built-in models: {', '.join(BUILTIN_MODELS)}"
    )


def model_facts(
    name: str, input_shape: tuple[int, ...] | None = None, n_classes: int | None = None,
    precision: str = "fp32", options: Mapping[str, Any] | None = None, *,
    param_dtype: str = "fp32", token_input: bool | None = None,
) -> ModelFacts:
    """Facts of a built-in model (:data:`BUILTIN_MODELS`, a registered training model) or a user
    ``module:function``, measured on the meta device. ``precision`` is autocast's (``fp16``/``bf16``:
    mixed precision); ``param_dtype`` the dtype the parameters compute in (FSDP's mixed precision
    policy: ``bf16``/``fp16`` cast the whole model, the loss stays fp32); ``token_input`` says the
    input holds token ids (default: the zoo entry's, else images)."""
    if precision not in PRECISION_BYTES:
        raise OracleError(
            f"precision must be one of {', '.join(PRECISION_BYTES)}, but got {precision!r}"
        )
    if param_dtype not in ("fp32", "fp16", "bf16"):
        raise OracleError(f"param_dtype must be one of fp32, fp16, bf16, but got {param_dtype!r}")
    opts = tuple(sorted((options or {}).items()))
    try:
        return _facts_cached(name, input_shape, n_classes, precision, opts, param_dtype, token_input)
    except TypeError as exc:  # unhashable option values: measure without the cache
        if "unhashable" not in str(exc):
            raise
        return _measure(name, input_shape, n_classes, precision, dict(options or {}), param_dtype, token_input)


@lru_cache(maxsize=64)
def _facts_cached(name: str, input_shape: tuple[int, ...] | None, n_classes: int | None,
                  precision: str, opts: tuple[tuple[str, Any], ...], param_dtype: str,
                  token_input: bool | None) -> ModelFacts:
    return _measure(name, input_shape, n_classes, precision, dict(opts), param_dtype, token_input)


def _traced_layer_flops(trace: StepTrace) -> dict[str, float]:
    """Training FLOPs per sample (forward and backward kernels) of each module of ``trace``."""
    out: dict[str, float] = defaultdict(float)
    for k in trace.kernels:
        if 0 <= k.layer < len(trace.layers):
            out[trace.layers[k.layer]] += k.flops
    return out


def _measure(name: str, input_shape: tuple[int, ...] | None, n_classes: int | None,
             precision: str, options: dict[str, Any], param_dtype: str = "fp32",
             token_input: bool | None = None) -> ModelFacts:
    builder, shape, classes, tokens = resolve_model(name, input_shape, n_classes, options, token_input)
    try:
        with torch.device("meta"):
            model = builder()
    except (TypeError, ValueError) as exc:
        raise OracleError(
            f"building model {name!r} with input shape {shape} and options {options} failed "
            f"({type(exc).__name__}: {exc}); check the options and the input shape"
        ) from exc
    if not isinstance(model, nn.Module):
        raise OracleError(f"model {name!r} must build an nn.Module, but got {type(model).__name__}")
    model.train()
    dtype = torch.long if tokens else torch.float32
    sample = torch.zeros((_PROBE_BATCH, *shape), dtype=dtype, device="meta")

    act_elems = [0 if tokens else sample.numel()]
    calls: dict[int, int] = {}
    io_elems: dict[int, tuple[int, int]] = {}

    def hook(m: nn.Module, inp: Any, out: Any) -> None:
        calls[id(m)] = calls.get(id(m), 0) + 1
        outs = out if isinstance(out, (tuple, list)) else (out,)
        n_out = sum(t.numel() for t in outs if isinstance(t, torch.Tensor))
        n_in = sum(t.numel() for t in inp if isinstance(t, torch.Tensor))
        act_elems[0] += n_out
        seen_in, seen_out = io_elems.get(id(m), (0, 0))
        io_elems[id(m)] = (seen_in + n_in, seen_out + n_out)

    named_leaves = [(n, m) for n, m in model.named_modules() if not any(True for _ in m.children())]
    leaves = [m for _, m in named_leaves]
    handles = [m.register_forward_hook(hook) for m in leaves]
    flops = FlopCounterMode(display=False)
    try:
        with FusedAttention(), flops:
            out = model(sample)
    except RuntimeError as exc:
        raise OracleError(
            f"model {name!r} cannot run on input shape {shape} (per sample): {exc}; "
            "pass the input shape the model expects"
        ) from exc
    finally:
        for h in handles:
            h.remove()
    counts = flops.get_flop_counts()
    by_op = counts.get("Global", {})
    root = type(model).__name__
    try:
        trace = trace_step(builder, lambda n: torch.zeros((n, *shape), dtype=dtype, device="meta"), classes,
                           "fp32" if precision == "tf32" else precision, param_dtype)
    except (RuntimeError, ValueError) as exc:
        raise OracleError(
            f"model {name!r} cannot be traced through one training step on the meta device: {exc}; "
            "a model must run forward and backward the same way at any batch size"
        ) from exc
    traced = _traced_layer_flops(trace)
    layers, other = [], []
    for fqn, m in named_leaves:
        kind = "conv" if isinstance(m, nn.modules.conv._ConvNd) else \
            "linear" if isinstance(m, nn.Linear) else None
        n_calls = calls.get(id(m), 0)
        layer_flops = float(sum(counts.get(f"{root}.{fqn}" if fqn else root, {}).values()))
        if kind and n_calls and layer_flops > 0:
            fwd = layer_flops / n_calls / _PROBE_BATCH
            train = traced.get(fqn or root, 0.0) / n_calls
            layers.append((kind, fwd, n_calls, train if train > fwd else 3 * fwd))
        elif kind is None and n_calls:
            n_in, n_out = io_elems[id(m)]
            other.append((type(m).__name__.lower(), n_in // n_calls // _PROBE_BATCH,
                          n_out // n_calls // _PROBE_BATCH, n_calls))
    total = float(sum(by_op.values()))
    conv = float(sum(v for k, v in by_op.items() if any(c in str(k) for c in _CONV_OPS)))
    ops = count_step_ops(model, sample, classes)
    params = list(model.parameters())
    leaf_bytes = act_elems[0] * PRECISION_BYTES[precision] // _PROBE_BATCH
    return ModelFacts(
        name=name,
        input_shape=tuple(shape),
        n_classes=classes,
        precision=precision,
        param_dtype=param_dtype,
        tokens_per_sample=int(out.shape[1]) if isinstance(out, torch.Tensor) and out.dim() == 3 else 1,
        params=sum(p.numel() for p in params),
        param_tensors=len(params),
        largest_param_tensor=max((p.numel() for p in params), default=0),
        forward_flops=total / _PROBE_BATCH,
        conv_flops_fraction=conv / total if total else 0.0,
        activation_bytes=round(trace.saved_bytes),
        boundary_bytes=leaf_bytes // max(1, len(leaves)),
        ops_per_step=ops,
        conv_layers=sum(isinstance(m, nn.modules.conv._ConvNd) for m in leaves),
        layers=tuple(layers),
        other_layers=tuple(other),
        activation_fixed_bytes=round(trace.saved_fixed_bytes),
        leaf_output_bytes=leaf_bytes,
        trace=trace,
    )
