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
        try:
            from hpoflow.tasks.compss import CompssEngine
        except ImportError as exc:
            raise EngineError(
                f"the compss engine needs PyCOMPSs, which is not importable here ({exc}). Fix: on a "
                "cluster, load the COMPSs module (e.g. `module load COMPSs`) or install COMPSs and "
                "`pip install 'hpoflow[compss]'`, then launch with `hpoflow launch SPEC --engine compss`; "
                "on a laptop, use engine: local"
            ) from None
        return CompssEngine(**options)
    raise EngineError(f"unknown engine {name!r}; valid engines: {', '.join(ENGINES)}")
