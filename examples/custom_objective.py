"""A user training function: ``training.function: custom_objective:train`` (see custom.yaml).

It receives a ``TrialContext``: ``ctx.params`` (the sampled values), ``ctx.config`` (the resolved
training section), ``ctx.rank``/``ctx.world_size``/``ctx.device``, and ``ctx.report(step, **metrics)``
+ ``ctx.should_stop()`` for pruning. The process group is already initialised when world_size > 1.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpoflow import TrialContext


def train(ctx: TrialContext) -> dict[str, float]:
    torch.manual_seed(ctx.config.seed)
    x = torch.linspace(-3, 3, 512).unsqueeze(1)
    y = torch.sin(x)
    model = nn.Sequential(nn.Linear(1, int(ctx.params["width"])), nn.Tanh(), nn.Linear(int(ctx.params["width"]), 1))
    net = DistributedDataParallel(model) if ctx.distributed else model
    opt = torch.optim.Adam(net.parameters(), lr=ctx.params["lr"])
    shard = slice(ctx.rank, None, ctx.world_size)  # each rank its own shard
    loss = torch.tensor(0.0)
    for epoch in range(1, ctx.config.epochs + 1):
        for _ in range(20):
            opt.zero_grad()
            loss = nn.functional.mse_loss(net(x[shard]), y[shard])
            loss.backward()
            opt.step()
        ctx.report(epoch, mse=float(loss))
        if ctx.should_stop():
            break
    return {"mse": float(loss)}
