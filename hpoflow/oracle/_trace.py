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

Mixed precision (``fp16``/``bf16``) follows ``torch.autocast``'s policy on CUDA: matrix products,
convolutions and attention run on 16-bit copies of their inputs (the copies are what autograd
saves), softmax, log-softmax, layer and group norm and the loss in fp32, everything else in the
dtype it receives. It is emulated at the ``torch`` function level (a ``TorchFunctionMode`` inserting
the casts autocast would) because autocast has no meta-device backend; the bytes of the saved
16-bit copies of parameters are kept apart (``saved_weight_copy_bytes``: FSDP with a 16-bit
``param_dtype`` holds no such copies).

**Attention.** ``scaled_dot_product_attention`` without a mask runs as a fused kernel, as on a GPU
(flash attention for 16-bit inputs, memory-efficient attention for fp32) and on a CPU (PyTorch's
flash kernel): on the meta device PyTorch would take its math path instead, which saves the
sequence-squared score matrix. Grouped-query attention (fewer key/value heads) runs on the shared
key/value heads without copying them, as flash attention does.

**Units.** The blocks FSDP shards one at a time and activation checkpointing wraps
(:func:`sharding_units`) are recorded with their parameters, the bytes autograd saves while each
runs forward, the bytes of its input, and the bytes a selective (per-operator) checkpointing policy
keeps: outputs of every other matrix product and of attention, as torchtitan's ``op`` policy does.
Outputs of a step that is a sequence of logits (a language model: ``(batch, tokens, vocabulary)``)
are flattened to one prediction per token for the loss.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from hpoflow.oracle._modes import DTYPES, Autocast, FusedAttention, storage_key

__all__ = ["Kernel", "StepTrace", "UnitFacts", "sharding_units", "step_loss", "trace_step"]

#: matrix kernels: their FLOPs run on the matrix units at the step's precision
CONV_OPS = frozenset({"convolution", "convolution_backward", "_convolution"})
ATTENTION_OPS = frozenset({"_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                           "_scaled_dot_product_flash_attention_for_cpu"})
MM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", *ATTENTION_OPS,
                    *(f"{name}_backward" for name in ATTENTION_OPS)})
