"""The training function of ``bench/oracle_sharded.py --cap-mb N``: the built-in trainer in a rank whose
address space is capped (``RLIMIT_AS``) at what the rank holds when the trial's code starts, plus
``training.options.address_space_mb`` MiB. So each rank of the trial (run by the engine's worker
through ``hpoflow.train.runner.run_rank``, process group already up) may add that much and no more:
a trial that needs more stops with torch's "can't allocate memory" error.

Before the limit is read: ``torch._dynamo`` is imported (about 70 MB the trainer's first optimizer and
its memory meter import anyway; not training's memory), and glibc is held to one heap arena
(``mallopt(M_ARENA_MAX, 1)``: else a thread's first allocation reserves a 64 MiB arena of address
space, whenever that comes).
"""

from __future__ import annotations

import contextlib
import ctypes
import resource
from typing import Any

_M_ARENA_MAX = -8


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def train(ctx: Any) -> dict[str, float]:
    import torch._dynamo  # noqa: F401 - imported here, before the limit is set (see the module docs)

    from hpoflow.train.builtin import train_builtin

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").mallopt(_M_ARENA_MAX, 1)
    cap = int(float(ctx.config.options["address_space_mb"]) * 2**20)
    resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    return train_builtin(ctx)
