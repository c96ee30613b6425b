"""Entry point of one rank process of the local engine.

It runs in a child forked from the engine's warm forkserver (torch and hpoflow already imported),
so a rank starts in milliseconds and every trial still gets a fresh process: no module globals,
seeds, thread settings or CUDA state survive from one trial to the next.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import signal
import sys
from multiprocessing.connection import Connection

from hpoflow.train.channel import NullChannel, PipeChannel
from hpoflow.train.runner import RankJob, run_rank

__all__ = ["rank_process", "warm_up"]


def warm_up() -> None:
    """Pay, once in the forkserver, the lazy imports torch makes on first use (an optimizer's
    constructor alone imports ``torch._dynamo``: ~800 modules, ~2 s). No tensor op runs here that
    could start a thread pool, so forking afterwards stays safe."""
    import torch
    import torch.distributed
    import torch.nn.parallel
    import torch.utils.data

    p = [torch.nn.Parameter(torch.zeros(1))]
    torch.optim.SGD(p, lr=0.1)
    torch.optim.Adam(p)
    torch.optim.AdamW(p)


if os.environ.get("HPOFLOW_NO_WARMUP") != "1":
    warm_up()


def _redirect_output(log_path: str) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the forkserver (our parent) exits. It exits when the engine's process
    dies, so a killed driver never leaves ranks training on as orphans."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def rank_process(job: RankJob, conn: Connection, env: dict[str, str], cores: tuple[int, ...],
                 log_path: str) -> None:
    """Set up this process for ``job`` (session, log, environment, CPU affinity) and run it."""
    _die_with_parent()
    os.setsid()  # own process group: the engine kills the rank and all its children at once
    _redirect_output(log_path)
    os.environ.update(env)
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:  # a container may forbid it; threads are still capped
            print(f"hpoflow: could not pin rank {job.rank} to cores {cores}: {exc}", file=sys.stderr)
    try:
        conn.send(("started", os.getpid()))
        channel = PipeChannel(conn) if job.rank == 0 else NullChannel()
        outcome = run_rank(job, channel)
        conn.send(("outcome", dataclasses.asdict(outcome)))
    except (BrokenPipeError, EOFError):  # the engine went away: nothing left to tell
        pass
    finally:
        conn.close()
