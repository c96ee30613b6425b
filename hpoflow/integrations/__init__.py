"""Callbacks that connect a training framework's own loop to the hpoflow trial running it as a command
(``training.command``; README, "Your own script"): ``hpoflow.integrations.lightning`` (a Lightning
``Callback``) and ``hpoflow.integrations.huggingface`` (a Hugging Face ``TrainerCallback``). Each module
imports only its framework and ``hpoflow.client`` (the standard library); nothing here is imported by
hpoflow itself. Outside a trial they report nothing and never stop training.
"""

from __future__ import annotations

__all__: list[str] = []
