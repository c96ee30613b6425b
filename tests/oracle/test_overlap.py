"""Overlap from the real backward: DDP's buckets, when each is ready, what stays exposed."""

from __future__ import annotations

import itertools
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpoflow.oracle import Plan, load_cluster, model_facts, predict
from hpoflow.oracle._trace import Kernel, StepTrace
from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.facts import ModelFacts, resolve_model
from hpoflow.oracle.model import ddp_buckets, step_cost
from hpoflow.train.dist import destroy
from tests.train.ranks import run_ranks


def _toy(numels: tuple[int, int] = (1_000_000, 1_000_000)) -> ModelFacts:
    """Facts of a hand-made step: forward 1 ms, then two backward kernels of 2 ms each; the
    gradient of parameter 1 is ready after the first, that of parameter 0 after the second."""
    trace = StepTrace(
        layers=("fc0", "fc1", "loss"),
        kernels=(Kernel(1, False, "mm", False, 1e9, 0.0, 0.0), Kernel(1, True, "mm", False, 2e9, 0.0, 0.0),
                 Kernel(0, True, "mm", False, 2e9, 0.0, 0.0)),
        grad_ready=((1, numels[1], 1), (0, numels[0], 2)),
        saved_bytes=0.0, saved_fixed_bytes=0.0)
    return replace(model_facts("mlp"), trace=trace, params=sum(numels), param_tensors=2, ops_per_step=0)


def _toy_cluster(bandwidth: float, overlap: float = 1.0) -> Any:
    return load_cluster({
        "name": "toy", "nodes": 1, "devices_per_node": 2, "overlap": overlap,
        "overheads": {"collective_s": 0.0, "step_jitter": 0.0},
        "device": {"name": "toy", "peak_flops": {"fp32": 1e12}, "memory_bytes": 1e12, "memory_bandwidth": 1e12,
                   "efficiency": 1.0},
        "intra_node": {"name": "link", "bandwidth": bandwidth, "latency": 0.0},
        "inter_node": {"name": "link", "bandwidth": bandwidth, "latency": 0.0}})


def test_exposed_is_what_runs_past_the_end_of_backward() -> None:
    f = _toy()
    plan = Plan(batch_size=1, devices=2, momentum=0.0)
    # 2 ranks: a bucket of M bytes takes M / B; each bucket here is 4 MB
    cost = step_cost(f, _toy_cluster(4e9), plan, 2, 1)
    assert cost.forward_s == pytest.approx(1e-3) and cost.backward_s == pytest.approx(4e-3)
    assert cost.collectives == 2 and cost.comm_s == pytest.approx(2e-3)
    # bucket 0 ready at 2 ms runs 2-3 ms (hidden), bucket 1 ready at 4 ms (end of backward) runs 4-5 ms
    assert cost.exposed_comm_s == pytest.approx(1e-3)
    # a slower link: bucket 0 runs 2-5 ms, bucket 1 waits for it and runs 5-8 ms: 4 ms exposed
    slow = step_cost(f, _toy_cluster(4e9 / 3), plan, 2, 1)
    assert slow.exposed_comm_s == pytest.approx(4e-3)
    # overlap 0 (gloo on CPU cores): everything after backward; 0.5: half of each
    assert step_cost(f, _toy_cluster(4e9, overlap=0.0), plan, 2, 1).exposed_comm_s == pytest.approx(2e-3)
    assert step_cost(f, _toy_cluster(4e9), replace(plan, overlap=0.5), 2, 1).exposed_comm_s == pytest.approx(1.5e-3)
    assert cost.step_s == pytest.approx(cost.compute_s + cost.exposed_comm_s)


def test_bucket_sizes_follow_ddp() -> None:
    f = _toy((100_000, 3_000_000))
    # the first bucket closes at 1 MiB: parameter 1 (12 MB) alone, then parameter 0
    assert ddp_buckets(f, Plan(batch_size=1)) == [(0,), (1,)]
    assert ddp_buckets(f, Plan(batch_size=1, bucket_mb=0)) == [(0,), (1,)]
    small_first = _toy((3_000_000, 100_000))  # 0.4 MB then 12 MB: both in the first bucket
    assert ddp_buckets(small_first, Plan(batch_size=1)) == [(0, 1)]
    rn50 = ddp_buckets(model_facts("resnet50"), Plan(batch_size=32))
    assert len(rn50) == 5 and len(ddp_buckets(model_facts("resnet50"), Plan(batch_size=32, bucket_mb=0))) == 161


