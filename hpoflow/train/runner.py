"""One rank of one trial, from job description to result: the same code for every engine.

``run_rank`` sets up threads, devices and the process group, runs the training function (the
built-in trainer or the user's ``module:function``), and always destroys the process group. It
returns the rank's outcome as plain data; it raises nothing.
"""

from __future__ import annotations

import importlib
import logging
import math
import random
import sys
import time
import traceback
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpoflow.spec import TrainConfig
from hpoflow.train import dist as hdist
from hpoflow.train.builtin import NonFiniteLoss, train_builtin
from hpoflow.train.context import TrialContext
from hpoflow.train.transport import Channel, NullChannel
from hpoflow.trial import RankOutcome, TrialRequest

log = logging.getLogger(__name__)

__all__ = ["RankJob", "RankOutcome", "load_function", "log_to_stderr", "run_rank"]


@dataclass(frozen=True)
class RankJob:
    """One rank's share of a ``TrialRequest``: where it sits and how to reach rank 0."""

    request: TrialRequest
    rank: int
    world_size: int
    local_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    threads: int = 1
    pg_timeout_s: float = 120.0
    store_path: str = ""  # a single-host trial's file store (no rendezvous socket); "" for TCP


def load_function(ref: str, python_path: tuple[str, ...] = ()) -> Callable[[TrialContext], Any]:
    """Import ``module:function``; ``python_path`` entries are put in front of ``sys.path``."""
    for p in reversed(python_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"{ref} is not callable")
    return typing.cast("Callable[[TrialContext], Any]", fn)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def _final_metrics(ret: Any, ctx: TrialContext) -> dict[str, float]:
    if isinstance(ret, dict):
        return {k: float(v) for k, v in ret.items() if isinstance(v, (int, float))}
    if isinstance(ret, (int, float)):
        return {ctx.metric: float(ret)}
    if ret is None and ctx.reports:
        return dict(ctx.reports[-1][1])
    return {}


def log_to_stderr(level: int = logging.INFO) -> None:
    """Send the "hpoflow" logger's records to stderr (a rank's log file; the CLI's terminal), once."""
    logger = logging.getLogger("hpoflow")
    if not any(getattr(h, "_hpoflow_stderr", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("hpoflow: %(message)s"))
        handler._hpoflow_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level)


def run_rank(job: RankJob, channel: Channel | None = None) -> RankOutcome:
    """Run one rank to the end. Exceptions in training become an ``error`` outcome."""
    log_to_stderr()
    req = job.request
    channel = channel or NullChannel()
    torch.set_num_threads(max(1, job.threads))
    use_cuda = req.gpus_per_process > 0 and torch.cuda.is_available()
    device = torch.device("cuda", 0) if use_cuda else torch.device("cpu")
    _seed_everything(req.seed)
    ctx: TrialContext | None = None
    finished = False  # every rank that ends without an exception leaves the group with its peers
    try:
        config = TrainConfig.model_validate(req.train)
        ctx = TrialContext(
            params=dict(req.params), config=config, trial_number=req.number, trial_dir=Path(req.trial_dir),
            rank=job.rank, world_size=job.world_size, local_rank=job.local_rank, device=device,
            metric=req.metric, pruning=req.pruning, channel=channel, attempt=req.attempt,
            checkpoint_dir=Path(req.checkpoints),
        )
        if job.world_size > 1:
            hdist.init_process_group(job.rank, job.world_size, job.master_addr, job.master_port,
                                     use_cuda, job.pg_timeout_s, job.store_path)
        fn = load_function(config.function, req.python_path) if config.function else train_builtin
        started_at = time.time()
        t0 = time.perf_counter()
        ret = fn(ctx)
        run_s = time.perf_counter() - t0
        metrics = _final_metrics(ret, ctx)
        pruned = ctx._prune
        value = metrics.get(req.metric)
        if job.rank == 0 and not pruned:
            if value is None:
                raise KeyError(
                    f"the training function returned no {req.metric!r} (study.metric); it returned "
                    f"{sorted(metrics) or ret!r}. Fix: return a dict with {req.metric!r}, or a float"
                )
            if not math.isfinite(value):
                raise NonFiniteLoss(f"{req.metric} is {value}")
        finished = True
        return RankOutcome("pruned" if pruned else "ok", metrics, started_at=started_at, run_s=run_s)
    except (Exception, SystemExit) as exc:  # a trial never raises through the engine
        tb = traceback.format_exc()
        sys.stderr.write(tb)
        sys.stderr.flush()
        # A broken collective (peer died) is a lost rank: worth retrying. User errors are not.
        text = str(exc).lower()
        retryable = job.world_size > 1 and any(w in text for w in ("gloo", "connection", "timed out"))
        return RankOutcome("error", {}, error=f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__,
                           retryable=retryable)
    finally:
        if ctx is not None:
            try:
                ctx.flush_checkpoints()  # an async save still being written must land first
            except Exception as exc:  # a failed write is reported, never raised from here
                log.warning("rank %d: last checkpoint not written: %s", job.rank, exc)
        hdist.destroy(leave_together=finished)
        sys.stdout.flush()
        sys.stderr.flush()
