"""A Hugging Face ``TrainerCallback`` for a script run as an hpoflow command trial: after each evaluation
it reports the evaluation metrics (``eval_loss``, ...) to the trial from the main process, stops the
``Trainer`` when the trial is pruned or paused (every rank alike: the main process's answer is broadcast
over the trainer's process group), and has the Trainer save its checkpoint in ``HPOFLOW_CHECKPOINT_DIR``
before a pause, from which the trial's next run resumes. ::

    from hpoflow.integrations.huggingface import HpoflowCallback, resume_path
    trainer = transformers.Trainer(..., callbacks=[HpoflowCallback()])
    trainer.train(resume_from_checkpoint=resume_path())

**The step of a report is the evaluation count** (not ``state.global_step``): 1 for the first evaluation
of ``train()``, 2 for the second, and so on, continued across a resume (the count is saved with the
Trainer's state, as the callback's ``ExportableState``). With ``eval_strategy="epoch"`` it is the epoch;
with ``eval_strategy="steps"`` and ``eval_steps=500`` it is 1, 2, 3, ... at global steps 500, 1000, 1500.
So ``training.epochs`` (hpoflow ends the program after its report of that step) and a scheduler's rungs
(``search.scheduler``: a rung is reached at the first report at or past it) count evaluations. One
evaluation over several eval datasets (a dict ``eval_dataset``: an ``on_evaluate`` per dataset, at one
global step) counts once; ``trainer.evaluate()`` outside ``train()`` is not reported. ``by_epoch=True``
reports ``round(state.epoch)`` instead (then several evaluations in one epoch share a step, and only
the first report of a step reaches the study).

**Pause and resume.** When the trial stops with a pause (``hpoflow.client.pausing()``: a scheduler's rung,
the engine's walltime warning, a PBT interval's end), the callback sets ``control.should_save`` with the
Trainer's ``args.output_dir`` pointed at ``HPOFLOW_CHECKPOINT_DIR`` until the save is done, so the Trainer
writes its own full checkpoint there (``checkpoint-<global step>``: weights, optimizer, scheduler, RNG
states of every rank, trainer state) on every rank, with no private API; then the older checkpoints there
are removed. ``resume_path()`` is the newest complete one (it holds ``trainer_state.json``), else None:
``Trainer.train(resume_from_checkpoint=resume_path())`` is the Trainer's own route (it loads the files
itself, and skips the batches of the current epoch already trained: no evaluation is trained twice).
Under ``save_strategy="best"`` a pause with no new best saves at the epoch's end instead (the Trainer
overrides ``should_save`` after ``on_evaluate``); ``save_only_model=True`` leaves the optimizer out, so a
resume is not exact. A multi-node trial needs ``HPOFLOW_CHECKPOINT_DIR`` on a shared file system (hpoflow
puts it there), as every rank writes into it.

Works in a multi-rank trial where the Trainer's DDP starts from torchrun's environment, which the trial
gives every rank. Outside a trial it reports nothing, never stops or saves, and ``resume_path()`` is None.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_callback import ExportableState

from hpoflow import client

__all__ = ["HpoflowCallback", "resume_path"]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")  # transformers' PREFIX_CHECKPOINT_DIR, then the global step
_COMPLETE = "trainer_state.json"  # written after the weights, optimizer and RNG states


def _checkpoints(directory: Path) -> list[tuple[int, Path]]:
    """``(global step, path)`` of the Trainer's checkpoint directories in ``directory``, oldest first."""
    out = []
    if directory.is_dir():
        for p in directory.iterdir():
            m = _CHECKPOINT.match(p.name)
            if m and p.is_dir():
                out.append((int(m.group(1)), p))
    return sorted(out)


def resume_path() -> str | None:
    """The newest complete checkpoint the trial's previous run saved in ``HPOFLOW_CHECKPOINT_DIR``, for
    ``Trainer.train(resume_from_checkpoint=resume_path())``; None when there is none, or outside a trial."""
    directory = client.checkpoint_dir()
    if directory is None:
        return None
    complete = [p for _, p in _checkpoints(directory) if (p / _COMPLETE).is_file()]
    return str(complete[-1]) if complete else None


