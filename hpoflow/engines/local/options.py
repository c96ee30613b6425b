"""Options of the local engine (``engine_options:`` when ``engine: local``); pydantic only."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from hpoflow.registry import Options

__all__ = ["LocalOptions"]


class LocalOptions(Options):
    """cores / gpus: restrict the engine to these core and GPU ids (default: the process's affinity
    mask and every visible GPU), ids this machine has: validate and run refuse others. pg_timeout_s: a
    trial's process-group timeout.
    max_trials_per_worker: replace a warm worker after this many trials (0: never)."""

    cores: list[Annotated[int, Field(ge=0)]] | None = None
    gpus: list[Annotated[int, Field(ge=0)]] | None = None
    pg_timeout_s: float = Field(default=120.0, gt=0)
    max_trials_per_worker: int = Field(default=0, ge=0)
