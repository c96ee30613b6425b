"""The simulated engine: the real driver, samplers, pruners and storage against a virtual clock.

A tool for planning and for testing the driver at scale, never a way to train: each trial's duration
and per-epoch metrics come from a cost model (``options``), not from running anything. See ``engine``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpoflow.engines.simulated.engine import SimulatedEngine

__all__ = ["SimulatedEngine"]


def __getattr__(name: str) -> Any:
    if name == "SimulatedEngine":
        from hpoflow.engines.simulated.engine import SimulatedEngine

        return SimulatedEngine
    raise AttributeError(f"module 'hpoflow.engines.simulated' has no attribute {name!r}")
