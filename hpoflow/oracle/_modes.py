"""Function modes that make the meta device run a training step as a GPU would.

* :class:`Autocast`: ``torch.autocast``'s CUDA casting policy (autocast has no meta backend):
  matrix products, convolutions and attention on 16-bit copies of their inputs, softmax, norms and
  the loss in fp32, everything else in the dtype it receives. The storages of the 16-bit copies it
  makes of parameters are collected (FSDP with a 16-bit ``param_dtype`` makes none).
* :class:`FusedAttention`: ``scaled_dot_product_attention`` without a mask as a fused kernel
  (flash attention for 16-bit inputs, memory-efficient attention for fp32), not the math path the
  meta device takes, which would save the sequence-squared score matrix; grouped-query attention
  on the shared key/value heads, without copies, as flash attention runs it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

__all__ = ["DTYPES", "FP32_FUNCTIONS", "HALF_FUNCTIONS", "Autocast", "FusedAttention", "storage_key"]

#: torch functions autocast runs in 16-bit and in fp32 on CUDA (the matrix and reduction families)
HALF_FUNCTIONS = frozenset({"conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d",
                             "conv_transpose3d", "linear", "matmul", "__matmul__", "__rmatmul__",
                             "bmm", "mm", "addmm", "baddbmm", "einsum", "prelu",
                             "scaled_dot_product_attention"})
FP32_FUNCTIONS = frozenset({"softmax", "log_softmax", "layer_norm", "group_norm", "cross_entropy",
                             "nll_loss", "normalize", "cosine_similarity", "pdist", "cdist"})
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}

class Autocast(TorchFunctionMode):
    """``torch.autocast``'s CUDA casting policy, emulated where autocast cannot run (meta); the
    storages of the 16-bit copies it makes of parameters go into ``weight_copies``."""

    def __init__(self, dtype: torch.dtype, weight_copies: set[int]) -> None:
        super().__init__()
        self.dtype = dtype
        self.weight_copies = weight_copies
        self._alive: list[torch.Tensor] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = self.dtype if name in HALF_FUNCTIONS else torch.float32 if name in FP32_FUNCTIONS else None
        if target is not None:
            def cast(v: Any) -> Any:
                if isinstance(v, torch.Tensor) and v.is_floating_point() and v.dtype != target:
                    copy = v.to(target)
                    if isinstance(v, nn.Parameter) and (key := storage_key(copy)) is not None:
                        self.weight_copies.add(key)
                        self._alive.append(copy)  # its address must not be reused by another storage
                    return copy
                return v
            args = tuple(cast(a) for a in args)
            kwargs = {k: cast(v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


class FusedAttention(TorchFunctionMode):
    """``scaled_dot_product_attention`` without a mask as the fused kernel a GPU (or PyTorch's CPU
    flash kernel) runs, not the math path the meta device takes; grouped-query attention on the
    shared key/value heads (the query heads of a group become one longer query)."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") != "scaled_dot_product_attention":
            return func(*args, **kwargs)
        names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
        given = {**dict(zip(names, args, strict=False)), **kwargs}
        q, k, v = given["query"], given["key"], given["value"]
        if given.get("attn_mask") is not None or q.dim() != 4 or q.shape[1] % k.shape[1]:
            return func(*args, **kwargs)
        b, h, s, d = q.shape
        groups = h // k.shape[1]
        if groups > 1:  # each key/value head serves `groups` query heads
            q = q.reshape(b, k.shape[1], groups * s, d)
        dropout, causal, scale = float(given.get("dropout_p", 0.0)), bool(given.get("is_causal", False)), \
            given.get("scale")
        if q.dtype in (torch.float16, torch.bfloat16):
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout, causal, False, scale=scale)[0]
        else:
            out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout, causal,
                                                                          scale=scale)[0]
        return out.reshape(b, h, s, out.shape[-1])


def storage_key(t: torch.Tensor) -> int | None:
    """An identity of ``t``'s storage (views and in-place results share it), or None."""
    try:
        return int(t.untyped_storage()._cdata)
    except (RuntimeError, NotImplementedError):
        return None