_ATTENTION_ALL = frozenset(MM_OPS - {"mm", "addmm", "bmm", "baddbmm"})
#: matrix products a selective (per-operator) checkpointing policy counts: every other one is kept
_KEPT_MM = frozenset({"mm", "addmm"})
#: operators that launch no kernel: metadata changes and allocations
_NO_KERNEL = frozenset({"_unsafe_view", "empty", "empty_like", "empty_strided", "lift_fresh",
                        "_local_scalar_dense", "set_"})
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
    false for forward and loss kernels; ``unit`` indexes :attr:`StepTrace.units` (-1: outside every
    unit); ``kept`` marks a forward kernel whose output a selective checkpointing policy keeps.
    """

    layer: int
    backward: bool
    kind: str
    half: bool
    flops: float
    bytes: float
    fixed_bytes: float
    unit: int = -1
    kept: bool = False


@dataclass(frozen=True)
class UnitFacts:
    """One sharding/checkpointing unit (a block): its parameters and, per sample and fixed, the
    bytes autograd saves while it runs forward (``saved``), the bytes of the outputs a selective
    per-operator checkpointing policy stores instead of recomputing (``kept``: every other matrix
    product and attention, whether autograd saves them or not) and the bytes of its input (what a
    checkpoint keeps)."""

    name: str
    params: int
    saved: float = 0.0
    saved_fixed: float = 0.0
    kept: float = 0.0
    kept_fixed: float = 0.0
    input: float = 0.0
    input_fixed: float = 0.0


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
    #: the blocks FSDP shards and checkpointing wraps, in forward order (empty: the model is one unit)
    units: tuple[UnitFacts, ...] = ()
    #: for each parameter (``model.parameters()`` order) the index of its unit, -1 for the root
    param_unit: tuple[int, ...] = ()
    #: fixed saved bytes that are 16-bit copies of parameters made by (emulated) autocast
    saved_weight_copy_bytes: float = 0.0
    #: the most bytes alive at once in tensors backward makes (activation gradients), per sample
    #: and fixed: on top of the saved tensors at the start of backward
    transient_bytes: float = 0.0
    transient_fixed_bytes: float = 0.0

    @property
    def forward_kernels(self) -> int:
        return sum(not k.backward for k in self.kernels)

    @property
    def root_params(self) -> int:
        """Parameter elements outside every unit (embeddings, heads, final norms)."""
        sizes = {i: n for i, n, _ in self.grad_ready}
        return sum(n for i, n in sizes.items() if i >= len(self.param_unit) or self.param_unit[i] < 0)


def sharding_units(model: nn.Module) -> list[str]:
    """The names of the blocks FSDP wraps one at a time and activation checkpointing wraps.

    The children of the ``nn.ModuleList``/``nn.Sequential`` holding the most parameters among
    those whose children are two or more modules of one class of its own (a transformer's blocks:
    not containers themselves). Without one, the top-level children holding parameters, descending
    into a container child that holds more than half of them (a ResNet's ``features``). Parameters
    outside the units belong to the root unit (embeddings, the head, final norms).
    """
    containers = (nn.ModuleList, nn.Sequential)
    best: tuple[int, str, nn.Module] | None = None
    for name, m in model.named_modules():
        kids = list(m.children())
        if not isinstance(m, containers) or len(kids) < 2:
            continue
        kinds = {type(k) for k in kids}
        if len(kinds) != 1 or issubclass(kinds.pop(), containers):
            continue
        size = sum(p.numel() for p in m.parameters())
        if size > 0 and (best is None or size > best[0]):
            best = (size, name, m)
    if best is not None:
        prefix = f"{best[1]}." if best[1] else ""
        return [f"{prefix}{n}" for n, _ in best[2].named_children()]
    total = sum(p.numel() for p in model.parameters())
    prefix, parent = "", model
    while True:
        big = [(n, m) for n, m in parent.named_children()
               if isinstance(m, containers) and 2 * sum(p.numel() for p in m.parameters()) > total]
        if not big or len(list(big[0][1].children())) < 2:
            break
        prefix, parent = f"{prefix}{big[0][0]}.", big[0][1]
    return [f"{prefix}{n}" for n, m in parent.named_children() if any(True for _ in m.parameters())]


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]


def _nbytes(t: torch.Tensor) -> int:
    """Bytes a kernel touches in ``t``: its elements, at most its storage (expanded tensors)."""
    n = t.numel() * t.element_size()
    try:
        return min(n, t.untyped_storage().nbytes()) if t.numel() else 0
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
        return n


def _is_causal(func: Any, args: Any, kwargs: dict[str, Any]) -> bool:
    if "is_causal" in kwargs:
        return bool(kwargs["is_causal"])
    names = [a.name for a in func._schema.arguments]
    return "is_causal" in names and len(args) > names.index("is_causal") and bool(args[names.index("is_causal")])


class _Recorder(TorchDispatchMode):
    """Records (layer, backward, op name, half, FLOPs, bytes, unit, kept) of every kernel-launching
    operator, the outputs a selective checkpointing policy keeps per unit (``kept``), and the most
    bytes alive at once in storages backward makes (:meth:`peak`: the transient gradients; a
    storage is alive until its last tensor goes, which a weak reference to the storage tells)."""

    def __init__(self, layer: Callable[[], int], backward: Callable[[], bool], unit: Callable[[], int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch's TorchDispatchMode is unannotated
        self.layer, self.backward, self.unit = layer, backward, unit
        self.ops: list[tuple[int, bool, str, bool, float, float, int, bool]] = []
        #: unit -> storage -> bytes of the outputs a selective checkpointing policy keeps
        self.kept: dict[int, dict[int, int]] = {}
        self._alive: list[torch.Tensor] = []
        self._mm_count: dict[int, int] = {}
        #: the storages that are parameters' ``.grad`` (filled in as they are accumulated)
        self.grad_storages: set[int] = set()
        #: storages backward made, alive: (weak reference, address, bytes, first kernel)
        self._live: list[tuple[StorageWeakRef, int, int, int]] = []
        #: storages backward made, freed: (first kernel, kernel by which it was freed, bytes)
        self._spans: list[tuple[int, int, int]] = []
        self._clock = 0

    def _track(self, outs: list[torch.Tensor]) -> None:
        """Backward: note which storages backward made were freed since the last kernel, then this
        kernel's new outputs (``outs``: storages it allocated, not views or in-place results of
        its inputs)."""
        self._clock += 1
        alive = []
        for entry in self._live:
            if entry[0].expired():
                self._spans.append((entry[3], self._clock, entry[2]))
            else:
                alive.append(entry)
        self._live = alive
        for t in outs:
            storage = t.untyped_storage()
            if (key := storage_key(t)) is not None:
                self._live.append((StorageWeakRef(storage), key, storage.nbytes(), self._clock))

    def peak(self) -> float:
        """After backward: the most bytes alive at once in storages backward made, except those
        that became parameters' ``.grad`` (model state, counted apart; a tied weight's first
        gradient waits for the second as its ``.grad`` to be)."""
        self._track([])
        end = self._clock + 1
        spans = self._spans + [(start, end, n) for ref, key, n, start in self._live
                               if key not in self.grad_storages]
        events = sorted([(start, n) for start, _, n in spans] + [(stop, -n) for _, stop, n in spans])
        alive = best = 0
        for _, delta in events:  # frees sort before allocations at one tick (negative deltas first)
            alive += delta
            best = max(best, alive)
        return float(best)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL or name in ("detach", "alias"):
            return out
        counter = flop_registry.get(func._overloadpacket)
        flops = float(counter(*args, **kwargs, out_val=out)) if counter is not None else 0.0
        if name in _ATTENTION_ALL and _is_causal(func, args, kwargs):
            flops /= 2  # a fused causal kernel skips the blocks above the diagonal
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        moved = float(sum(_nbytes(t) for t in ins) + sum(_nbytes(t) for t in outs))
        moved += sum(_nbytes(t) for t in ins[:_TWO_PASS.get(name, 0)])
        half = any(t.dtype in (torch.float16, torch.bfloat16) for t in ins if t.is_floating_point())
        backward, unit = self.backward(), self.unit()
        if backward:
            # a storage is identified by its address only while it is alive: the inputs are, so an
            # output sharing an input's address is that input's storage (in place), else it is new
            taken = {k for k in map(storage_key, ins) if k is not None}
            fresh: dict[int, torch.Tensor] = {}
            for t in outs:
                if (key := storage_key(t)) is not None and key not in taken:
                    fresh.setdefault(key, t)
            self._track(list(fresh.values()))
        kept = False
        if not backward:
            if name in _KEPT_MM:  # torchtitan's op policy: keep every other matrix product's output
                self._mm_count[unit] = self._mm_count.get(unit, 0) + 1
                kept = self._mm_count[unit] % 2 == 1
            kept = kept or name in ATTENTION_OPS
            if kept and unit >= 0:
                # kept whether or not autograd saves it: the policy stores it instead of recomputing
                held = self.kept.setdefault(unit, {})
                for t in outs:
                    if (key := storage_key(t)) is not None:
                        held[key] = t.untyped_storage().nbytes()
                self._alive.extend(outs)  # a freed storage's address may be reused: keep these alive
        self.ops.append((self.layer(), backward, name, half, flops, moved, unit, kept))
        return out


@contextmanager
def _layer_tracking(model: nn.Module, names: list[str], unit_names: list[str]
                    ) -> Iterator[tuple[Callable[[], int], Callable[[], bool], Callable[[torch.Tensor], None],
                                    Callable[[], int], dict[int, dict[int, int]]]]:
    """Module hooks that say which layer runs: forward by the module stack, backward by the module
    whose autograd nodes run (each node is tagged with the innermost module that created it); and
    which unit runs forward, with the storages of each unit's inputs (``inputs``)."""
    modules = list(model.named_modules())
    index = {id(m): i for i, (_, m) in enumerate(modules)}
    names.extend(name or type(model).__name__ for name, _ in modules)
    loss_layer = len(names)
    names.append("loss")
    by_name = dict(modules)
    unit_of = [-1] * len(names)
    for u, uname in enumerate(unit_names):
        for _, sub in by_name[uname].named_modules():
            unit_of[index[id(sub)]] = u
    stack: list[int] = []
    state = {"backward": False, "current": loss_layer}
    tagged: set[int] = set()
    inputs: dict[int, dict[int, int]] = {u: {} for u in range(len(unit_names))}
    held: list[torch.Tensor] = []  # the inputs noted: alive, so no later storage takes one's address

    def tag(tensor_tree: Any, layer: int) -> None:
        todo: list[Any] = [t.grad_fn for t in _tensors(tensor_tree) if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node is None or id(node) in tagged:
                continue
            tagged.add(id(node))
            node.register_prehook(lambda _grads, layer=layer: state.__setitem__("current", layer))
            todo.extend(nxt for nxt, _ in node.next_functions)

    def pre(module: nn.Module, inp: Any) -> None:
        i = index[id(module)]
        if unit_of[i] >= 0 and (not stack or unit_of[stack[-1]] != unit_of[i]):  # entering a unit
            for t in _tensors(inp):
                if (key := storage_key(t)) is not None:
                    inputs[unit_of[i]][key] = t.untyped_storage().nbytes()
                    held.append(t)
        stack.append(i)

    def post(module: nn.Module, _inp: Any, out: Any) -> None:
        stack.pop()
        tag(out, index[id(module)])

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for m in model.modules()]

    def layer() -> int:
        if state["backward"]:
            return state["current"]
        return stack[-1] if stack else loss_layer

    def unit() -> int:
        if state["backward"]:
            return unit_of[state["current"]] if state["current"] < len(unit_of) else -1
        return unit_of[stack[-1]] if stack else -1

    def start_backward(loss: torch.Tensor) -> None:
        tag(loss, loss_layer)
        state["backward"] = True

    try:
        yield layer, (lambda: bool(state["backward"])), start_backward, unit, inputs
    finally:
        for h in handles:
            h.remove()


