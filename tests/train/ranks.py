"""Run a test's own gloo ranks: ``run_ranks(target, world, *args)``."""

from __future__ import annotations

import multiprocessing as mp
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from hpoflow.train.rendezvous import free_port


def run_ranks(target: Any, world: int, *args: Any, out_dir: Path | None = None, hang_s: float = 240.0,
              clean_exit: bool = True) -> list[dict[str, Any]]:
    """Run ``target(rank, world, port, out_dir, *args)`` on ``world`` processes forked from the forkserver
    (tests/conftest.py preloads torch there) and return what each saved in ``out_dir/rank<r>.pt``. A rank
    that records an error in ``out_dir/*.error`` fails the test with it; so does a non-zero exit, with
    ``clean_exit``. ``hang_s`` bounds a hang (the ranks take seconds); ``out_dir`` defaults to a temporary
    directory."""
    if out_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            return run_ranks(target, world, *args, out_dir=Path(tmp), hang_s=hang_s, clean_exit=clean_exit)
    ctx = mp.get_context("forkserver")
    port = free_port()
    procs = [ctx.Process(target=target, args=(r, world, port, str(out_dir), *args)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + hang_s
    try:
        for p in procs:
            p.join(max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    errors = [f.read_text() for f in sorted(out_dir.glob("*.error"))]
    assert not errors, "\n".join(errors)
    if clean_exit:
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
