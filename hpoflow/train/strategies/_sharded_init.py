"""Build a model holding only this rank's shard of each tensor: ``fsdp`` sharded from the start.

``build_sharded(build, world, rank)`` runs the model's builder (``build()``, seeded by the caller as a
replica's is) under a dispatch mode in which every floating-point tensor of one or more dimensions
that the builder creates (``torch.empty``, ``zeros``, ``randn``, ``*_like``, ``new_*``: the storage of
``nn.Linear``'s weight, a buffer ...) is a meta tensor of its whole shape, backed by this rank's rows
of it only: rows ``[r·c, min((r+1)·c, n))`` of dim 0, ``c = ceil(n / p)``, the shard FSDP2's
``fully_shard`` keeps on rank r (``torch.chunk`` over dim 0). Each operation on such a tensor is
computed on the rows alone:

* random initialisation (ops tagged ``nondeterministic_seeded``: ``normal_``, ``uniform_`` of
  ``nn.init``, ``randn`` ...) runs on a scratch tensor of the whole shape, so the generator advances
  exactly as it does in a replica's build and the rows get a replica's values; the scratch is freed
  before the builder goes on;
* element-wise operations (the ``pointwise`` tag, and ``fill_``, ``zero_``, ``copy_``, ``_to_copy``)
  whose other operands are scalars, tensors broadcast along dim 0, or tensors of the same shape
  (their rows);
* views of the whole tensor (``detach``, ``alias``, same-shape ``view``) share its rows; other views
  (``w[0][0].numel()`` of ``nn.init``'s fan computation) answer shape questions only.

``nn.init``'s initialisations that read the tensor they fill (``trunc_normal_``'s rejection loop,
``orthogonal_``'s QR, ``sparse_``'s scatter) run as a whole on a scratch tensor too, the rows copied
from it (``_WHOLE_INITS``: while the build runs, ``torch.nn.init``'s functions of those names, and the
private helper ``trunc_normal_`` calls, are wrapped; a reference taken to another function before the
build is not). Anything else on a sharded tensor (a reduction, ``linalg_qr``, writing a slice, reading
a value) needs values of other ranks' rows: the build stops with :class:`NotShardable` naming the
operation, with torch's generators restored to where they were, so the caller can build the model whole
instead and get the same values. At most one tensor
exists whole at a time (the scratch of a random initialisation or of a non-empty factory), beside
this rank's rows of everything: no rank ever holds the whole model.

Every rank runs the same builder with the same seed, so the ranks' rows are the rows of one and the
same replica; the result, :class:`ShardedBuild`, holds the model on the meta device and each
parameter's and buffer's rows (or, for the few tensors kept whole: integer tensors, scalars, data
given by value, the whole tensor), which ``load_into`` hands to the model once ``fully_shard`` has
sharded it on the meta device.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["NotShardable", "ShardedBuild", "build_sharded", "shard_rows"]

_aten = torch.ops.aten
#: factories whose result needs no values (the rows are allocated directly, not sliced from a whole)
_EMPTY = {_aten.empty.memory_format, _aten.empty_strided.default, _aten.new_empty.default,
          _aten.new_empty_strided.default, _aten.empty_like.default}
_FACTORIES = _EMPTY | {
    _aten.zeros.default, _aten.ones.default, _aten.full.default, _aten.rand.default, _aten.randn.default,
    _aten.normal.float_float, _aten.new_zeros.default, _aten.new_ones.default, _aten.new_full.default,
    _aten.zeros_like.default, _aten.ones_like.default, _aten.full_like.default, _aten.rand_like.default,
    _aten.randn_like.default,
}
#: element-wise operations without the ``pointwise`` tag
_ELEMENTWISE = {_aten.fill_.Scalar, _aten.zero_.default, _aten.copy_.default, _aten._to_copy.default}


class NotShardable(Exception):
    """The builder did something that cannot be computed on this rank's rows alone."""


