"""The user code of ``bench/peers.py``: a digits CNN written once, run by hpoflow as a
``training.function`` (``digits_cnn``) and by plain Optuna as an objective (``optuna_objective``).

The searched parameters (learning rate, momentum, weight decay) do not change a trial's cost, so every
framework runs the same work whatever its sampler proposes. Standard user code: it imports torch and
scikit-learn itself, at the top.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from peer_space import SPACE
from sklearn.datasets import load_digits
from torch import nn

EPOCHS = 15
BATCH = 64
CHANNELS = 16


def train_digits(params: dict[str, Any], epochs: int, report: Callable[[int, float], None]) -> float:
    """Train the CNN on 80 % of the digits, return the validation accuracy of the last epoch."""
    torch.manual_seed(0)
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target)
    n = int(0.8 * len(x))
    model = nn.Sequential(nn.Conv2d(1, CHANNELS, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(CHANNELS, CHANNELS, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(CHANNELS * 16, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=float(params["lr"]), momentum=float(params["momentum"]),
                          weight_decay=float(params["weight_decay"]))
    acc = 0.0
    for epoch in range(1, epochs + 1):
        model.train()
        perm = torch.randperm(n)
        for i in range(0, n, BATCH):
            idx = perm[i : i + BATCH]
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            acc = float((model(x[n:]).argmax(1) == y[n:]).float().mean())
        report(epoch, acc)
    return acc


def digits_cnn(ctx: Any) -> dict[str, float]:
    """hpoflow's ``training.function``."""
    epochs = int(ctx.options.get("epochs", EPOCHS))
    return {"val_accuracy": train_digits(ctx.params, epochs, lambda e, a: ctx.report(e, val_accuracy=a))}


def optuna_objective(epochs: int, log: list[tuple[float, float]]) -> Callable[[Any], float]:
    """Plain Optuna's objective over the same space (``peer_space.SPACE``); appends (start, end) wall
    times to ``log``."""

    def objective(trial: Any) -> float:
        t0 = time.time()
        params = {name: trial.suggest_float(name, p["low"], p["high"], log=bool(p.get("log", False)))
                  for name, p in SPACE.items()}
        acc = train_digits(params, epochs, lambda e, a: trial.report(a, e))
        log.append((t0, time.time()))
        return acc

    return objective
