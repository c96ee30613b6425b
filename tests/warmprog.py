"""A program whose end needs a real interpreter's end (a command trial, ``hpoflow.train.processes``): its
``main()`` trains a small ``DistributedDataParallel`` model over its ranks (gloo, from torchrun's
environment), ends each step with a broadcast of a flag tensor (as scripts do to stop together), calls
``destroy_process_group()`` and returns with the wrapper still alive in its frame, so the wrapper is freed
as ``main()`` returns, after the group was destroyed (the pattern of a plain DDP script). It registers an
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


def main() -> None:
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
            flag = torch.tensor([0])
            dist.broadcast(flag, 0)
    if distributed:
        dist.destroy_process_group()  # net (the wrapper) is freed when main() returns


atexit.register(lambda: (OUT / f"atexit_rank{RANK}").write_text("1"))
main()
threading.Thread(target=_late).start()
print("score=1.0")
