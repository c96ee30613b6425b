"""The local engine: trials as ranks on warm worker processes of this machine (see ``engine``).

``LocalEngine`` and ``plan_placement`` load ``engine`` on first use, so a worker process that imports
``hpoflow.engines.local._worker`` loads neither pydantic nor the registries.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpoflow.engines.local.engine import LocalEngine, plan_placement

__all__ = ["LocalEngine", "plan_placement"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from hpoflow.engines.local import engine

        value = getattr(engine, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'hpoflow.engines.local' has no attribute {name!r}")
