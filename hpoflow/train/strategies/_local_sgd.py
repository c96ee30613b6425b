"""``local_sgd``: every rank takes local optimizer steps; every ``period`` steps (H) the ranks
average their parameters with one all-reduce (periodic model averaging, Lin et al. 2020). At the end
of each epoch the models are averaged once more (unless they just were) so that every rank
evaluates the same model; that traffic is reported apart (``sync_bytes``). Volume:
``2 (p - 1) / p * M`` every H steps.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch import nn

from hpoflow.train.collectives import ring_allreduce_bytes
from hpoflow.train.strategies._base import (
    OptimizerLike,
    Strategy,
    flat_params,
    load_flat,
)

__all__ = ["LocalSGD"]


class LocalSGD(Strategy):
    """Options: ``period`` (H, optimizer steps between averagings; default 8)."""

    name = "local_sgd"

    def wrap(self, model: nn.Module) -> nn.Module:
        self._attach(model)
        self.period = int(self.options.get("period", 8))
        self._steps = 0
        self._in_sync = True
        self._broadcast_params()
        return model

    def step(self, optimizer: OptimizerLike) -> None:
        optimizer.step()
        self._steps += 1
        self._in_sync = False
        if self._steps % self.period == 0:
            with self.meter.timed(self._volume()):
                self._average()

    def end_epoch(self) -> None:
        if not self._in_sync:
            with self.meter.outside_step(self._volume()):
                self._average()

    def _volume(self) -> float:
        return ring_allreduce_bytes(self.model_bytes, self.env.world_size)

    def _average(self) -> None:
        if self.distributed:
            flat = flat_params(self.params)
            dist.all_reduce(flat)
            flat /= self.env.world_size
            load_flat(self.params, flat)
        self._in_sync = True

    def state_dict(self) -> dict[str, Any]:
        """Step counter (the averaging phase) and whether the ranks' models are averaged now."""
        return {**super().state_dict(), "steps": self._steps, "in_sync": self._in_sync, "period": self.period}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if int(state["period"]) != self.period:
            raise ValueError(f"checkpoint: local_sgd state has period={state['period']}, but this trial "
                             f"has period={self.period}. Fix: resume with the same strategy_options.period")
        self._steps = int(state["steps"])
        self._in_sync = bool(state["in_sync"])

    def theoretical_bytes_per_step(self) -> float:
        return self._volume() / self.period if self.distributed else 0.0
