"""``easgd``: synchronous elastic averaging SGD (Zhang, Choromanska & LeCun 2015; the synchronous
HPC design of You et al. 2017), and its momentum variant MEASGD.

Each rank trains its own copy ``x_i`` with local steps; every rank also holds the center variable
``c``. Every ``tau`` steps, with ``d_i = x_i - c`` and one all-reduce of ``d_i``:

    x_i <- x_i - alpha * d_i            c <- c + alpha * sum_i d_i

so ``c`` moves by ``beta = p * alpha`` times the mean difference. The center starts as rank 0's
weights and changes only by the all-reduced sum, which every rank receives bit for bit, so it is
identical on every rank; it is what ``eval_module()`` returns. ``alpha`` defaults to ``0.9 / p``
(``beta = 0.9``, the paper's choice); ``rho`` gives ``alpha = lr * rho`` instead.
``momentum: true`` (MEASGD) puts Nesterov momentum ``momentum_coefficient`` on each worker's local
SGD step (the spec requires ``optimizer: sgd`` for it). Volume: ``2 (p - 1) / p * M`` every
``tau`` steps.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpoflow.train.collectives import ring_allreduce_bytes
from hpoflow.train.strategies._base import (
    OptimizerLike,
    Strategy,
    flat_params,
    load_flat,
)

__all__ = ["EASGD"]


class EASGD(Strategy):
    """Options: ``alpha`` or ``rho``, ``tau``, ``momentum``, ``momentum_coefficient``."""

    name = "easgd"

    def wrap(self, model: nn.Module) -> nn.Module:
        self._attach(model)
        o = self.options
        world = self.env.world_size
        self.tau = int(o.get("tau", 4))
        if o.get("alpha") is not None:
            self.alpha = float(o["alpha"])
        elif o.get("rho") is not None:
            self.alpha = self.env.lr * float(o["rho"])
        else:
            self.alpha = 0.9 / world
        if self.alpha * world >= 2:
            raise ValueError(
                f"easgd: the center's move beta = p * alpha must stay below 2 to be stable, but "
                f"got p={world}, alpha={self.alpha:g}. Fix: lower strategy_options.alpha (or rho)")
        self._broadcast_params()
        self.center = flat_params(self.params).clone()
        self._center_model = copy.deepcopy(model)
        self._steps = 0
        return model

    def prepare_optimizer(self, optimizer: OptimizerLike) -> None:
        if not self.options.get("momentum"):
            return
        delta = float(self.options.get("momentum_coefficient", 0.9))
        for group in optimizer.param_groups:
            if "nesterov" not in group:
                raise ValueError("easgd momentum: true needs the sgd optimizer (Nesterov momentum)")
            group["momentum"], group["nesterov"], group["dampening"] = delta, True, 0.0

    def step(self, optimizer: OptimizerLike) -> None:
        optimizer.step()
        self._steps += 1
        if self._steps % self.tau == 0:
            self.elastic_update()

    def elastic_update(self) -> None:
        """One synchronous elastic round (a collective)."""
        x = flat_params(self.params)
        diff = x - self.center
        total = diff.clone()
        if self.distributed:
            with self.meter.timed(ring_allreduce_bytes(total.numel() * total.element_size(),
                                                       self.env.world_size)):
                dist.all_reduce(total)
        load_flat(self.params, x - self.alpha * diff)
        self.center += self.alpha * total

    def eval_module(self) -> nn.Module:
        load_flat([p for p in self._center_model.parameters() if p.requires_grad], self.center)
        return self._center_model

    def center_vector(self) -> torch.Tensor:
        return self.center.clone()

    def state_dict(self) -> dict[str, Any]:
        """The center (identical on every rank) and the step counter (the local model is the
        model's own state; its momentum the optimizer's)."""
        return {**super().state_dict(), "center": self.center, "steps": self._steps, "tau": self.tau}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        center = state["center"]
        if tuple(center.shape) != tuple(self.center.shape) or int(state["tau"]) != self.tau:
            raise ValueError(
                f"checkpoint: easgd state has a center of {tuple(center.shape)} values and tau={state['tau']}, "
                f"but this trial has {tuple(self.center.shape)} and tau={self.tau}. Fix: resume with the same "
                "model and strategy_options, or delete the checkpoint directory")
        self.center.copy_(center)
        self._steps = int(state["steps"])

    def theoretical_bytes_per_step(self) -> float:
        if not self.distributed:
            return 0.0
        return ring_allreduce_bytes(self.model_bytes, self.env.world_size) / self.tau
