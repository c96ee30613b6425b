"""``zero1``: ZeRO stage 1. Gradients are all-reduced by DDP (as ``allreduce``, through the same timed
communication hook); the optimizer state is sharded: ``torch.distributed.optim.ZeroRedundancyOptimizer``
gives each rank a share of the parameters (whole tensors, balanced by size), keeps the optimizer
state of that share only, steps it, and then every rank broadcasts its updated share to the others.

Per step and rank (sent): the gradients' ring all-reduce ``2(p-1)/p·M``, then its share ``M_r`` to
each of the ``p - 1`` others, ``(p-1)·M_r`` (``(p-1)/p·M`` when the shares are even). The broadcast
is timed apart from the optimizer's own step (``ZeroRedundancyOptimizer._sync_params``).

Gradients: the parameters stay fp32 (``precision: bf16 | fp16`` only autocasts the forward), so their
gradients are fp32 and all-reduced in fp32; ``reduce_dtype: bf16 | fp16`` all-reduces them in that
dtype instead (DDP's ``bf16_compress_hook`` / ``fp16_compress_hook``, as ``allreduce``'s
``compression``: ``r·2(p-1)/p·M`` with ``r`` the dtype's size over 4).

Checkpoints take the replicated model and this rank's share of the optimizer state by parameter name
(``sharded``: ``_sharded_state``), written and read by ``torch.distributed.checkpoint`` (the ``dcp``
format): at another world size each rank reads the state of its new share.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from hpoflow.train.strategies._allreduce import AllReduce
from hpoflow.train.strategies._sharded_state import ShardedTemplate, sharded_items

__all__ = ["ZeRO1"]


class ZeRO1(AllReduce):
    """Options: ``bucket_cap_mb`` (DDP's buckets), ``reduce_dtype`` (fp32 | bf16 | fp16)."""

    name = "zero1"
    sharded = True

    @property
    def compression(self) -> str:
        """``reduce_dtype`` as DDP's communication hook (fp32: none)."""
        dtype = str(self.options.get("reduce_dtype", "fp32"))
        return "none" if dtype == "fp32" else dtype

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._zero: ZeroRedundancyOptimizer | None = None

    def build_optimizer(self, params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                        **defaults: Any) -> torch.optim.Optimizer:
        if not self.distributed:
            return optimizer_class(params, **defaults)
        zero = ZeroRedundancyOptimizer(params, optimizer_class=optimizer_class, **defaults)
        sync = getattr(zero, "_sync_params", None)
        if callable(sync):  # time the shards' broadcast apart from the local step
            meter, estimate = self.meter, self._broadcast_bytes(zero)

            def timed_sync() -> None:
                t0 = time.perf_counter()
                sync()
                meter.add_interval(t0, time.perf_counter(), estimate)

            setattr(zero, "_sync_params", timed_sync)  # noqa: B010 - a private method, replaced on this instance
        self._zero = zero
        return zero

    def _broadcast_bytes(self, zero: ZeroRedundancyOptimizer) -> float:
        """What this rank sends to broadcast its share: ``(p-1)`` copies of it."""
        own = sum(p.numel() * p.element_size() for g in zero.optim.param_groups for p in g["params"])
        return float((self.env.world_size - 1) * own)

    def theoretical_bytes_per_step(self) -> float:
        if not self.distributed or self._zero is None:
            return 0.0
        return super().theoretical_bytes_per_step() + self._broadcast_bytes(self._zero)

    def _local(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer over this rank's share (ZeRO's inner one), or ``optimizer`` on one rank."""
        return self._zero.optim if self._zero is not None else optimizer

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # sharded: sharded_state

    def load_training_state(self, state: Mapping[str, Any], model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
        """Nothing: the model and the optimizer came through ``sharded_template``."""

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """The model (the same on every rank) and the optimizer state of this rank's share, by name."""
        return sharded_items(model, self._local(optimizer))

    def sharded_template(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> ShardedTemplate:
        return ShardedTemplate(model, self._local(optimizer))
