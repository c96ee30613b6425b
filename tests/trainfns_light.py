"""Training functions that do not import torch at module level (for the local engine's light workers)."""

from __future__ import annotations

import sys
from typing import Any


def torch_probe(ctx: Any) -> dict[str, float]:
    """Whether torch was loaded before this function ran; then a draw from torch's generator and its
    thread count (seeded and set by the runner the moment torch is imported)."""
    loaded_before = "torch" in sys.modules
    import torch

    return {"value": 0.0, "torch_was_loaded": float(loaded_before), "draw": float(torch.rand(1).item()),
            "threads": float(torch.get_num_threads())}


def sim_cost(params: dict[str, Any], number: int) -> dict[str, Any]:
    """A cost model for the simulated engine: longer for larger x, the metric rising to 1 - x."""
    x = float(params["x"])
    return {"duration_s": 10.0 + 100.0 * x, "val_accuracy": 1.0 - x,
            "curve": [(1.0 - x) * k / 4 for k in range(1, 5)]}
