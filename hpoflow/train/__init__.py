"""What runs inside a trial: process groups, the built-in trainer, and the user's context.

Importing this package is cheap: ``TrialContext`` (and torch with it) loads on first use, so light
processes (the driver, a node launcher, a PyCOMPSs worker) can import ``hpoflow.train.*`` modules
that do not need torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["TrialContext"]

if TYPE_CHECKING:
    from hpoflow.train.context import TrialContext


def __getattr__(name: str) -> Any:
    if name == "TrialContext":
        from hpoflow.train.context import TrialContext

        return TrialContext
    raise AttributeError(f"module 'hpoflow.train' has no attribute {name!r}")
