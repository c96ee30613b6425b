"""hpoflow.train.dist.destroy: DDP ranks leave together, and a rank whose peer is gone still
leaves promptly (real gloo groups on 127.0.0.1, 2 processes)."""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpoflow.train.dist import destroy
from hpoflow.train.rendezvous import free_port

pytestmark = pytest.mark.slow  # many real gloo groups


def _rank(rank: int, port: int, peer_vanishes: bool, out: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    model = nn.parallel.DistributedDataParallel(nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    if peer_vanishes and rank == 1:
        os._exit(0)  # gone without leaving the group
    if peer_vanishes:
        time.sleep(0.5)  # let the peer exit first
    t0 = time.perf_counter()
    destroy(leave_timeout_s=5.0, leave_together=not peer_vanishes)
    out.put((rank, time.perf_counter() - t0, dist.is_initialized()))


def _run(peer_vanishes: bool) -> dict[int, tuple[float, bool]]:
    ctx = mp.get_context("forkserver")  # ranks forked warm (tests/conftest.py preloads torch there)
    out: mp.Queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, peer_vanishes, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in range(1 if peer_vanishes else 2):
            rank, seconds, still = out.get(timeout=120)
            results[rank] = (seconds, still)
        for p in procs:
            p.join(timeout=60)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()


def test_ranks_leave_together_and_the_group_is_gone() -> None:
    results = _run(peer_vanishes=False)
    assert set(results) == {0, 1}
    assert all(not still for _, still in results.values())
    assert all(seconds < 5.0 for seconds, _ in results.values())


def test_an_error_path_leaves_at_once_when_the_peer_is_gone() -> None:
    results = _run(peer_vanishes=True)
    seconds, still = results[0]
    assert not still
    assert seconds < 2.0  # no barrier on an error path: a dead peer would hold it for its timeout
