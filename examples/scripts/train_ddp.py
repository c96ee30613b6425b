"""A plain torchrun training script, which hpoflow tunes as it is (examples/scripts/ddp.yaml):

    torchrun --nproc-per-node 2 examples/scripts/train_ddp.py --lr 0.05 --hidden 32 --epochs 8
    hpoflow run examples/scripts/ddp.yaml --run-dir runs/script-ddp

A small MLP learns to tell two interleaved spirals apart (points generated from the seed: nothing is
downloaded), with DistributedDataParallel over gloo (nccl on GPUs), its process group set up from
torchrun's environment (``init_method="env://"``). After each epoch rank 0 prints
``epoch=E val_loss=V val_accuracy=A``: the line hpoflow reads as a report.

With ``--checkpoint-dir`` (default: ``$HPOFLOW_CHECKPOINT_DIR``, which hpoflow sets) rank 0 saves the
model, the optimizer and the epoch at the end of every epoch, before it reports it, and the script
starts from the checkpoint it finds there: a paused trial resumes where it stopped (ASHA, PBT), and
trains no epoch twice. ``--lr`` applies to a resumed optimizer too (a PBT member resumes with a new one).

Where hpoflow is installed, rank 0 also reports through ``hpoflow.client`` (once: the printed line and
the report are the same report) and asks ``should_stop()``; every rank follows rank 0's answer, so a
pruned or paused trial stops at that epoch instead of after ``training.stop_grace_s``. Without hpoflow,
or outside a trial, those calls do nothing.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

try:
    from hpoflow import client
except ImportError:  # the script needs nothing of hpoflow
    client = None  # type: ignore[assignment]


def spirals(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` points of two interleaved spirals (2 features) and their class (0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 2 * math.pi + 0.5
    label = torch.randint(0, 2, (n,), generator=g)
    radius = t / (2 * math.pi)
    angle = t + label * math.pi
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], 1)
    return x + 0.03 * torch.randn(n, 2, generator=g), label


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64, help="per rank")
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", default=os.environ.get("HPOFLOW_CHECKPOINT_DIR"))
    args = p.parse_args()

    world = int(os.environ.get("WORLD_SIZE", "1"))
    distributed = world > 1
    cuda = torch.cuda.is_available() and bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if distributed:
        dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    rank = dist.get_rank() if distributed else 0
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)  # torchrun's idiom: the node's GPUs are visible, LOCAL_RANK's is this rank's
    torch.manual_seed(args.seed)

    x, y = spirals(args.samples, args.seed)
    n_train = int(0.8 * len(x))
    x_train, y_train = x[:n_train].to(device), y[:n_train].to(device)
    x_val, y_val = x[n_train:].to(device), y[n_train:].to(device)
    model = nn.Sequential(nn.Linear(2, args.hidden), nn.Tanh(), nn.Linear(args.hidden, args.hidden), nn.Tanh(),
                          nn.Linear(args.hidden, 2)).to(device)
    net: nn.Module = DistributedDataParallel(model) if distributed else model
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()

    start = 1
    ckpt = Path(args.checkpoint_dir) / "train_ddp.pt" if args.checkpoint_dir else None
    if ckpt is not None and ckpt.exists():
        state = torch.load(ckpt, map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        for group in opt.param_groups:
            group["lr"] = args.lr
        start = int(state["epoch"]) + 1
        if rank == 0:
            print(f"resumed from {ckpt} after epoch {state['epoch']}", flush=True)

    for epoch in range(start, args.epochs + 1):
        net.train()
        order = torch.randperm(n_train, generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        mine = order[rank::world].to(device)  # this rank's share of the epoch
        for i in range(0, len(mine), args.batch_size):
            batch = mine[i:i + args.batch_size]
            opt.zero_grad()
            loss_fn(net(x_train[batch]), y_train[batch]).backward()
            opt.step()
        net.eval()
        with torch.no_grad():
            logits = model(x_val)
            val_loss = loss_fn(logits, y_val).item()
            val_accuracy = (logits.argmax(1) == y_val).float().mean().item()
        if rank == 0 and ckpt is not None:  # saved before it is reported: a pause after the report loses nothing
            ckpt.parent.mkdir(parents=True, exist_ok=True)
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}, tmp)
            os.replace(tmp, ckpt)
        stop = 0
        if rank == 0:
            print(f"epoch={epoch} val_loss={val_loss:.6f} val_accuracy={val_accuracy:.4f}", flush=True)
            if client is not None:
                client.report(epoch, val_loss=val_loss, val_accuracy=val_accuracy)
                stop = int(client.should_stop())
        if distributed:  # every rank stops where rank 0 does
            flag = torch.tensor([stop], device=device)
            dist.broadcast(flag, 0)
            stop = int(flag.item())
        if stop:
            break
    if distributed:
        # DDP's reducer holds the process group: drop it while the group is still registered, so the group
        # is torn down by destroy_process_group() while the tensors of its last collective are still ours
        # (a gloo thread freeing one of them at the teardown would wait for the GIL the teardown holds)
        net = model
        # and the ranks leave together: one tearing its gloo connections down while a peer still uses them
        # aborts now and then ("terminate called without an active exception", 2 CPU ranks under torchrun)
        dist.barrier()
        dist.destroy_process_group()
        # ...and skip the interpreter's exit: with torch 2.13 on gloo, a C++ destructor run there aborts now
        # and then, the group already gone ("terminate called without an active exception": 2 of 24 runs
        # beside two CPU-bound processes); everything is done and reported, the streams are flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
