"""Objectives used by the benchmarks (imported inside trial processes)."""

from __future__ import annotations

import time

from hpoflow.train import TrialContext


def sleep50(ctx: TrialContext) -> float:
    """A 50 ms trial (sleep: the CPU stays free, so the figure is pure system overhead)."""
    time.sleep(0.05)
    return float(ctx.params.get("x", 0.0))


def sleep_for(ctx: TrialContext) -> float:
    time.sleep(float(ctx.params["duration"]))
    return 0.0


def sleep_indexed(ctx: TrialContext) -> float:
    """Sleep ``options.durations[params.i]`` seconds: trial ``i`` of a grid gets a fixed duration."""
    time.sleep(float(ctx.options["durations"][int(ctx.params["i"])]))
    return 0.0


def ddp_first_step(ctx: TrialContext) -> dict[str, float]:
    """A 2-rank DDP trial that returns the wall time at which its first training step starts.

    The process group exists when this runs (the runner joined it); wrapping the model in DDP
    broadcasts its parameters (part of the launch), then the clock is read and one step is taken.
    """
    import torch
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(16, 32), torch.randn(16, 1)
    first_step_at = time.time()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()  # the gradient all-reduce across the ranks
    opt.step()
    return {"value": float(loss.item()), "first_step_at": first_step_at, "step_done_at": time.time()}
