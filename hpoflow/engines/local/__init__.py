"""The local engine: trials as ranks on warm worker processes of this machine (see ``engine``)."""

from __future__ import annotations

from hpoflow.engines.local.engine import LocalEngine, plan_placement

__all__ = ["LocalEngine", "plan_placement"]
