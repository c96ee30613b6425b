"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) per block. Every parameter, its gradient
and its optimizer state are sharded over the ranks (dim 0, padded to a multiple of p); a block's
parameters are all-gathered just before its forward and freed after it (``reshard_after_forward``,
then all-gathered again for its backward), and its gradients are reduce-scattered after its
backward, so each rank keeps ``1/p`` of everything but the block in use.

The blocks are the model's ``blocks`` (the built-in ``gpt``'s decoder blocks) if it has them, else its
top-level children that hold parameters; the root (the rest: embeddings, final norm, head) is one
more unit, which FSDP does not reshard after forward (its backward follows at once).

Options: ``reshard_after_forward`` (true), ``mixed_precision`` (none | bf16 | fp16: the dtype
parameters are all-gathered and computed in, ``MixedPrecisionPolicy.param_dtype``), ``reduce_dtype``
(fp32 | bf16 | fp16, fp32 by default whatever ``mixed_precision`` is: the dtype gradients are
reduce-scattered in, ``MixedPrecisionPolicy.reduce_dtype``); the sharded parameters, their gradients
and the optimizer stay fp32. ``cpu_offload`` (``CPUOffloadPolicy``: shards live in host memory
between uses; it needs an accelerator, so a CPU trial refuses it).

Per step and rank (sent), with ``M_g`` the fp32 bytes of unit g (padded), ``f`` the all-gather
dtype's size over 4 and ``r`` the reduce dtype's: all-gathers ``(p-1)/p·f·M_g`` once per forward,
once more per backward for a block resharded after forward; the reduce-scatter of the gradients
``(p-1)/p·r·M_g`` on NCCL, but ``2(p-1)/p·r·M_g`` on gloo, whose reduce-scatter runs as an all-reduce
(measured here: at p = 2 and p = 4 the kernel's byte count matches the all-reduce's volume). Every
all-gather and reduce-scatter goes through a timed communication object (``set_custom_all_gather`` /
``set_custom_reduce_scatter``).

Sharded from the start (``build``, what the built-in trainer calls): the model is built with only this
rank's rows of each tensor, a replica's values for the trial's seed (``_sharded_init``), sharded on the
meta device, and each shard handed its rows: no rank holds the whole model (with ``cpu_offload`` the
shards go to host memory directly). ``wrap(model)`` shards a model built whole (broadcast from rank 0
first, one tensor at a time), as does ``build`` where the builder needs whole tensors (with a warning).

Checkpoints take this rank's shards by name (``sharded``: ``_sharded_state``, DCP's ``get_state_dict`` /
``set_state_dict``), written and read by ``torch.distributed.checkpoint`` (the ``dcp`` format) at any
world size.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

try:  # FSDP2, and its default collectives (private: the comm meter subclasses them)
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather, DefaultReduceScatter
except ImportError as exc:  # an older torch than pyproject's floor for the other strategies
    raise ImportError(
        f"strategy fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard) and its collectives "
        f"(torch.distributed.fsdp._fully_shard._fsdp_collectives), which torch {torch.__version__} lacks "
        f"({exc}). Fix: install a newer torch (hpoflow is tested with 2.13), or use strategy allreduce or "
        "zero1") from exc

from hpoflow.train.strategies._base import CommMeter, OptimizerLike, Strategy
from hpoflow.train.strategies._sharded_init import NotShardable, build_sharded
from hpoflow.train.strategies._sharded_state import ShardedTemplate, sharded_items

__all__ = ["FSDP", "fsdp_units"]

