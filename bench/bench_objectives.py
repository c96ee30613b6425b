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


def digits_surface(params: dict[str, object], number: int) -> dict[str, object]:
    """A synthetic stand-in for examples/digits.yaml's CNN, for the simulated engine: accuracy peaks at
    a learning rate that depends on the optimizer (and momentum), degrades with the batch size, and is
    learnt more slowly far from the best rate; epochs cost more for small batches and wide models.
    Noise is seeded by ``HPOFLOW_BENCH_SEED`` and the configuration."""
    import math
    import os
    import random

    lr = float(params["lr"])  # type: ignore[arg-type]
    batch = int(params["batch_size"])  # type: ignore[call-overload]
    channels = int(params["channels"])  # type: ignore[call-overload]
    if params["optimizer"] == "adam":
        best_lr = 2e-3
    else:
        best_lr = 2e-2 * (1.0 - float(params.get("momentum", 0.9))) / 0.1  # type: ignore[arg-type]
    miss = math.log10(lr / best_lr)
    final = 0.985 - 0.06 * miss * miss - 0.004 * (batch / 32 - 1) + 0.003 * (channels == 32)
    rng = random.Random(f"{os.environ.get('HPOFLOW_BENCH_SEED', '0')}:{sorted(params.items())}")
    final = min(0.995, max(0.1, final + rng.gauss(0.0, 0.003)))
    speed = 0.35 * min(1.0, max(0.1, lr / best_lr)) ** 0.5
    curve = [0.1 + (final - 0.1) * (1.0 - math.exp(-e * speed)) for e in range(1, 16)]
    per_epoch = 0.6 * (64 / batch) ** 0.7 * (channels / 16) ** 0.5
    return {"duration_s": 15 * per_epoch, "val_accuracy": curve[-1], "curve": curve}