@dataclass
class _Step:
    """One traced step at one batch size (see :func:`_one_step`)."""

    names: list[str]
    ops: list[tuple[int, bool, str, bool, float, float, int, bool]]
    ready: list[tuple[int, int, int]]
    saved: float
    unit_saved: list[float]
    unit_kept: list[float]
    unit_input: list[float]
    weight_copies: float
    unit_names: list[str]
    param_unit: list[int]
    unit_params: list[int]
    transient: float


def step_loss(out: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Cross-entropy of the step's output: one prediction per sample, or per token when the model
    returns a sequence of logits."""
    logits = out.reshape(-1, out.shape[-1]) if out.dim() > 2 else out
    logits = logits.float()  # the loss in fp32 (16-bit logits are upcast, as training loops do)
    target = torch.zeros(logits.shape[0], dtype=torch.long, device=out.device)
    return nn.functional.cross_entropy(logits, target % n_classes)


def _one_step(build: Callable[[], nn.Module], sample: Callable[[int], torch.Tensor], n_classes: int,
              batch: int, precision: str, param_dtype: str = "fp32") -> _Step:
    with torch.device("meta"):
        model = build()
    if param_dtype in DTYPES:  # FSDP's mixed precision: the whole model computes in 16-bit
        model = model.to(DTYPES[param_dtype])
    model.train()
    x = sample(batch)
    if param_dtype in DTYPES and x.is_floating_point():  # FSDP casts floating-point inputs too
        x = x.to(DTYPES[param_dtype])
    names: list[str] = []
    unit_names = sharding_units(model)
    params = list(model.parameters())
    pid = {id(p): i for i, p in enumerate(params)}
    param_unit = [-1] * len(params)
    unit_params = []
    modules = dict(model.named_modules())
    for u, uname in enumerate(unit_names):
        own = [p for p in modules[uname].parameters() if param_unit[pid[id(p)]] < 0]
        for p in own:
            param_unit[pid[id(p)]] = u
        unit_params.append(sum(p.numel() for p in own))
    state_storages = {storage_key(t) for t in (*params, *model.buffers())}
    saved: dict[int, tuple[int, int]] = {}  # storage -> (bytes, unit)
    kept_alive: list[torch.Tensor] = []
    weight_copies: set[int] = set()

    ready: list[tuple[int, int, int]] = []
    with ExitStack() as stack:
        layer, backward, start_backward, unit, inputs = stack.enter_context(
            _layer_tracking(model, names, unit_names))
        recorder = _Recorder(layer, backward, unit)

        def pack(t: torch.Tensor) -> torch.Tensor:
            # one storage counted once: views and in-place results of one tensor share it
            key = storage_key(t)
            if key is not None and key not in state_storages and key not in saved:
                saved[key] = (t.untyped_storage().nbytes(), unit())
                kept_alive.append(t)  # a storage is known by its address: none may take it over in this trace
            return t

        def accumulated(p: torch.Tensor, i: int) -> None:
            ready.append((i, p.numel(), len(recorder.ops) - 1))
            if p.grad is not None and (key := storage_key(p.grad)) is not None:
                recorder.grad_storages.add(key)

        hooks = [p.register_post_accumulate_grad_hook(lambda p, i=i: accumulated(p, i)) for i, p in enumerate(params)]
        try:
            stack.enter_context(FusedAttention())
            if precision in DTYPES:
                stack.enter_context(Autocast(DTYPES[precision], weight_copies))
            stack.enter_context(recorder)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = step_loss(model(x), n_classes)
            start_backward(loss)
            loss.backward()
            transient = recorder.peak()
        finally:
            for h in hooks:
                h.remove()
    n = len(unit_names)
    unit_saved = [0.0] * n
    for nbytes, u in saved.values():
        if u >= 0:
            unit_saved[u] += nbytes
    unit_kept = [float(sum(recorder.kept.get(u, {}).values())) for u in range(n)]
    # a unit's input the root also saves (a parameterless activation between units) is held
    # anyway: a checkpoint keeping it adds nothing
    root_saved = {key for key, (_, u) in saved.items() if u < 0}
    unit_input = [float(sum(b for key, b in inputs[u].items() if key not in root_saved)) for u in range(n)]
    copies = float(sum(b for key, (b, _) in saved.items() if key in weight_copies))
    return _Step(names, recorder.ops, ready, float(sum(b for b, _ in saved.values())), unit_saved, unit_kept,
                 unit_input, copies, unit_names, param_unit, unit_params, transient)


def _split(v1: float, v2: float, b1: int, b2: int) -> tuple[float, float]:
    """(per sample, fixed) of a figure measured at batch sizes b1 and b2."""
    per = max(0.0, (v2 - v1) / (b2 - b1))
    return per, max(0.0, v1 - b1 * per)


def trace_step(build: Callable[[], nn.Module], sample: Callable[[int], torch.Tensor], n_classes: int,
               precision: str = "fp32", param_dtype: str = "fp32") -> StepTrace:
    """Trace one training step of the model ``build()`` makes (on the meta device) on the inputs
    ``sample(batch)`` makes, at the batch sizes :data:`BATCHES`; see the module docs.
    ``param_dtype`` ``bf16``/``fp16`` casts the model first (FSDP's mixed precision policy)."""
    (b1, b2) = BATCHES
    one = _one_step(build, sample, n_classes, b1, precision, param_dtype)
    two = _one_step(build, sample, n_classes, b2, precision, param_dtype)
    if [o[:4] for o in one.ops] != [o[:4] for o in two.ops]:
        raise ValueError("the model runs different operators at different batch sizes; "
                         "the oracle cannot separate its per-sample from its fixed costs")
    kernels = []
    for (layer, bwd, name, half, f1, m1, unit, kept), (*_, f2, m2, _, _) in zip(one.ops, two.ops, strict=True):
        kind = "conv" if name in CONV_OPS else "mm" if name in MM_OPS else "mem"
        per_flop = max(0.0, (f2 - f1) / (b2 - b1))
        per_byte, fixed_byte = _split(m1, m2, b1, b2)
        kernels.append(Kernel(layer=layer, backward=bwd, kind=kind, half=half and kind != "mem",
                              flops=per_flop, bytes=per_byte, fixed_bytes=fixed_byte, unit=unit, kept=kept))
    per_saved, fixed_saved = _split(one.saved, two.saved, b1, b2)
    per_transient, fixed_transient = _split(one.transient, two.transient, b1, b2)
    units = []
    for u, name in enumerate(one.unit_names):
        saved = _split(one.unit_saved[u], two.unit_saved[u], b1, b2)
        keep = _split(one.unit_kept[u], two.unit_kept[u], b1, b2)
        inp = _split(one.unit_input[u], two.unit_input[u], b1, b2)
        units.append(UnitFacts(name=name, params=one.unit_params[u], saved=saved[0], saved_fixed=saved[1],
                               kept=keep[0], kept_fixed=keep[1], input=inp[0], input_fixed=inp[1]))
    return StepTrace(layers=tuple(one.names), kernels=tuple(kernels), grad_ready=tuple(one.ready),
                     saved_bytes=per_saved, saved_fixed_bytes=fixed_saved, units=tuple(units),
                     param_unit=tuple(one.param_unit), saved_weight_copy_bytes=one.weight_copies,
                     transient_bytes=per_transient, transient_fixed_bytes=fixed_transient)