def shard_rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows ``[a, b)`` of a dim 0 of ``n`` that FSDP2 keeps on ``rank`` of ``world`` (``torch.chunk``:
    chunks of ``ceil(n / world)``; the last ranks' may be shorter or empty)."""
    c = -(-n // world)
    a = min(rank * c, n)
    return a, min(a + c, n)


@dataclass
class _Rows:
    """A tensor the builder created, as this rank's rows of it."""

    rows: torch.Tensor
    shape: torch.Size
    start: int


class _Handle(torch.Tensor):
    """What the builder holds for a tensor being built: its shape, dtype and device (not meta: the
    ``nn.init`` functions skip meta tensors), no storage; a view of it (``detach``, ``w[0]``) is another
    handle on the same rows. Only ``_ShardedMode`` computes with it."""

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]
    rows: _Rows

    @staticmethod
    def __new__(cls, like: torch.Tensor, rows: _Rows, device: torch.device) -> _Handle:
        h = torch.Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(),
                                                storage_offset=like.storage_offset(), dtype=like.dtype,
                                                device=device, requires_grad=False)
        h.rows = rows
        return h

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),  # type: ignore[override]
                           kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on a tensor of a sharded build outside the build")

    def whole(self) -> bool:
        """It views all of its tensor, in its layout."""
        return self.shape == self.rows.shape and self.storage_offset() == 0 and self.is_contiguous()

    def meta(self) -> torch.Tensor:
        """A meta tensor of the same shape, strides and offset (to compute shapes with)."""
        base = torch.empty(self.rows.shape.numel() or 1, dtype=self.dtype, device="meta")
        return base.as_strided(self.shape, self.stride(), self.storage_offset())


def _meta(x: Any) -> Any:
    if isinstance(x, _Handle):
        return x.meta()
    return x.to("meta") if isinstance(x, torch.Tensor) else x


def _mutates_first(func: Any) -> bool:
    schema = func._schema.arguments
    return bool(schema) and schema[0].alias_info is not None and schema[0].alias_info.is_write


