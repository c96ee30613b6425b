"""What runs inside a trial: process groups, the built-in trainer, and the user's context."""

from __future__ import annotations

from hpoflow.train.context import TrialContext

__all__ = ["TrialContext"]
