"""The local engine: trials as ranks on warm worker processes of this machine.

``engine`` runs the trials' lifecycle (``_slots``: their placement on cores and GPUs); ``_pool`` starts, hands out and
retires the worker processes; ``_forkserver`` starts and stops the forkserver they are forked from;
``_worker`` is the loop each worker runs (``_modules``: which modules it unloads after a trial).
``LocalEngine``, ``RankShare`` (a node agent's part of a multi-host trial), ``plan_placement``, ``prestart``,
``prestart_for`` (what a study's first trials need), ``discard_prestarted``, ``ensure_forkserver`` (the
forkserver as the engine starts it, for other users of it: the oracle service) and ``use_engine_preload``
(that forkserver preloading what the engine's does, for processes forked outside an engine: the oracle's
calibration ranks) load their modules on first use, so a worker process that imports
``hpoflow.engines.local._worker`` loads neither pydantic nor the registries.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpoflow.engines.local._forkserver import ensure_forkserver
    from hpoflow.engines.local._pool import discard_prestarted, prestart, prestart_for, use_engine_preload
    from hpoflow.engines.local._slots import RankShare, plan_placement
    from hpoflow.engines.local.engine import LocalEngine

__all__ = ["LocalEngine", "RankShare", "discard_prestarted", "ensure_forkserver", "plan_placement", "prestart",
           "prestart_for", "use_engine_preload"]

_WHERE = {"LocalEngine": "engine", "RankShare": "_slots", "plan_placement": "_slots", "prestart": "_pool",
          "prestart_for": "_pool", "discard_prestarted": "_pool", "ensure_forkserver": "_forkserver",
          "use_engine_preload": "_pool"}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(f"hpoflow.engines.local.{_WHERE[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpoflow.engines.local' has no attribute {name!r}")
