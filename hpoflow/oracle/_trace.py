"""One training step of a model traced on the meta device: kernels, saved tensors, gradient order.

:func:`trace_step` runs forward, cross-entropy and backward of a model built on the meta device (no
weights, no data) twice, at two batch sizes, under two recording hooks:

* a ``TorchDispatchMode`` sees every ATen operator autograd dispatches, forward and backward: its
  FLOPs (``torch.utils.flop_counter``'s formulas; a multiply-add is 2 FLOPs), the bytes of the
  tensors it reads and writes (views, ``detach`` and allocations move nothing; batch norm reads
  its activations twice: statistics over the whole batch come first), and the layer it
  belongs to: the innermost module running in the forward pass, the module whose autograd nodes
  run in the backward pass (node pre-hooks);
* ``torch.autograd.graph.saved_tensors_hooks`` sees every tensor autograd keeps for the backward
  pass; a storage is counted once however many views of it are saved (parameters and buffers are
  model state, not activations).

Each parameter's ``post_accumulate_grad`` hook gives the backward kernel after which its gradient
is ready: what DDP's buckets wait for. The two batch sizes split every figure into a part per
sample and a fixed part (weights read by a kernel, fp16 copies of weights under mixed precision,
per-channel statistics).

Mixed precision (``fp16``/``bf16``) follows ``torch.autocast``'s policy on CUDA: matrix products
and convolutions run on 16-bit copies of their inputs (the copies are what autograd saves),
softmax, log-softmax, layer and group norm and the loss in fp32, everything else in the dtype it
receives. It is emulated at the ``torch`` function level (a ``TorchFunctionMode`` inserting the
casts autocast would) because autocast has no meta-device backend.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

__all__ = ["Kernel", "StepTrace", "trace_step"]

#: matrix kernels: their FLOPs run on the matrix units at the step's precision
CONV_OPS = frozenset({"convolution", "convolution_backward", "_convolution"})
MM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_flash_attention",
                    "_scaled_dot_product_efficient_attention"})
#: operators that launch no kernel: metadata changes and allocations
_NO_KERNEL = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "lift_fresh",
                        "_local_scalar_dense", "set_"})
#: torch functions autocast runs in 16-bit and in fp32 on CUDA (the matrix and reduction families)
_HALF_FUNCTIONS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                             "conv_transpose3d", "linear", "matmul", "__matmul__", "__rmatmul__",
                             "bmm", "mm", "addmm", "baddbmm", "einsum", "prelu"})
_FP32_FUNCTIONS = frozenset({"softmax", "log_softmax", "layer_norm", "group_norm", "cross_entropy",
                             "nll_loss", "normalize", "cosine_similarity", "pdist", "cdist"})
_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: batch norm reduces over the whole batch before it can normalise: its kernels read their
#: activation inputs twice (statistics, then the element-wise pass); how many leading inputs
_TWO_PASS = {"native_batch_norm": 1, "_native_batch_norm_legit": 1, "_native_batch_norm_legit_functional": 1,
             "native_batch_norm_backward": 2}
BATCHES = (2, 4)  # batch norm in training mode needs more than one value per channel


@dataclass(frozen=True)
class Kernel:
    """One ATen operator of a training step, priced by the oracle's roofline.

    ``kind`` is ``conv``, ``mm`` (matrix units) or ``mem`` (everything else: element-wise,
    reductions, normalisation, copies); ``half`` says a matrix kernel computes in 16-bit. FLOPs and
    bytes have a part per sample and a fixed part (``fixed_bytes``: weights and other tensors whose
    size does not follow the batch). ``layer`` indexes :attr:`StepTrace.layers`; ``backward`` is
    false for forward and loss kernels.
    """

    layer: int
    backward: bool
    kind: str
    half: bool
    flops: float
    bytes: float
    fixed_bytes: float


@dataclass(frozen=True)
class StepTrace:
    """What one traced training step of a model did (see the module docs)."""

    layers: tuple[str, ...]
    kernels: tuple[Kernel, ...]
    #: (parameter index in ``model.parameters()`` order, its elements, index of the backward
    #: kernel after which its gradient is ready), in the order gradients become ready
    grad_ready: tuple[tuple[int, int, int], ...]
    #: bytes autograd saves for backward, per sample and fixed (storages counted once)
    saved_bytes: float
    saved_fixed_bytes: float

    @property
    def forward_kernels(self) -> int:
        return sum(not k.backward for k in self.kernels)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches in ``t``: its elements, at most its storage (expanded tensors)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes()) if t.numel() else 0
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
        return n


class _Recorder(TorchDispatchMode):
    """Records (layer, backward, op name, FLOPs, bytes) of every kernel-launching operator."""

    def __init__(self, layer: Callable[[], int], backward: Callable[[], bool]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        self.layer, self.backward = layer, backward
        self.ops: list[tuple[int, bool, str, bool, float, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL or name in ("detach", "alias"):
            return out
        counter = flop_registry.get(func._overloadpacket)
        flops = float(counter(*args, **kwargs, out_val=out)) if counter is not None else 0.0
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        moved = float(sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs))
        moved += sum(_nbytes(t) for t in ins[:_TWO_PASS.get(name, 0)])
        half = any(t.dtype in (torch.float16, torch.bfloat16) for t in ins if t.is_floating_point())
        self.ops.append((self.layer(), self.backward(), name, half, flops, moved))
        return out


class _Autocast(TorchFunctionMode):
    """``torch.autocast``'s CUDA casting policy, emulated where autocast cannot run (meta)."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = self.dtype if name in _HALF_FUNCTIONS else torch.float32 if name in _FP32_FUNCTIONS else None
        if target is not None:
            def cast(v: Any) -> Any:
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != target:
                    return v.to(target)
                return v
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextmanager
def _layer_tracking(model: nn.Module, names: list[str]) -> Iterator[tuple[Callable[[], int], Callable[[], bool],
                                                                         Callable[[torch.Tensor], None]]]:
    """Module hooks that say which layer runs: forward by the module stack, backward by the module
    whose autograd nodes run (each node is tagged with the innermost module that created it)."""
    index = {id(m): i for i, (_, m) in enumerate(model.named_modules())}
    names.extend(name or type(model).__name__ for name, _ in model.named_modules())
    loss_layer = len(names)
    names.append("loss")
    stack: list[int] = []
    state = {"backward": False, "current": loss_layer}
    tagged: set[int] = set()

    def tag(tensor_tree: Any, layer: int) -> None:
        todo: list[Any] = [t.grad_fn for t in _tensors(tensor_tree) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or id(node) in tagged:
                continue
            tagged.add(id(node))
            node.register_prehook(lambda _grads, layer=layer: state.__setitem__("current", layer))
            todo.extend(nxt for nxt, _ in node.next_functions)

    def pre(module: nn.Module, _inp: Any) -> None:
        stack.append(index[id(module)])

    def post(module: nn.Module, _inp: Any, out: Any) -> None:
        stack.pop()
        tag(out, index[id(module)])

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]

    def layer() -> int:
        if state["backward"]:
            return state["current"]
        return stack[-1] if stack else loss_layer

    def start_backward(loss: torch.Tensor) -> None:
        tag(loss, loss_layer)
        state["backward"] = True

    try:
        yield layer, (lambda: bool(state["backward"])), start_backward
    finally:
        for h in handles:
            h.remove()


