"""A Lightning training script, which hpoflow tunes as it is (examples/scripts/lightning.yaml):

    torchrun --nproc-per-node 2 examples/scripts/train_lightning.py --lr 0.1 --hidden 32 --epochs 4
    hpoflow run examples/scripts/lightning.yaml --run-dir runs/script-lightning

A small MLP (a ``LightningModule``) learns to tell two interleaved spirals apart (points generated from
the seed: nothing is downloaded), with Lightning's progress bar on and its training data read by two
``DataLoader`` worker processes, as a Lightning script usually has them. Under torchrun, or as a
multi-rank hpoflow trial (which gives each rank torchrun's environment), Lightning runs DDP over gloo on
the CPU by itself. It validates once per epoch, or more often with ``--val-check-interval 0.5``; rank 0
prints ``validation: step S, epoch E, val_loss V, val_accuracy A`` after each (for people: hpoflow does not
read it). Where hpoflow is installed, ``HpoflowCallback`` reports the logged metrics to the trial at each
validation (step: the validation count, which ``training.epochs`` and a scheduler's rungs count), stops
the Trainer when the trial is pruned or paused, and checkpoints in ``HPOFLOW_CHECKPOINT_DIR`` before a
pause; ``resume_path()`` is that checkpoint, from which ``Trainer.fit`` resumes the paused trial's next run
(outside a trial the callback does nothing and there is nothing to resume).
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

try:
    from hpoflow.integrations.lightning import HpoflowCallback, resume_path
except ImportError:  # the script needs nothing of hpoflow
    HpoflowCallback = None  # type: ignore[assignment,misc]

    def resume_path() -> str | None:
        return None


def spirals(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(n, generator=g) * 2 * math.pi + 0.5
    label = torch.randint(0, 2, (n,), generator=g)
    radius = t / (2 * math.pi)
    angle = t + label * math.pi
    x = torch.stack([radius * torch.cos(angle), radius * torch.sin(angle)], 1)
    return x + 0.03 * torch.randn(n, 2, generator=g), label


class Spirals(pl.LightningModule):
    def __init__(self, hidden: int, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(nn.Linear(2, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, 2))
        self.loss = nn.CrossEntropyLoss()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.loss(self.net(x), y)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", self.loss(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_accuracy", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def on_validation_epoch_end(self) -> None:
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            m = self.trainer.callback_metrics
            print(f"validation: step {self.trainer.global_step}, epoch {self.current_epoch + 1}, "
                  f"val_loss {float(m['val_loss']):.6f}, val_accuracy {float(m['val_accuracy']):.4f}", flush=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes of the training data")
    p.add_argument("--val-check-interval", type=float, default=1.0, help="Lightning's: 0.5 validates twice an epoch")
    args = p.parse_args()
    pl.seed_everything(args.seed, verbose=False)
    x, y = spirals(args.samples, args.seed)
    n_train = int(0.8 * len(x))
    train = DataLoader(TensorDataset(x[:n_train], y[:n_train]), batch_size=args.batch_size, shuffle=True,
                       num_workers=args.workers, persistent_workers=args.workers > 0)
    val = DataLoader(TensorDataset(x[n_train:], y[n_train:]), batch_size=512)
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # torchrun's (or hpoflow's) ranks on this node
    nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, num_nodes=nodes, strategy="ddp" if devices * nodes > 1 else "auto",
        max_epochs=args.epochs, logger=False, enable_checkpointing=False, enable_model_summary=False,
        val_check_interval=args.val_check_interval,
        callbacks=[HpoflowCallback()] if HpoflowCallback is not None else [])
    trainer.fit(Spirals(args.hidden, args.lr), train, val, ckpt_path=resume_path())
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        # the ranks leave together: one tearing its gloo connections down while a peer still uses them
        # aborts now and then ("terminate called without an active exception", 2 CPU ranks under torchrun)
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
        # ...and skip the interpreter's exit: with torch 2.13 on gloo, a C++ destructor run there aborts now
        # and then, the group already gone ("terminate called without an active exception"; see train_ddp.py);
        # everything is done and reported, the streams are flushed
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
