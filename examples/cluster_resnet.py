"""ResNet-18 on CIFAR-10, the training function of examples/cluster_resnet.yaml (``cluster_resnet:train``).

Data: ``options.data_dir`` holds CIFAR-10 as torchvision stores it (``cifar-10-batches-py``), read
with ``torchvision.datasets.CIFAR10(download=False)``: nothing is downloaded at run time (compute
nodes rarely reach the internet; fetch it once on a login node, see docs/cluster.md). Without
``data_dir`` a synthetic stand-in of the same shape (3x32x32 images, 10 classes, labels from a fixed
random teacher so it is learnable) is used: that is what the tests and a first dry run use.

Model: torchvision's ``resnet18(num_classes=10)`` when torchvision is importable, else the same
architecture from ``hpoflow.oracle.facts`` (the oracle's reference ResNet-18).

Per rank: one shard of the training set (``DistributedSampler``), DDP, SGD with Nesterov momentum
and a cosine schedule, mixed precision on GPU (bf16 where supported, else fp16 with a grad scaler;
``options.amp: false`` turns it off), a checkpoint every epoch (resumed after a crash or requeue),
``val_accuracy`` over the whole validation set reported every epoch for the ASHA pruner.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

from hpoflow import TrialContext

CLASSES = 10
SHAPE = (3, 32, 32)
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)


def synthetic(n: int, seed: int) -> TensorDataset:
    """``n`` CIFAR-shaped images whose labels a fixed random linear teacher assigns."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *SHAPE, generator=g)
    teacher = torch.randn(CLASSES, math.prod(SHAPE), generator=torch.Generator().manual_seed(12345))
    y = (x.flatten(1) @ teacher.T).argmax(1)
    return TensorDataset(x, y)


def cifar10(data_dir: str, train: bool) -> Dataset[Any]:
    try:
        import torchvision
        from torchvision import transforms
    except ImportError:
        raise RuntimeError(f"options.data_dir={data_dir!r} is read with torchvision, which is not installed. "
                           "Fix: pip install torchvision, or remove data_dir to train on synthetic data") from None
    if not (Path(data_dir) / "cifar-10-batches-py").is_dir():
        raise RuntimeError(
            f"options.data_dir={data_dir!r} holds no cifar-10-batches-py directory (nothing is downloaded "
            "at run time). Fix: on a login node run python -c \"import torchvision; "
            f"torchvision.datasets.CIFAR10('{data_dir}', download=True)\"")
    norm = [transforms.ToTensor(), transforms.Normalize(MEAN, STD)]
    aug = [transforms.RandomCrop(32, padding=4), transforms.RandomHorizontalFlip()] if train else []
    return torchvision.datasets.CIFAR10(data_dir, train=train, download=False,
                                        transform=transforms.Compose(aug + norm))


def resnet18() -> nn.Module:
    try:
        import torchvision
    except ImportError:
        from hpoflow.oracle.facts import resolve_model

        build, _, _, _ = resolve_model("resnet18", SHAPE, CLASSES, {})
        return build()
    return torchvision.models.resnet18(num_classes=CLASSES)


def _amp(ctx: TrialContext) -> tuple[torch.dtype | None, torch.amp.GradScaler | None]:
    if ctx.device.type != "cuda" or not ctx.options.get("amp", True):
        return None, None
    if torch.cuda.is_bf16_supported():
        return torch.bfloat16, None
    return torch.float16, torch.amp.GradScaler("cuda")


def _evaluate(net: nn.Module, loader: DataLoader[Any], ctx: TrialContext, dtype: torch.dtype | None
              ) -> tuple[float, float]:
    net.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # loss, correct, count
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
                out = net(x)
            sums += torch.stack([nn.functional.cross_entropy(out.float(), y, reduction="sum").double(),
                                 (out.argmax(1) == y).sum().double(), torch.tensor(len(y), device=ctx.device)])
    if ctx.distributed:
        dist.all_reduce(sums)
    net.train()
    return float(sums[1] / sums[2]), float(sums[0] / sums[2])


def train(ctx: TrialContext) -> dict[str, float]:
    o = ctx.options
    torch.manual_seed(ctx.config.seed)
    if o.get("data_dir"):
        train_set, val_set = cifar10(str(o["data_dir"]), True), cifar10(str(o["data_dir"]), False)
    else:
        train_set = synthetic(int(o.get("synthetic_train", 50000)), ctx.config.seed)
        val_set = synthetic(int(o.get("synthetic_val", 10000)), ctx.config.seed + 1)
    sampler = DistributedSampler(train_set, ctx.world_size, ctx.rank, seed=ctx.config.seed) if ctx.distributed \
        else None
    val_sampler = DistributedSampler(val_set, ctx.world_size, ctx.rank, shuffle=False) if ctx.distributed else None
    workers = int(o.get("num_workers", 0))
    pin = ctx.device.type == "cuda"
    loader = DataLoader(train_set, ctx.config.batch_size, shuffle=sampler is None, sampler=sampler,
                        num_workers=workers, pin_memory=pin, drop_last=True, persistent_workers=workers > 0)
    val_loader = DataLoader(val_set, 2 * ctx.config.batch_size, sampler=val_sampler, num_workers=workers,
                            pin_memory=pin)

    model = resnet18().to(ctx.device)
    if ctx.device.type == "cuda":
        model = model.to(memory_format=torch.channels_last)
    net: nn.Module = model
    if ctx.distributed:
        net = DistributedDataParallel(model, device_ids=[ctx.device.index] if ctx.device.type == "cuda" else None)
    opt = torch.optim.SGD(net.parameters(), lr=ctx.config.lr, momentum=ctx.config.momentum or 0.9, nesterov=True,
                          weight_decay=ctx.config.weight_decay)
    epochs = ctx.config.epochs
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5 * (1 + math.cos(math.pi * e / epochs)))
    dtype, scaler = _amp(ctx)

    start, acc, val_loss = 0, 0.0, float("inf")
    state = ctx.load_checkpoint()  # every rank: the newest checkpoint valid on all of them
    if state is not None:
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
        start, acc, val_loss = int(state["epoch"]), float(state["acc"]), float(state["val_loss"])
    for epoch in range(start, epochs):
        if sampler is not None:
            sampler.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)
            if ctx.device.type == "cuda":
                x = x.contiguous(memory_format=torch.channels_last)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(ctx.device.type, dtype=dtype, enabled=dtype is not None):
                loss = nn.functional.cross_entropy(net(x), y)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
        sched.step()
        acc, val_loss = _evaluate(net, val_loader, ctx, dtype)
        ctx.report(epoch + 1, val_accuracy=acc, val_loss=val_loss)
        ctx.save_checkpoint({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                             "scaler": scaler.state_dict() if scaler is not None else {}, "epoch": epoch + 1,
                             "acc": acc, "val_loss": val_loss}, step=epoch + 1)
        if ctx.should_stop():
            break
    ctx.flush_checkpoints()
    return {"val_accuracy": acc, "val_loss": val_loss}
