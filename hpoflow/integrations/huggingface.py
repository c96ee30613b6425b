"""A Hugging Face ``TrainerCallback`` for a script run as an hpoflow command trial: after each evaluation
it reports the evaluation metrics (``eval_loss``, ...) to the trial from the main process, and stops the
``Trainer`` when the trial is pruned or paused (every rank alike: the main process's answer is broadcast
over the trainer's process group). ::

    from hpoflow.integrations.huggingface import HpoflowCallback
    trainer = transformers.Trainer(..., callbacks=[HpoflowCallback()])

The step of a report is ``state.global_step``, or the epoch (``round(state.epoch)``) with
``by_epoch=True``. Works in a multi-rank trial where the Trainer's DDP starts from torchrun's environment,
which the trial gives every rank. Outside a trial it reports nothing and never stops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from hpoflow import client

__all__ = ["HpoflowCallback"]


class HpoflowCallback(TrainerCallback):
    """Report each evaluation's metrics (default: all numbers in it; ``metrics``: these names) and stop
    training when the trial says so (``hpoflow.client.should_stop``)."""

    def __init__(self, metrics: list[str] | None = None, *, by_epoch: bool = False) -> None:
        self.metrics = tuple(metrics) if metrics is not None else None
        self.by_epoch = by_epoch

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not client.in_trial():
            return
        stop = False
        if state.is_world_process_zero:
            values = {}
            for name, value in (metrics or {}).items():
                if self.metrics is not None and name not in self.metrics:
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    values[name] = float(value)
            step = round(state.epoch or 0) if self.by_epoch else state.global_step
            if values:
                client.report(int(step), **values)
            stop = client.should_stop()
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor([1 if stop else 0], device=args.device if dist.get_backend() == "nccl" else "cpu")
            dist.broadcast(flag, src=0)
            stop = bool(flag.item())
        if stop:
            control.should_training_stop = True
