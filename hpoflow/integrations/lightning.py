"""A Lightning ``Callback`` for a script run as an hpoflow command trial: after each validation it reports
the logged metrics (``trainer.callback_metrics``) to the trial from the global rank 0, and stops the
``Trainer`` when the trial is pruned or paused (every rank alike: rank 0's answer is broadcast through
the trainer's strategy). ::

    from hpoflow.integrations.lightning import HpoflowCallback
    trainer = lightning.Trainer(..., callbacks=[HpoflowCallback()])

Works in a multi-rank trial where Lightning's DDP starts from torchrun's environment, which the trial
gives every rank. Outside a trial (plain ``torchrun``, a notebook) it reports nothing and never stops.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl

from hpoflow import client

__all__ = ["HpoflowCallback"]


class HpoflowCallback(pl.Callback):
    """Report ``metrics`` (names in ``trainer.callback_metrics``; default: every logged metric that is a
    number) after each validation, at step ``trainer.current_epoch + 1``; stop the trainer when the trial
    says so (``hpoflow.client.should_stop``)."""

    def __init__(self, metrics: Sequence[str] | None = None) -> None:
        super().__init__()
        self.metrics = tuple(metrics) if metrics is not None else None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not client.in_trial():
            return
        stop = False
        if trainer.is_global_zero:
            values = _numbers(trainer.callback_metrics, self.metrics)
            if values:
                client.report(trainer.current_epoch + 1, **values)
            stop = client.should_stop()
        if trainer.world_size > 1:
            stop = bool(trainer.strategy.broadcast(stop, src=0))
        if stop:
            trainer.should_stop = True


def _numbers(logged: dict[str, Any], names: tuple[str, ...] | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, value in logged.items():
        if names is not None and name not in names:
            continue
        try:
            out[str(name)] = float(value)
        except (TypeError, ValueError, RuntimeError):  # a tensor of several values, a string
            continue
    return out