def _one_step(build: Callable[[], nn.Module], sample: Callable[[int], torch.Tensor], n_classes: int,
              batch: int, precision: str) -> tuple[list[str], list[tuple[int, bool, str, bool, float, float]],
                                                   list[tuple[int, int, int]], float]:
    with torch.device("meta"):
        model = build()
    model.train()
    x = sample(batch)
    names: list[str] = []
    params = list(model.parameters())
    state_storages = {t.untyped_storage()._cdata for t in (*params, *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        # one storage counted once: views and in-place results of one tensor share it
        key = t.untyped_storage()._cdata
        if key not in state_storages and key not in saved:
            saved[key] = t.untyped_storage().nbytes()
        return t

    ready: list[tuple[int, int, int]] = []
    with ExitStack() as stack:
        layer, backward, start_backward = stack.enter_context(_layer_tracking(model, names))
        recorder = _Recorder(layer, backward)
        hooks = [p.register_post_accumulate_grad_hook(
            lambda p, i=i: ready.append((i, p.numel(), len(recorder.ops) - 1))) for i, p in enumerate(params)]
        try:
            if precision in _DTYPES:
                stack.enter_context(_Autocast(_DTYPES[precision]))
            stack.enter_context(recorder)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = model(x)
                target = torch.zeros(out.shape[0], dtype=torch.long, device=out.device)
                loss = nn.functional.cross_entropy(out, target % n_classes)
            start_backward(loss)
            loss.backward()
        finally:
            for h in hooks:
                h.remove()
    return names, recorder.ops, ready, float(sum(saved.values()))


def trace_step(build: Callable[[], nn.Module], sample: Callable[[int], torch.Tensor], n_classes: int,
               precision: str = "fp32") -> StepTrace:
    """Trace one training step of the model ``build()`` makes (on the meta device) on the inputs
    ``sample(batch)`` makes, at the batch sizes :data:`BATCHES`; see the module docs."""
    (b1, b2) = BATCHES
    names, ops1, ready, saved1 = _one_step(build, sample, n_classes, b1, precision)
    _, ops2, _, saved2 = _one_step(build, sample, n_classes, b2, precision)
    if [o[:4] for o in ops1] != [o[:4] for o in ops2]:
        raise ValueError("the model runs different operators at different batch sizes; "
                         "the oracle cannot separate its per-sample from its fixed costs")
    kernels = []
    for (layer, bwd, name, half, f1, m1), (_, _, _, _, f2, m2) in zip(ops1, ops2, strict=True):
        kind = "conv" if name in CONV_OPS else "mm" if name in MM_OPS else "mem"
        per_flop = max(0.0, (f2 - f1) / (b2 - b1))
        per_byte = max(0.0, (m2 - m1) / (b2 - b1))
        kernels.append(Kernel(layer=layer, backward=bwd, kind=kind, half=half and kind != "mem",
                              flops=per_flop, bytes=per_byte, fixed_bytes=max(0.0, m1 - b1 * per_byte)))
    per_saved = max(0.0, (saved2 - saved1) / (b2 - b1))
    return StepTrace(layers=tuple(names), kernels=tuple(kernels), grad_ready=tuple(ready),
                     saved_bytes=per_saved, saved_fixed_bytes=max(0.0, saved1 - b1 * per_saved))
