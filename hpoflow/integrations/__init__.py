"""Callbacks that connect a training framework's own loop to the hpoflow trial running it as a command
(``training.command``; README, "Your own script"): ``hpoflow.integrations.lightning`` (a Lightning
``Callback``) and ``hpoflow.integrations.huggingface`` (a Hugging Face ``TrainerCallback``). Each reports
at the validation count (the step ``training.epochs`` and a scheduler's rungs count), stops the trainer
when the trial is pruned or paused, has the framework checkpoint in ``HPOFLOW_CHECKPOINT_DIR`` at a pause,
and gives that checkpoint back with its module's ``resume_path()`` (docs/integrations.md). Each module
imports only its framework and ``hpoflow.client`` (the standard library); nothing here is imported by
hpoflow itself. Outside a trial they report nothing, never stop training and save nothing.
"""

from __future__ import annotations

__all__: list[str] = []
