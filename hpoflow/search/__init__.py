"""What runs next: search spaces, Optuna samplers and pruners, the storage, and the driver loop."""

from __future__ import annotations

from hpoflow.search.samplers import make_pruner, make_sampler
from hpoflow.search.space import active, grid_points, suggest
from hpoflow.search.storage import open_storage, storage_label

__all__ = ["active", "grid_points", "make_pruner", "make_sampler", "open_storage", "storage_label", "suggest"]