class _ShardedMode(TorchDispatchMode):
    def __init__(self, world: int, rank: int) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.world, self.rank = world, rank

    def _whole(self, t: Any, func: Any) -> _Rows:
        if not isinstance(t, _Handle) or not t.whole():
            raise NotShardable(f"{func} on part of a tensor being built")
        return t.rows

    def _new(self, meta: torch.Tensor, device: torch.device, whole: torch.Tensor | None = None,
             rows: torch.Tensor | None = None) -> _Handle:
        a, b = shard_rows(meta.shape[0], self.world, self.rank)
        if rows is None:
            if whole is None:
                raise ValueError("a tensor being built needs its whole value or its rows")
            rows = whole[a:b].clone()
        return _Handle(meta, _Rows(rows, meta.shape, a), device)

    # -- the dispatch -------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _FACTORIES:
            return self._factory(func, args, kwargs)
        handles = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, _Handle)]
        if not handles:
            return func(*args, **kwargs)
        if func.is_view:  # another handle on the same rows (computing only on a whole view)
            out = func(*tree_map(_meta, args), **kwargs)
            return tree_map(lambda m: _Handle(m, handles[0].rows, handles[0].device)
                            if isinstance(m, torch.Tensor) else m, out)
        if torch.Tag.nondeterministic_seeded in func.tags:
            return self._random(func, args, kwargs)
        if torch.Tag.pointwise in func.tags or func in _ELEMENTWISE:
            return self._elementwise(func, args, kwargs)
        raise NotShardable(f"{func} on a tensor being built")

    def _factory(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        template = next((x for x in args if isinstance(x, torch.Tensor)), None)
        device = torch.device(kwargs["device"]) if kwargs.get("device") is not None else \
            template.device if template is not None else torch.device("cpu")
        meta = func(*tree_map(_meta, args), **{**kwargs, "device": "meta"})
        real = tuple(tree_map(lambda x: torch.empty(x.shape, dtype=x.dtype, device=device)
                              if isinstance(x, _Handle) else x, args))  # a template: shape, dtype, device
        if not meta.is_floating_point() or meta.dim() == 0:
            return func(*real, **kwargs)
        if func in _EMPTY:
            a, b = shard_rows(meta.shape[0], self.world, self.rank)
            return self._new(meta, device, rows=torch.empty((b - a, *meta.shape[1:]), dtype=meta.dtype,
                                                            device=device))
        whole = func(*real, **{**kwargs, "device": device})
        try:
            return self._new(meta, device, whole=whole)
        finally:
            del whole

    def _random(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An in-place random initialisation of a whole tensor: on a whole scratch, keep the rows."""
        if not _mutates_first(func) or any(isinstance(x, _Handle) for x in tree_flatten((args[1:], kwargs))[0]):
            raise NotShardable(f"{func} reading a tensor being built")
        _fill_from_whole(self._whole(args[0], func), lambda scratch: func(scratch, *args[1:], **kwargs))
        return args[0]

    def _elementwise(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        meta_kwargs = {**kwargs, "device": "meta"} if "device" in kwargs else kwargs
        meta = func(*tree_map(_meta, args), **meta_kwargs)
        if not isinstance(meta, torch.Tensor) or meta.dim() == 0:
            raise NotShardable(f"{func} giving a scalar or several tensors from a tensor being built")
        a, b = shard_rows(meta.shape[0], self.world, self.rank)

        def local(x: Any) -> Any:
            if isinstance(x, _Handle):
                if x.shape != meta.shape:
                    raise NotShardable(f"{func} broadcasting a tensor being built")
                return self._whole(x, func).rows
            if not isinstance(x, torch.Tensor):
                return x
            if x.is_meta:
                raise NotShardable(f"{func} on a meta tensor the builder made itself")
            if x.dim() < meta.dim() or x.shape[0] == 1:
                return x  # broadcast along dim 0: the same for every row
            if x.shape[0] == meta.shape[0]:
                return x[a:b]
            raise NotShardable(f"{func} with operands of shapes that do not split by rows")

        inplace = _mutates_first(func)
        if inplace and not isinstance(args[0], _Handle):
            raise NotShardable(f"{func} writing a tensor from one being built")
        out = func(*tree_map(local, args), **{k: tree_map(local, v) for k, v in kwargs.items()})
        if inplace:
            return args[0]
        return self._new(meta, out.device, rows=out)


@dataclass
class ShardedBuild:
    """A model on the meta device and this rank's part of each of its tensors (by name)."""

    model: nn.Module
    world: int
    rank: int
    rows: dict[str, torch.Tensor] = field(default_factory=dict)  # this rank's rows
    whole: dict[str, torch.Tensor] = field(default_factory=dict)  # kept whole (not floating, scalars)

    def load_into(self, model: nn.Module, device: torch.device) -> None:
        """Give ``model`` (this build's model, sharded by ``fully_shard`` on the meta device) its values
        on ``device``: each sharded parameter this rank's rows as its local shard, each buffer (FSDP2
        keeps buffers whole) its whole value, gathered from every rank's rows (a collective) where it
        was built in rows. One tensor at a time, assigned, not copied (``load_state_dict(assign=True)``;
        FSDP2 then pads the shard to its all-gather size), so no more than one tensor's rows exist twice."""
        for name, t in model.state_dict(keep_vars=True).items():
            if isinstance(t, DTensor):
                if name in self.whole:
                    a, b = shard_rows(t.shape[0], self.world, self.rank)
                    rows = self.whole.pop(name)[a:b]
                else:
                    rows = self.rows.pop(name)
                value: torch.Tensor = DTensor.from_local(rows.to(device), t.device_mesh, t.placements,
                                                         run_check=False, shape=t.shape, stride=t.stride())
                del rows
            elif name in self.whole:
                value = self.whole.pop(name).to(device)
            else:
                value = _gather_rows(self.rows.pop(name), t.shape, self.world).to(device)
            unexpected = model.load_state_dict({name: value}, strict=False, assign=True).unexpected_keys
            if unexpected:
                raise RuntimeError(f"fsdp: the sharded build's {name} is not the model's ({unexpected})")
            del value
        for name in list(self.rows) + list(self.whole):  # what state_dict leaves out: non-persistent buffers
            whole = self.whole.pop(name) if name in self.whole else \
                _gather_rows(self.rows.pop(name), model.get_buffer(name).shape, self.world)
            owner, _, leaf = name.rpartition(".")
            model.get_submodule(owner).register_buffer(leaf, whole.to(device), persistent=False)


def _named_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    return itertools.chain(model.named_parameters(remove_duplicate=False),
                           model.named_buffers(remove_duplicate=False))


def _gather_rows(rows: torch.Tensor, shape: torch.Size, world: int) -> torch.Tensor:
    """The whole tensor from every rank's rows (each padded to ``ceil(n / world)`` for the all-gather)."""
    if world == 1 or not dist.is_initialized():
        return rows
    c = -(-shape[0] // world)
    padded = rows.new_zeros((c, *shape[1:]))
    padded[: rows.shape[0]] = rows
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)[: shape[0]]


def _to_meta(model: nn.Module) -> None:
    """Every parameter and buffer of ``model`` replaced by a meta tensor of its shape (one per tensor:
    a parameter two modules share stays shared)."""
    done: dict[int, torch.Tensor] = {}

    def meta(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in done:
            m = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
            done[id(t)] = nn.Parameter(m, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else m
        return done[id(t)]

    for module in model.modules():
        for key, p in module._parameters.items():
            if p is not None:
                module._parameters[key] = meta(p)  # type: ignore[assignment]
        for key, b in module._buffers.items():
            if b is not None:
                module._buffers[key] = meta(b)


def _fill_from_whole(rows: _Rows, fill: Callable[[torch.Tensor], object]) -> None:
    """``fill`` a scratch tensor of the whole shape (at most one whole tensor at a time), then keep this
    rank's rows of it."""
    scratch = torch.empty(rows.shape, dtype=rows.rows.dtype, device=rows.rows.device)
    fill(scratch)
    rows.rows.copy_(scratch[rows.start : rows.start + rows.rows.shape[0]])
    del scratch


#: nn.init functions that read the tensor they fill: each runs whole on a scratch (module docs)
_WHOLE_INITS = ("trunc_normal_", "_no_grad_trunc_normal_", "orthogonal_", "sparse_")


def _on_scratch(init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` (an in-place ``nn.init`` function of a tensor, its first argument), for a tensor being
    built: run on a whole scratch tensor, outside the dispatch mode (the generator advances as in a
    replica's build), this rank's rows copied from it."""
    def wrapped(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(tensor, _Handle):
            return init(tensor, *args, **kwargs)
        if not tensor.whole():
            raise NotShardable(f"nn.init.{init.__name__} on part of a tensor being built")
        with _disable_current_modes():
            _fill_from_whole(tensor.rows, lambda scratch: init(scratch, *args, **kwargs))
        return tensor
    return wrapped


@contextlib.contextmanager
def _whole_inits() -> Iterator[None]:
    saved = {name: getattr(nn.init, name) for name in _WHOLE_INITS if hasattr(nn.init, name)}
    try:
        for name, fn in saved.items():
            setattr(nn.init, name, _on_scratch(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def build_sharded(build: Callable[[], nn.Module], world: int, rank: int) -> ShardedBuild:
    """Run ``build()`` keeping only rank ``rank``'s rows of each tensor (see the module docs);
    :class:`NotShardable` (torch's generators restored) where the builder needs more."""
    cpu_state = torch.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        with _whole_inits(), _ShardedMode(world, rank):
            model = build()
        if not isinstance(model, nn.Module):
            raise NotShardable(f"the builder returned a {type(model).__name__}, not an nn.Module")
        result = ShardedBuild(model, world, rank)
        for name, t in _named_tensors(model):
            if isinstance(t, _Handle):
                if not t.whole():
                    raise NotShardable(f"{name} is a view of part of a tensor")
                result.rows[name] = t.rows.rows
            elif t.is_meta:
                raise NotShardable(f"{name} is on the meta device already")
            else:
                result.whole[name] = t.detach()
    except NotShardable:
        torch.set_rng_state(cpu_state)
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        raise
    _to_meta(model)
    return result
