"""What the local engine's forkserver imports before it forks warm workers: torch, the trainer, and
the lazy imports torch makes on first use (an optimizer's constructor alone imports
``torch._dynamo``: ~800 modules, ~1-2 s), and what torch sets up lazily at its first training step,
and what each trial's start sets up on first use (``_first_calls``), paid once and shared by every
worker forked afterwards.

The warm-up trains a small CNN for two steps (convolution, batch norm, pooling, dropout, linear
layers, cross-entropy, backward, SGD and Adam steps, an evaluation pass). Without it every worker
made its own copy of what that first step allocates and initialises: ~22 MB of private memory per
worker on the digits study of ``bench/peers.py``, and part of the first trial's time on each slot.

It runs on one thread (``torch.set_num_threads(1)``; the previous count is restored, which starts no
thread): the intra-op pool never starts here, so forking afterwards stays safe
(``tests/engines/test_preload.py`` checks that the warm-up adds no thread). A torch built for GPUs
(``torch.backends.cuda.is_built()``) runs the forward passes only, with no ``backward()`` and no optimizer
step: on a machine with a GPU, the autograd engine's first run starts a thread per GPU, and an optimizer's
step checks for CUDA graph capture, which initialises CUDA; every worker forked afterwards then failed its
trials ("Unable to handle autograd's threading in combination with fork-based multiprocessing",
"Cannot re-initialize CUDA in forked subprocess", "CUDA error: initialization error": ``bench/gpu_check.py``
on an H100 and an H200, torch 2.11+cu130). The optimizers are still constructed (the ``torch._dynamo``
import).
``HPOFLOW_NO_WARMUP=1`` skips the warm-up (torch is still imported).
"""

from __future__ import annotations

import gc
import os
import random

import numpy as np
import torch
import torch.distributed
import torch.nn.parallel
import torch.utils.data

import hpoflow.engines.local._worker
import hpoflow.train.builtin
import hpoflow.train.dist  # noqa: F401  # preloaded for the workers forked from here
from hpoflow.engines.local._pages import drop_clean_file_pages
from hpoflow.spec import TrainConfig

__all__ = ["warm_up"]

_GPU_BUILD = torch.backends.cuda.is_built()


def _train_steps() -> None:
    """Two training steps and an evaluation pass of a small CNN on random data, on one thread."""
    from torch import nn

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2),
                              nn.Dropout(0.1), nn.Flatten(), nn.Linear(4 * 4 * 4, 8), nn.ReLU(), nn.Linear(8, 10))
        x = torch.randn(8, 1, 8, 8, generator=gen)
        y = torch.randint(0, 10, (8,), generator=gen)
        for opt in (torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-5),
                    torch.optim.Adam(model.parameters())):
            model.train()
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x[torch.randperm(8, generator=gen)]), y)
            if not _GPU_BUILD:  # no autograd engine and no optimizer step in its forkserver (the docstring)
                loss.backward()
                opt.step()
        model.eval()
        with torch.no_grad():
            float((model(x).argmax(1) == y).float().mean())
    finally:
        torch.set_num_threads(threads)


def _first_calls() -> None:
    """What every trial calls before the user's code and that sets itself up on first use: the trial
    config's validation (pydantic-core compiles the ``function`` pattern then: ~5 MB per worker) and
    the seeding of Python's, NumPy's and torch's generators (each trial seeds them again)."""
    TrainConfig.model_validate({"function": "module:function", "options": {}})
    TrainConfig.model_validate({})
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)


def warm_up() -> None:
    """Construct each built-in optimizer once, run two training steps (``_train_steps``) and what
    every trial calls first (``_first_calls``), then move everything preloaded out of the collector's
    reach: a collection after each trial walks only what the trial created (a full walk of torch's
    heap costs ~0.3 s)."""
    p = [torch.nn.Parameter(torch.zeros(1))]
    torch.optim.SGD(p, lr=0.1)
    torch.optim.Adam(p)
    torch.optim.AdamW(p)
    _train_steps()
    _first_calls()
    gc.collect()
    gc.freeze()


if os.environ.get("HPOFLOW_NO_WARMUP") != "1":
    warm_up()
drop_clean_file_pages()  # torch's code touched only by its import (``_pages``); again once all is preloaded
