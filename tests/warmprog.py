"""A program whose end needs a real interpreter's end (a command trial, ``hpoflow.train.processes``): it
trains a small ``DistributedDataParallel`` model over its ranks (gloo, from torchrun's environment) and
keeps the wrapper past ``destroy_process_group()`` (a global, as many scripts leave it); it registers an
``atexit`` handler and starts a non-daemon thread that finishes 0.3 s after the main code returns, each
writing a file to ``$HPOFLOW_TRIAL_DIR`` (``atexit_rank<R>``, ``thread_rank<R>``). Prints ``score=1.0``."""

from __future__ import annotations

import atexit
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

RANK = int(os.environ.get("RANK", "0"))
OUT = Path(os.environ["HPOFLOW_TRIAL_DIR"])


def _late() -> None:
    time.sleep(0.3)
    (OUT / f"thread_rank{RANK}").write_text("1")


atexit.register(lambda: (OUT / f"atexit_rank{RANK}").write_text("1"))
distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
if distributed:
    dist.init_process_group("gloo")
model = nn.Linear(16, 1)
net = DistributedDataParallel(model) if distributed else model
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for _ in range(5):
    opt.zero_grad()
    net(torch.randn(8, 16)).pow(2).mean().backward()
    opt.step()
if distributed:
    dist.destroy_process_group()  # the wrapper (net) lives on
threading.Thread(target=_late).start()
print("score=1.0")
