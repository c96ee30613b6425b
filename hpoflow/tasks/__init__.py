"""How trials run: the engine contract and its implementations (local processes, PyCOMPSs tasks).

This is the only package that imports pycompss, and only in ``hpoflow.tasks.compss``.
"""

from __future__ import annotations

from typing import Any

from hpoflow.errors import EngineError
from hpoflow.tasks._base import Engine, Event, Placement, TrialReport, TrialRequest, TrialResult

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
        from hpoflow.tasks.local import LocalEngine

        return LocalEngine(**options)
    if name == "compss":
        # Importable without pycompss (for the sequential fallback of workflows/hpo.py); the engine
        # itself raises EngineError with the install steps when PyCOMPSs is needed but missing.
        from hpoflow.tasks.compss import CompssEngine

        return CompssEngine(**options)
    raise EngineError(f"unknown engine {name!r}; valid engines: {', '.join(ENGINES)}")
