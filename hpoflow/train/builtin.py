"""The built-in trainer: a built-in model on a built-in data set, with DDP across the trial's ranks.

Each rank trains on its shard of the training set (``DistributedSampler``, reshuffled per epoch
with the trial's seed); gradients are averaged by ``DistributedDataParallel``. After each epoch
every rank evaluates the whole validation set (identical weights give identical numbers), rank 0
reports ``val_accuracy``, ``val_loss``, ``train_loss`` and ``train_accuracy``, and every rank asks
``should_stop()`` at the same point.
"""

from __future__ import annotations

import math
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from hpoflow.train.context import TrialContext
from hpoflow.train.data import load_dataset
from hpoflow.train.models import build_model

__all__ = ["NonFiniteLoss", "make_optimizer", "train_builtin"]


class NonFiniteLoss(RuntimeError):
    """The training loss became NaN or infinite: the configuration diverged (not retried)."""


def make_optimizer(name: str, params: object, lr: float, momentum: float, weight_decay: float
                   ) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)  # type: ignore[arg-type]
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)  # type: ignore[arg-type]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)  # type: ignore[arg-type]
    raise ValueError(f"unknown optimizer {name!r}; choose sgd, adam or adamw")


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, device: torch.device,
             batch: int = 512) -> tuple[float, float]:
    """(mean loss, accuracy) of ``model`` on ``(x, y)``."""
    model.eval()
    loss_sum, correct = 0.0, 0
    for i in range(0, len(x), batch):
        xb, yb = x[i : i + batch].to(device), y[i : i + batch].to(device)
        out = model(xb)
        loss_sum += float(nn.functional.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train()
    return loss_sum / len(x), correct / len(x)


def train_builtin(ctx: TrialContext) -> dict[str, float]:
    cfg = ctx.config
    torch.manual_seed(cfg.seed)
    data = load_dataset(cfg.dataset, cfg.val_fraction)
    model = build_model(cfg.model, data.input_shape, data.n_classes, **cfg.model_options).to(ctx.device)
    net: nn.Module = model
    if ctx.distributed:
        net = DistributedDataParallel(model, device_ids=None if ctx.device.type == "cpu" else [ctx.device])
    opt = make_optimizer(cfg.optimizer, net.parameters(), cfg.lr, cfg.momentum, cfg.weight_decay)
    train_set = TensorDataset(data.x_train, data.y_train)
    sampler = DistributedSampler(
        train_set, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=cfg.seed, drop_last=False
    )
    loader = DataLoader(train_set, batch_size=cfg.batch_size, sampler=sampler)
    metrics: dict[str, float] = {}
    t_train = 0.0
    samples = 0
    for epoch in range(cfg.epochs):
        sampler.set_epoch(epoch)
        t0 = time.perf_counter()
        loss_sum, correct, seen = 0.0, 0, 0
        for xb, yb in loader:
            xb, yb = xb.to(ctx.device), yb.to(ctx.device)
            opt.zero_grad(set_to_none=True)
            out = net(xb)
            loss = nn.functional.cross_entropy(out, yb)
            loss.backward()
            opt.step()
            loss_sum += float(loss) * len(xb)
            correct += int((out.argmax(1) == yb).sum())
            seen += len(xb)
        t_train += time.perf_counter() - t0
        samples += seen
        train_loss = loss_sum / max(seen, 1)
        if not math.isfinite(train_loss):
            raise NonFiniteLoss(f"training loss is {train_loss} at epoch {epoch + 1} (lr={cfg.lr})")
        val_loss, val_acc = evaluate(model, data.x_val, data.y_val, ctx.device)
        metrics = {
            "val_accuracy": val_acc,
            "val_loss": val_loss,
            "train_loss": train_loss,
            "train_accuracy": correct / max(seen, 1),
            "epoch": float(epoch + 1),
            "samples_per_s": samples * ctx.world_size / t_train if t_train > 0 else 0.0,
        }
        ctx.report(epoch + 1, **metrics)
        if ctx.should_stop():
            break
    return metrics
