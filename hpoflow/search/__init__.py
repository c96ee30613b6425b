"""What runs next: search spaces, Optuna samplers and pruners, the storage, and the driver loop.

Importing a submodule stays light (``hpoflow.search.options`` is read by the spec): the names below
load their modules, and Optuna, on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpoflow.search.samplers import make_pruner, make_sampler
    from hpoflow.search.space import active, grid_points, suggest
    from hpoflow.search.storage import open_storage, storage_label

__all__ = ["active", "grid_points", "make_pruner", "make_sampler", "open_storage", "storage_label", "suggest"]

_WHERE = {"make_pruner": "samplers", "make_sampler": "samplers", "active": "space", "grid_points": "space",
          "suggest": "space", "open_storage": "storage", "storage_label": "storage"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'hpoflow.search' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpoflow.search.{_WHERE[name]}"), name)
    globals()[name] = value
    return value
