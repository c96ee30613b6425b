"""A Lightning ``Callback`` for a script run as an hpoflow command trial: after each validation it reports
the logged metrics (``trainer.callback_metrics``) to the trial from the global rank 0, stops the
``Trainer`` when the trial is pruned or paused (every rank alike: rank 0's answer is broadcast through
the trainer's strategy), and saves a Lightning checkpoint in ``HPOFLOW_CHECKPOINT_DIR`` before a pause,
from which the trial's next run resumes. ::

    from hpoflow.integrations.lightning import HpoflowCallback, resume_path
    trainer = lightning.Trainer(..., callbacks=[HpoflowCallback()])
    trainer.fit(model, train_loader, val_loader, ckpt_path=resume_path())

**The step of a report is the validation count**: 1 for the first validation of the fit (sanity-check
validations never count), 2 for the second, and so on, continued across a resume (the count is in the
checkpoint, as the callback's state). With one validation per epoch (Lightning's default) it is the
epoch, ``current_epoch + 1``; with several per epoch (``val_check_interval=0.5``) the steps still run 1,
2, 3, ... (two per epoch). So ``training.epochs`` (hpoflow ends the program after its report of that step) and a
scheduler's rungs (``search.scheduler``: a rung is reached at the first report at or past it) count
validations: with ``val_check_interval=0.5``, ``training.epochs: 6`` is three epochs. Validations outside
``Trainer.fit`` (``trainer.validate()``) are neither counted nor reported.

**Pause and resume.** When the trial stops with a pause (``hpoflow.client.pausing()``: a scheduler's rung,
the engine's walltime warning, a PBT interval's end), every rank calls ``trainer.save_checkpoint`` (as
Lightning requires: a distributed strategy gathers or shards there) into a new file, which rank 0 then
renames to ``HPOFLOW_CHECKPOINT_DIR/lightning.ckpt`` (never written in place: a PBT member's directory
starts as hard links to its parent's files). ``resume_path()`` is that file when it exists, else None:
pass it as ``Trainer.fit(..., ckpt_path=resume_path())``, and Lightning restores the weights, optimizer
and schedulers, loops (the epoch and batch position: no epoch is trained twice) and this callback's count,
and loads the file itself with its own loader (``torch.load``'s default ``weights_only=True`` in this
torch; a checkpoint holding ``save_hyperparameters()`` values of other types needs
``Trainer.fit(..., weights_only=False)`` from the script, its own decision: hpoflow loads nothing).
Resuming from the callback alone is not sound: ``Trainer.fit`` takes its checkpoint as an argument and
restores the module and the callbacks from it right after ``setup``, before ``on_fit_start``, so a
callback could restore only through the Trainer's private checkpoint connector, or by copying state into
the loops by hand; hence the one ``ckpt_path=`` argument in the script. A checkpoint saved at a
validation in the middle of an epoch resumes there (Lightning warns that a non-resumable dataloader
restarts its iteration: the rest of the epoch's batches are drawn afresh).

Works in a multi-rank trial where Lightning's DDP starts from torchrun's environment, which the trial
gives every rank. Outside a trial (plain ``torchrun``, a notebook) it reports nothing, never stops or
saves, and ``resume_path()`` is None.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from hpoflow import client

__all__ = ["CHECKPOINT_NAME", "HpoflowCallback", "resume_path"]

CHECKPOINT_NAME = "lightning.ckpt"  # in HPOFLOW_CHECKPOINT_DIR
_PARTIAL = ".partial"  # the file (or a sharded strategy's directory) being written, renamed when complete


def resume_path() -> str | None:
    """The checkpoint the trial's previous run saved at its pause (``HPOFLOW_CHECKPOINT_DIR/lightning.ckpt``),
    for ``Trainer.fit(..., ckpt_path=resume_path())``; None when there is none, or outside a trial."""
    directory = client.checkpoint_dir()
    if directory is None:
        return None
    path = directory / CHECKPOINT_NAME
    return str(path) if path.exists() else None


class HpoflowCallback(pl.Callback):
    """Report ``metrics`` (names in ``trainer.callback_metrics``; default: every logged metric that is a
    number) after each validation of the fit, at step = the validation count (``validations``); stop the
    trainer when the trial says so (``hpoflow.client.should_stop``), after a checkpoint in
    ``HPOFLOW_CHECKPOINT_DIR`` when it is a pause. See the module docstring."""

    def __init__(self, metrics: Sequence[str] | None = None) -> None:
        super().__init__()
        self.metrics = tuple(metrics) if metrics is not None else None
        self.validations = 0  # validations of the fit so far, over every run of the trial (checkpointed)

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validations = int(state_dict.get("validations", 0))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        self.validations += 1
        if not client.in_trial():
            return
        stop = pausing = False
        if trainer.is_global_zero:
            values = _numbers(trainer.callback_metrics, self.metrics)
            if values:
                client.report(self.validations, **values)
            stop = client.should_stop()
            pausing = stop and client.pausing() and client.checkpoint_dir() is not None
            if pausing:  # before any rank writes: the directory, and no remains of an interrupted save
                partial = _partial_path()
                partial.parent.mkdir(parents=True, exist_ok=True)
                _clear(partial)
        if trainer.world_size > 1:
            stop, pausing = trainer.strategy.broadcast((stop, pausing), src=0)
        if pausing:
            self._save(trainer)
        if stop:
            trainer.should_stop = True

    def _save(self, trainer: pl.Trainer) -> None:
        """Every rank: Lightning's checkpoint into a new path; rank 0 renames it into place."""
        partial = _partial_path()
        # weights_only=False: the whole training state (optimizer, loops, callbacks), not the weights alone
        # (a save option here, not torch.load's); it ends with a barrier: every rank's part is written
        trainer.save_checkpoint(partial, weights_only=False)
        if trainer.is_global_zero:
            final = partial.parent / CHECKPOINT_NAME
            if final.is_dir():  # a sharded strategy's checkpoint is a directory: os.replace needs it gone
                shutil.rmtree(final)
            os.replace(partial, final)


def _partial_path() -> Path:
    directory = client.checkpoint_dir()
    if directory is None:  # never: the caller checked
        raise RuntimeError("HPOFLOW_CHECKPOINT_DIR is not set")
    return directory / (CHECKPOINT_NAME + _PARTIAL)


def _clear(path: Path) -> None:
    """Remove what an interrupted save (or a PBT parent's copy of one) left at ``path``."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink()


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
