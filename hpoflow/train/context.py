"""``TrialContext``: what a training function (built-in or the user's) receives inside a trial."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpoflow.spec import TrainConfig
from hpoflow.train.channel import Channel, NullChannel

__all__ = ["TrialContext"]


@dataclass
class TrialContext:
    """The trial as seen from one rank.

    ``params`` are the sampled hyperparameters, ``config`` the resolved training config. Rank 0
    calls ``report(step, **metrics)`` after each epoch (other ranks may call it too: only rank 0's
    reports are sent); every rank then calls ``should_stop()`` at the same step, which broadcasts
    rank 0's pruning decision so no rank is left waiting in a collective.
    """

    params: dict[str, Any]
    config: TrainConfig
    trial_number: int
    trial_dir: Path
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    metric: str = "val_accuracy"
    pruning: bool = False
    channel: Channel = field(default_factory=NullChannel)
    attempt: int = 0
    reports: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    _prune: bool = False

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def options(self) -> dict[str, Any]:
        """Free-form ``training.options`` of the spec (for user functions)."""
        return self.config.options

    def report(self, step: int, **metrics: float) -> None:
        """Record intermediate ``metrics`` at ``step``; rank 0 sends them to the study's storage."""
        clean = {k: float(v) for k, v in metrics.items()}
        self.reports.append((int(step), clean))
        if self.rank != 0:
            return
        wants = self.pruning and self.metric in clean and math.isfinite(clean[self.metric])
        self._prune = self.channel.report(int(step), clean, wants)

    def should_stop(self) -> bool:
        """Whether the trial has been pruned. Collective in a DDP trial: every rank must call it."""
        flag = self._prune
        if self.distributed:
            t = torch.tensor([1 if flag else 0], dtype=torch.int32)
            dist.broadcast(t, src=0)
            flag = bool(t.item())
        self._prune = flag
        return flag

    def log_path(self) -> Path:
        return self.trial_dir / f"rank{self.rank}.log"

    def env(self, name: str, default: str = "") -> str:  # pragma: no cover - convenience
        return os.environ.get(name, default)
