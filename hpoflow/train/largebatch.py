"""Large-batch control: learning-rate scaling with the global batch, warm-up, and LARS.

The global batch of a step is ``batch_size * world_size * grad_accum_steps``. With
``lr_scaling: linear`` the target learning rate is ``lr * global / base`` (Goyal et al. 2017),
with ``sqrt`` it is ``lr * sqrt(global / base)`` (Krizhevsky 2014; suits adaptive optimizers);
``base_batch_size`` is the batch the spec's ``lr`` was tuned for (default: ``batch_size``, one rank
without accumulation). Warm-up raises the rate linearly over ``warmup_epochs`` worth of optimizer
steps: from the unscaled ``lr`` to the target when scaling (Goyal's gradual warm-up), from
``target / warmup_steps`` when not. LARS (You, Gitman & Ginsburg 2017) wraps any optimizer and
rescales each weight matrix's gradient by ``trust * ||w|| / (||g|| + wd * ||w||)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from hpoflow.spec import TrainConfig
from hpoflow.train.strategies import OptimizerLike

__all__ = ["LARS", "LrSchedule", "global_batch", "scaled_lr"]


def global_batch(batch_size: int, world_size: int, grad_accum_steps: int = 1) -> int:
    """Samples that contribute to one optimizer step across all ranks."""
    return batch_size * world_size * grad_accum_steps


def scaled_lr(lr: float, rule: str, global_batch_size: int, base_batch_size: int) -> float:
    """``lr`` scaled from ``base_batch_size`` to ``global_batch_size`` by ``rule``."""
    if global_batch_size < 1 or base_batch_size < 1:
        raise ValueError(f"batch sizes must be >= 1, but got global={global_batch_size}, "
                         f"base={base_batch_size}")
    k = global_batch_size / base_batch_size
    if rule == "none":
        return lr
    if rule == "linear":
        return lr * k
    if rule == "sqrt":
        return lr * math.sqrt(k)
    raise ValueError(f"unknown lr_scaling {rule!r}; valid: none, linear, sqrt")


@dataclass(frozen=True)
class LrSchedule:
    """Learning rate of every optimizer step: warm-up from ``start_lr`` to ``target_lr``, then flat."""

    target_lr: float
    start_lr: float
    warmup_steps: int = 0

    @classmethod
    def from_config(cls, cfg: TrainConfig, world_size: int, steps_per_epoch: int) -> LrSchedule:
        g = global_batch(cfg.batch_size, world_size, cfg.grad_accum_steps)
        target = scaled_lr(cfg.lr, cfg.lr_scaling, g, cfg.base_batch_size or cfg.batch_size)
        warmup = round(cfg.warmup_epochs * steps_per_epoch)
        if warmup > 0 and cfg.lr_scaling != "none" and target > cfg.lr:
            start = cfg.lr
        elif warmup > 0:
            start = target / warmup
        else:
            start = target
        return cls(target, start, warmup)

    def lr_at(self, step: int) -> float:
        """Learning rate for optimizer step ``step`` (0-based)."""
        if self.warmup_steps <= 0 or step >= self.warmup_steps:
            return self.target_lr
        if self.warmup_steps == 1:
            return self.start_lr
        frac = step / (self.warmup_steps - 1)
        return self.start_lr + (self.target_lr - self.start_lr) * frac

    def apply(self, optimizer: OptimizerLike, step: int) -> float:
        lr = self.lr_at(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        return lr


class LARS:
    """Layer-wise adaptive rate scaling around a torch optimizer.

    Before the inner step, each parameter with ``ndim > 1`` (biases and norms are left alone unless
    ``exclude_vectors=False``) gets ``g <- (g + wd * w) * trust * ||w|| / (||g|| + wd * ||w|| + eps)``
    and the inner optimizer runs with weight decay 0 (it is already in ``g``), so a plain SGD step
    moves each layer by ``lr * trust * ||w||``, whatever the scale of its gradient.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, trust_coefficient: float = 0.001,
                 eps: float = 1e-8, exclude_vectors: bool = True) -> None:
        if trust_coefficient <= 0:
            raise ValueError(f"LARS trust_coefficient must be > 0, but got {trust_coefficient}")
        self.optimizer = optimizer
        self.trust_coefficient = trust_coefficient
        self.eps = eps
        self.exclude_vectors = exclude_vectors

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)

    @torch.no_grad()
    def step(self) -> Any:
        saved = []
        for group in self.optimizer.param_groups:
            wd = float(group.get("weight_decay", 0.0))
            for p in group["params"]:
                if p.grad is None or (self.exclude_vectors and p.ndim <= 1):
                    continue
                w_norm = float(torch.linalg.vector_norm(p))
                g_norm = float(torch.linalg.vector_norm(p.grad))
                if w_norm > 0 and g_norm > 0:
                    local = self.trust_coefficient * w_norm / (g_norm + wd * w_norm + self.eps)
                    if wd:
                        p.grad.add_(p, alpha=wd)
                    p.grad.mul_(local)
            saved.append(wd)
            group["weight_decay"] = 0.0
        try:
            return self.optimizer.step()
        finally:
            for group, wd in zip(self.optimizer.param_groups, saved, strict=True):
                group["weight_decay"] = wd
