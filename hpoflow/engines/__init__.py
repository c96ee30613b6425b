"""How trials run: the engine contract (``base``) and one subpackage per engine (``local``, ``compss``)
plus ``threads`` for tests and driver benchmarks.

Only ``hpoflow.engines.compss`` imports pycompss; machine detection is ``machine``, process helpers ``proc``.
"""

from __future__ import annotations

from typing import Any

from hpoflow.engines.base import Engine, Event, Placement, TrialReport, TrialRequest, TrialResult
from hpoflow.errors import EngineError

__all__ = [
    "ENGINES",
    "Engine",
    "EngineError",
    "Event",
    "Placement",
    "TrialReport",
    "TrialRequest",
    "TrialResult",
    "make_engine",
]

ENGINES = ("local", "compss")


def make_engine(name: str, **options: Any) -> Engine:
    """Build the engine called ``name``; unknown names list the valid ones."""
    if name == "local":
        from hpoflow.engines.local import LocalEngine

        return LocalEngine(**options)
    if name == "compss":
        # Importable without pycompss (for the sequential fallback of workflows/hpo.py); the engine
        # itself raises EngineError with the install steps when PyCOMPSs is needed but missing.
        from hpoflow.engines.compss import CompssEngine

        return CompssEngine(**options)
    raise EngineError(f"unknown engine {name!r}; valid engines: {', '.join(ENGINES)}")
