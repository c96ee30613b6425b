"""``allreduce``: DistributedDataParallel (bucketed ring all-reduce of gradients, overlapped with
backward), optionally compressed by a DDP communication hook (fp16, bf16 or PowerSGD).

Every bucket's all-reduce goes through a timing hook: it records the interval from issue to the
completion of the bucket's future (the communication time) and an estimate of the bytes sent.
"""

from __future__ import annotations

import contextlib
import inspect
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed import GradBucket  # type: ignore[attr-defined]  # not re-exported in the stubs
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from hpoflow.train.collectives import ring_allreduce_bytes
from hpoflow.train.strategies._base import OptimizerLike, Strategy

__all__ = ["AllReduce"]

_HOOK_SIGNATURE = inspect.Signature([
    inspect.Parameter("state", inspect.Parameter.POSITIONAL_OR_KEYWORD),
    inspect.Parameter("bucket", inspect.Parameter.POSITIONAL_OR_KEYWORD),
])
_COMPRESSION_FACTOR = {"none": 1.0, "fp16": 0.5, "bf16": 0.5}


class AllReduce(Strategy):
    """Options: ``bucket_cap_mb``, ``gradient_as_bucket_view``, ``compression``
    (none | fp16 | bf16 | powersgd), ``powersgd_rank``, ``powersgd_start_iter``."""

    name = "allreduce"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ddp: DistributedDataParallel | None = None

    @property
    def compression(self) -> str:
        """The gradients' all-reduce: none (fp32), fp16, bf16 or powersgd."""
        return str(self.options.get("compression", "none"))

    def wrap(self, model: nn.Module) -> nn.Module:
        self._attach(model)
        if not self.distributed:
            return model
        o = self.options
        device_ids = None if self.env.device.type == "cpu" else [self.env.device]
        ddp = DistributedDataParallel(
            model, device_ids=device_ids, bucket_cap_mb=float(o.get("bucket_cap_mb", 25.0)),
            gradient_as_bucket_view=bool(o.get("gradient_as_bucket_view", False)),
        )
        state, inner = self._inner_hook(self.compression)
        ddp.register_comm_hook(state, self._timed(inner))
        self._ddp = ddp
        return ddp

    def _inner_hook(self, compression: str) -> tuple[Any, Callable[..., torch.futures.Future[Any]]]:
        if compression == "none":
            return None, default_hooks.allreduce_hook
        if compression == "fp16":
            return None, default_hooks.fp16_compress_hook
        if compression == "bf16":
            return None, default_hooks.bf16_compress_hook
        if compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=None,
                matrix_approximation_rank=int(self.options.get("powersgd_rank", 1)),
                start_powerSGD_iter=int(self.options.get("powersgd_start_iter", 2)),
                random_seed=0,
            )
            return state, powerSGD_hook.powerSGD_hook
        raise ValueError(f"allreduce: unknown compression {compression!r}; valid: none, fp16, "
                         "bf16, powersgd")

    def _timed(self, inner: Callable[..., torch.futures.Future[Any]]
               ) -> Callable[..., torch.futures.Future[Any]]:
        meter = self.meter
        factor = _COMPRESSION_FACTOR.get(self.compression, 1.0)
        world = self.env.world_size

        def timed_hook(state: Any, bucket: GradBucket) -> torch.futures.Future[Any]:
            t0 = time.perf_counter()
            buf = bucket.buffer()
            estimate = ring_allreduce_bytes(buf.numel() * buf.element_size() * factor, world)
            fut = inner(state, bucket)

            def done(f: torch.futures.Future[Any]) -> Any:
                meter.add_interval(t0, time.perf_counter(), estimate)
                return f.value()

            return fut.then(done)

        # DDP rejects hooks whose (string, postponed) annotations are not its own types.
        timed_hook.__signature__ = _HOOK_SIGNATURE  # type: ignore[attr-defined]
        return timed_hook

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if self.compression == "powersgd":
            warnings.warn("allreduce: PowerSGD's error feedback and warm-start matrices are not "
                          "checkpointed; after a resume they start over (the run is not bitwise the "
                          "uninterrupted one)", RuntimeWarning, stacklevel=2)

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        return self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()

    def step(self, optimizer: OptimizerLike) -> None:
        optimizer.step()  # DDP has already averaged the gradients during backward

    def theoretical_bytes_per_step(self) -> float:
        if not self.distributed:
            return 0.0
        compression = self.compression
        if compression == "powersgd":
            return ring_allreduce_bytes(self._powersgd_payload(), self.env.world_size)
        return ring_allreduce_bytes(self.model_bytes * _COMPRESSION_FACTOR[compression],
                                    self.env.world_size)

    def _powersgd_payload(self) -> float:
        """Bytes PowerSGD all-reduces per step once compressing: vectors uncompressed, an n x m
        matrix as P (n x r) and Q (m x r) when that saves at least 2x (torch's default rule)."""
        r = int(self.options.get("powersgd_rank", 1))
        total = 0.0
        for p in self.params:
            size = p.element_size()
            if p.dim() <= 1:
                total += p.numel() * size
                continue
            n = p.shape[0]
            m = p.numel() // n
            compressed = (n + m) * min(r, n, m)
            total += size * (compressed if n * m >= 2 * compressed else n * m)
        return total