def _ddp_buckets_worker(rank: int, world: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        build, shape, classes, _ = resolve_model("resnet18", (3, 32, 32), 10, {})
        torch.manual_seed(0)
        model = nn.parallel.DistributedDataParallel(build())
        x, y = torch.randn(4, *shape), torch.randint(0, classes, (4,))
        for _ in range(3):  # DDP rebuilds its buckets after the first step, in gradient-ready order
            model.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
        torch.save(model._get_ddp_logging_data() if rank == 0 else {}, Path(out) / f"rank{rank}.pt")
    finally:
        destroy()


@pytest.mark.slow
def test_buckets_equal_real_ddps_rebuilt_buckets(tmp_path: Path) -> None:
    # 2 ranks forked from the preloaded forkserver (tests/train/ranks.py), not 2 interpreters importing torch
    ddp = run_ranks(_ddp_buckets_worker, 2, out_dir=tmp_path, hang_s=120)[0]
    assert ddp["has_rebuilt_buckets"] == 1
    real_sizes = [int(s) for s in str(ddp["rebuilt_bucket_sizes"]).split(",")]
    real_order = [[int(i) for i in b.split()] for b in str(ddp["rebuilt_per_bucket_param_indices"]).split(",")]
    f = model_facts("resnet18", (3, 32, 32), 10)
    assert f.trace is not None
    ours = ddp_buckets(f, Plan(batch_size=4))
    assert [sum(4 * f.trace.grad_ready[i][1] for i in b) for b in ours] == real_sizes
    assert [[f.trace.grad_ready[i][0] for i in b] for b in ours] == real_order


@pytest.mark.parametrize(("preset", "precision", "batch"), [("p100-cluster", "fp32", 32), ("h100-cluster", "bf16", 64)])
def test_efficiency_falls_smoothly_with_devices(preset: str, precision: str, batch: int) -> None:
    data = dict(PRESETS[preset])
    data["nodes"] = 4096 // int(data["devices_per_node"])
    c = load_cluster(data)
    f = model_facts("resnet50", precision=precision)
    plans = [Plan(batch_size=batch, devices=2**i, precision=precision, channels_last=True) for i in range(13)]
    eff = [predict(f, c, plan).scaling_efficiency for plan in plans]
    assert all(later <= earlier + 1e-9 for earlier, later in itertools.pairwise(eff))
    # no cliff: each doubling of the devices costs at most a few points, all the way to 4,096 GPUs
    assert max(earlier - later for earlier, later in itertools.pairwise(eff)) < 0.02
    assert eff[-1] > 0.85


def test_forced_flat_ring_pays_its_latency_at_scale() -> None:
    data = {**PRESETS["h100-cluster"], "nodes": 512}
    c = load_cluster(data)
    f = model_facts("resnet50", precision="bf16")
    plan = Plan(batch_size=64, devices=4096, precision="bf16", channels_last=True)
    auto, ring = predict(f, c, plan), predict(f, c, replace(plan, strategy="ring"))
    assert auto.cost.algorithm in ("tree", "hier-hd", "hier-ring")
    assert "latency steps" in auto.algorithm_note and "8190" in auto.algorithm_note
    assert ring.cost.comm_latency_s > 10 * auto.cost.comm_latency_s
    assert ring.scaling_efficiency < auto.scaling_efficiency


def test_parameter_server_and_easgd_exchange_after_the_step() -> None:
    f, c = model_facts("resnet50"), load_cluster("p100-cluster")
    ps = predict(f, c, Plan(batch_size=32, devices=32, strategy="ps", servers=4)).cost
    assert ps.exposed_comm_s == pytest.approx(ps.comm_s)
    e1, e8 = (predict(f, c, Plan(batch_size=32, devices=32, strategy="easgd", period=t)).cost for t in (1, 8))
    assert e8.comm_s == pytest.approx(e1.comm_s / 8)
    assert e1.exposed_comm_s == pytest.approx(e1.comm_s)
