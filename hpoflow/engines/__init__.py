"""How trials run: the engine contract (``base``) and one subpackage per engine (``local``, ``compss``,
``simulated``), ``cluster`` (what the cluster engines share to run a trial over several nodes), and
``threads`` for tests and driver benchmarks; ``elastic`` sizes elastic trials.

Only ``hpoflow.engines.compss`` imports pycompss; machine detection is ``machine``, process helpers ``proc``.
Importing a submodule stays light (a light worker of the local engine imports ``local._worker`` only):
the names below load their modules on first use.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.errors import EngineError

if TYPE_CHECKING:
    from hpoflow.engines.base import Engine, Event, Placement, TrialReport, TrialRequest, TrialResult

__all__ = [
    "Engine",
    "EngineError",
    "Event",
    "Placement",
    "TrialReport",
    "TrialRequest",
    "TrialResult",
    "check_fit",
    "make_engine",
]


def make_engine(name: str, options: Mapping[str, Any] | None = None, run_dir: Path | None = None) -> Engine:
    """Build the engine registered as ``name`` (``hpoflow.registry.ENGINES``) with its option bag;
    unknown names list the valid ones."""
    from hpoflow.registry import ENGINES, PluginError

    if name not in ENGINES:
        raise EngineError(ENGINES.unknown(name))
    try:
        opts = ENGINES.options(name, options)
    except PluginError as exc:
        raise EngineError(str(exc)) from None
    return ENGINES.get(name).from_options(opts, run_dir)


def check_fit(name: str, options: Mapping[str, Any] | None, request: TrialRequest) -> None:
    """``EngineError`` when a trial shaped like ``request`` can never run on the engine registered as
    ``name`` with these options (``Engine.check_fit``); starts nothing."""
    from hpoflow.registry import ENGINES, PluginError

    try:
        opts = ENGINES.options(name, options)
    except PluginError as exc:
        raise EngineError(str(exc)) from None
    ENGINES.get(name).check_fit(opts, request)


def __getattr__(name: str) -> Any:
    if name in ("Engine", "Event", "Placement", "TrialReport", "TrialRequest", "TrialResult"):
        from hpoflow.engines import base

        value = getattr(base, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpoflow.engines' has no attribute {name!r}")