_DTYPES = {"none": None, "fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def fsdp_units(model: nn.Module) -> list[nn.Module]:
    """The modules FSDP shards one by one: ``model.blocks`` if it is a list of modules, else the
    top-level children that hold parameters (the root takes what is left)."""
    blocks = getattr(model, "blocks", None)
    if isinstance(blocks, nn.ModuleList | nn.Sequential) and len(blocks):
        return list(blocks)
    return [m for m in model.children() if any(True for _ in m.parameters())]


def _timed(meter: CommMeter, t0: float, work: dist.Work | None, estimate: float) -> dist.Work | None:
    if work is None:  # blocking: done now
        meter.add_interval(t0, time.perf_counter(), estimate)
        return None
    work.get_future().then(lambda _f: meter.add_interval(t0, time.perf_counter(), estimate))
    return work


class _TimedAllGather(DefaultAllGather):
    def __init__(self, meter: CommMeter) -> None:
        super().__init__()
        self.meter = meter

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        t0 = time.perf_counter()
        estimate = (group.size() - 1) * input_tensor.numel() * input_tensor.element_size()
        return _timed(self.meter, t0, super().__call__(output_tensor, input_tensor, group, async_op), estimate)


class _TimedReduceScatter(DefaultReduceScatter):
    def __init__(self, meter: CommMeter, factor: float) -> None:
        super().__init__()
        self.meter = meter
        self.factor = factor  # bytes sent per byte of input: the backend's algorithm

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work:
        t0 = time.perf_counter()
        estimate = self.factor * input_tensor.numel() * input_tensor.element_size()
        work = super().__call__(output_tensor, input_tensor, group, op, async_op)
        _timed(self.meter, t0, work if async_op else None, estimate)
        return work


def reduce_scatter_factor(backend: str, world: int) -> float:
    """Bytes a rank sends per byte of a reduce-scatter's input: ``(p-1)/p`` for a ring (NCCL), but
    ``2(p-1)/p`` on gloo, which runs it as an all-reduce and keeps its shard."""
    ring = (world - 1) / world
    return 2 * ring if backend == "gloo" else ring


class FSDP(Strategy):
    """Options: ``reshard_after_forward``, ``mixed_precision`` (none | bf16 | fp16), ``reduce_dtype``
    (fp32 | bf16 | fp16), ``cpu_offload``."""

    name = "fsdp"
    sharded = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._root: FSDPModule | None = None
        self._units: list[tuple[int, bool]] = []  # (padded fp32 bytes, resharded after forward) per unit
        self._backend = "gloo"

    @property
    def reshard(self) -> bool:
        return bool(self.options.get("reshard_after_forward", True))

    @property
    def param_dtype(self) -> torch.dtype | None:
        return _DTYPES[str(self.options.get("mixed_precision", "none"))]

    @property
    def reduce_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduce-scattered in (``None``: fp32, theirs)."""
        return _DTYPES[str(self.options.get("reduce_dtype", "fp32"))]

    def mp_policy(self) -> MixedPrecisionPolicy | None:
        """FSDP2's policy: parameters gathered in ``mixed_precision``, gradients reduced in
        ``reduce_dtype`` (fp32 unless asked); ``None`` when both are fp32."""
        if self.param_dtype is None and self.reduce_dtype is None:
            return None
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype or torch.float32)

    def build(self, builder: Callable[[], nn.Module]) -> nn.Module:
        """Sharded from the start: the model is built with this rank's rows of each tensor only
        (``_sharded_init``, a replica's values), on the meta device, then sharded, and each shard takes
        its rows (in host memory with ``cpu_offload``). A builder that
        needs more than the rows (``NotShardable``) gets the whole model built, with a warning."""
        if not self.distributed:
            return super().build(builder)
        self._check_offload()
        try:
            built = build_sharded(builder, self.env.world_size, self.env.rank)
        except NotShardable as exc:
            warnings.warn(f"fsdp: the model cannot be built shard by shard ({exc}): every rank builds it whole "
                          "and then shards it, so its start-up holds the whole model", RuntimeWarning, stacklevel=2)
            return super().build(builder)
        model = built.model
        self._attach(model)
        self._shard(model)
        built.load_into(model, torch.device("cpu") if self.options.get("cpu_offload") else self.env.device)
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model

    def wrap(self, model: nn.Module) -> nn.Module:
        """Shard a model built whole (every rank starts from rank 0's parameters, broadcast first)."""
        self._attach(model)
        if not self.distributed:
            return model
        self._check_offload()
        self._broadcast_params()  # every rank shards the same full parameters
        self._shard(model)
        self.params = [p for p in model.parameters() if p.requires_grad]
        return model

    def _check_offload(self) -> None:
        if self.options.get("cpu_offload") and self.env.device.type == "cpu":
            raise ValueError("fsdp: cpu_offload needs an accelerator: FSDP2's CPUOffloadPolicy keeps the shards "
                             "in host memory and computes on the device (torch refuses it without one), and this "
                             "rank trains on the CPU. Fix: set cpu_offload: false, or give the trial GPUs")

    def _shard(self, model: nn.Module) -> None:
        """``fully_shard`` on each unit and the root, every collective timed."""
        world = self.env.world_size
        self._backend = str(dist.get_backend())
        kw: dict[str, Any] = {}
        policy = self.mp_policy()
        if policy is not None:
            kw["mp_policy"] = policy
        if self.options.get("cpu_offload"):
            kw["offload_policy"] = CPUOffloadPolicy()
        units = fsdp_units(model)
        in_units = {id(p) for u in units for p in u.parameters()}
        root_bytes = sum(_padded_bytes(p, world) for p in model.parameters() if id(p) not in in_units)
        self._units = [(sum(_padded_bytes(p, world) for p in u.parameters()), self.reshard) for u in units]
        self._units.append((root_bytes, False))  # FSDP keeps the root unsharded from forward to backward
        for unit in units:
            fully_shard(unit, reshard_after_forward=self.reshard, **kw)
        # None: FSDP's own choice for the root (not resharded after forward); False keeps everything
        root = fully_shard(model, reshard_after_forward=None if self.reshard else False, **kw)
        factor = reduce_scatter_factor(self._backend, world)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_custom_all_gather(_TimedAllGather(self.meter))
                module.set_custom_reduce_scatter(_TimedReduceScatter(self.meter, factor))
        self._root = root

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self._no_sync() if self._root is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def _no_sync(self) -> Iterator[None]:
        """Micro-batches that only accumulate (unsharded) gradients: no reduce-scatter."""
        root = self._root
        if root is None:
            raise RuntimeError("fsdp: no_sync() before wrap()")
        root.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            root.set_requires_gradient_sync(True)

    def step(self, optimizer: OptimizerLike) -> None:
        optimizer.step()  # the gradients were reduce-scattered during backward

    def theoretical_bytes_per_step(self) -> float:
        """This rank's all-gathers (per forward, and per backward for a resharded unit) and
        reduce-scatters, at the all-gather and the reduce dtypes (see the module docstring)."""
        if not self.distributed:
            return 0.0
        world = self.env.world_size
        f = 0.5 if self.param_dtype is not None else 1.0
        r = 0.5 if self.reduce_dtype is not None else 1.0
        gather = (world - 1) / world
        scatter = reduce_scatter_factor(self._backend, world)
        return sum(m * (f * gather * (2 if resharded else 1) + r * scatter) for m, resharded in self._units)

    def make_grad_scaler(self) -> torch.amp.GradScaler:
        """Each rank holds different gradient shards: the scaler all-reduces its inf check."""
        if self._root is None:
            return super().make_grad_scaler()
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(self.env.device.type)

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # sharded: sharded_state

    def load_training_state(self, state: Mapping[str, Any], model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
        """Nothing: the model and the optimizer came through ``sharded_template``."""

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        return sharded_items(model, optimizer)

    def sharded_template(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> ShardedTemplate:
        return ShardedTemplate(model, optimizer)


def _padded_bytes(p: nn.Parameter, world: int) -> int:
    """fp32-equivalent bytes of ``p`` as FSDP shards it: dim 0 padded to a multiple of ``world``."""
    if p.dim() == 0:
        return world * p.element_size()
    rows = -(-p.shape[0] // world) * world
    return rows * (p.numel() // p.shape[0] if p.shape[0] else 0) * p.element_size()
