"""What the local engine's forkserver imports before it forks warm workers: torch, the trainer, and
the lazy imports torch makes on first use (an optimizer's constructor alone imports
``torch._dynamo``: ~800 modules, ~1-2 s), paid once and shared by every worker forked afterwards.

No tensor op runs here that could start a thread pool, so forking afterwards stays safe.
``HPOFLOW_NO_WARMUP=1`` skips the warm-up (torch is still imported).
"""

from __future__ import annotations

import gc
import os

import torch
import torch.distributed
import torch.nn.parallel
import torch.utils.data

import hpoflow.engines.local._worker
import hpoflow.train.builtin
import hpoflow.train.dist  # noqa: F401  # preloaded for the workers forked from here

__all__ = ["warm_up"]


def warm_up() -> None:
    """Construct each built-in optimizer once, then move everything preloaded out of the collector's
    reach: a collection after each trial walks only what the trial created (a full walk of torch's
    heap costs ~0.3 s)."""
    p = [torch.nn.Parameter(torch.zeros(1))]
    torch.optim.SGD(p, lr=0.1)
    torch.optim.Adam(p)
    torch.optim.AdamW(p)
    gc.collect()
    gc.freeze()


if os.environ.get("HPOFLOW_NO_WARMUP") != "1":
    warm_up()