class HpoflowCallback(TrainerCallback, ExportableState):
    """Report each evaluation's metrics (default: all numbers in it; ``metrics``: these names) at step =
    the evaluation count (``evaluations``; ``by_epoch=True``: the rounded epoch) and stop training when the
    trial says so (``hpoflow.client.should_stop``), after a checkpoint in ``HPOFLOW_CHECKPOINT_DIR`` when it
    is a pause. See the module docstring."""

    def __init__(self, metrics: list[str] | None = None, *, by_epoch: bool = False) -> None:
        self.metrics = tuple(metrics) if metrics is not None else None
        self.by_epoch = by_epoch
        self.evaluations = 0  # evaluations of train() so far, over every run of the trial (checkpointed)
        self._training = False
        self._counted_at: int | None = None  # the global step of the evaluation counted last
        self._output_dir: str | None = None  # the script's args.output_dir while a pause checkpoint is saved

    # -- ExportableState: saved in the checkpoint's trainer_state.json --------------------------------
    def state(self) -> dict[str, Any]:
        return {"args": {"metrics": list(self.metrics) if self.metrics is not None else None,
                         "by_epoch": self.by_epoch},
                "attributes": {"evaluations": self.evaluations}}

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """The count from the state ``train()`` starts with: a resumed checkpoint's (the Trainer loaded its
        ``trainer_state.json``), else this callback's own."""
        self._training = True
        self._counted_at = None
        name = type(self).__name__
        saved = state.stateful_callbacks.get(name) if isinstance(state.stateful_callbacks, dict) else None
        if isinstance(saved, list):
            saved = saved[0] if saved else None
        if isinstance(saved, dict) and isinstance(saved.get("attributes"), dict):
            self.evaluations = int(saved["attributes"].get("evaluations", self.evaluations))
        elif isinstance(state.stateful_callbacks, dict):
            # resumed from a checkpoint saved without this callback: the Trainer's save looks its entry up
            state.stateful_callbacks[name] = self.state()

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        self._training = False
        self._restore(args)

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    metrics: dict[str, Any] | None = None, **kwargs: Any) -> None:
        if not self._training:
            return  # trainer.evaluate() outside train()
        if self._counted_at != state.global_step:  # one evaluation, whatever number of eval datasets
            self._counted_at = state.global_step
            self.evaluations += 1
        if not client.in_trial():
            return
        stop = pausing = False
        if state.is_world_process_zero:
            values = {}
            for name, value in (metrics or {}).items():
                if self.metrics is not None and name not in self.metrics:
                    continue
                if isinstance(value, int | float) and not isinstance(value, bool):
                    values[name] = float(value)
            step = round(state.epoch or 0) if self.by_epoch else self.evaluations
            if values:
                client.report(int(step), **values)
            stop = client.should_stop()
            pausing = stop and client.pausing() and client.checkpoint_dir() is not None
            if pausing:  # a checkpoint of this step left by an interrupted run: the Trainer writes it anew
                _remove(_target(state))
        stop, pausing = _agree(args, stop, pausing)
        if pausing and self._output_dir is None:
            directory = client.checkpoint_dir()
            if directory is not None:
                self._output_dir = args.output_dir
                args.output_dir = str(directory)  # the Trainer's _save_checkpoint writes under it
                control.should_save = True
        if stop:
            control.should_training_stop = True

    def on_epoch_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        if self._output_dir is not None:  # save_strategy="best" took the pause's save back: save now
            control.should_save = True
            control.should_evaluate = False  # an evaluation would take it back again

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        if self._output_dir is None:
            return
        self._restore(args)
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank's files (its RNG state) are written
        directory = client.checkpoint_dir()
        if state.is_world_process_zero and directory is not None:
            for step, path in _checkpoints(directory):  # the older ones: resume_path() takes the newest
                if step != state.global_step:
                    _remove(path)

    def _restore(self, args: TrainingArguments) -> None:
        if self._output_dir is not None:
            args.output_dir = self._output_dir
            self._output_dir = None


def _target(state: TrainerState) -> Path:
    directory = client.checkpoint_dir()
    if directory is None:  # never: the caller checked
        raise RuntimeError("HPOFLOW_CHECKPOINT_DIR is not set")
    return directory / f"checkpoint-{state.global_step}"


def _remove(path: Path) -> None:
    """Remove a checkpoint directory (a PBT member's may hold hard links to its parent's files: unlinking
    them leaves the parent's as they are)."""
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _agree(args: TrainingArguments, stop: bool, pausing: bool) -> tuple[bool, bool]:
    """The main process's ``(stop, pausing)`` on every rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = args.device if dist.get_backend() == "nccl" else "cpu"
        flags = torch.tensor([int(stop), int(pausing)], device=device)
        dist.broadcast(flags, src=0)
        stop, pausing = bool(flags[0].item()), bool(flags[1].item())
    return stop, pausing
