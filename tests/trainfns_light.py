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


def costly(ctx: Any) -> dict[str, float]:
    """Reports a learning curve and returns cost measurements like the built-in trainer's."""
    import time

    x = float(ctx.params["x"])
    for epoch in range(1, 4):
        ctx.report(epoch, value=x * epoch / 3)
        if ctx.should_stop():
            return {"value": x * epoch / 3}
        time.sleep(0.02)
    return {"value": x, "samples_per_s": 1000.0 * (1 + x), "step_time_s": 0.01 / (1 + x), "comm_fraction": 0.1 * x}



def nap(ctx: Any) -> dict[str, float]:
    """A quick trial for studies shared by several drivers: sleeps ``options.seconds`` (default 0.3) and
    returns ``1 - (x - 0.5)^2``."""
    import time

    x = float(ctx.params["x"])
    time.sleep(float(ctx.options.get("seconds", 0.3)))
    return {"value": 1.0 - (x - 0.5) ** 2}
