"""ZeRO-1 and FSDP priced by the oracle: memory per rank, bytes per step, the step's timeline, and
the bytes a real FSDP2 / ZeroRedundancyOptimizer step sends over gloo (wchar of each rank)."""

from __future__ import annotations

import os
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpoflow.oracle import Plan, load_cluster, model_facts, predict
from hpoflow.oracle._zoo_lm import decoder
from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.feasibility import check_trial
from hpoflow.oracle.model import memory_breakdown
from hpoflow.train.collectives import ring_allreduce_bytes
from hpoflow.train.dist import destroy
from tests.train.ranks import run_ranks

SMALL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 4, "ffn": 512}  # a GPT-2-shaped toy decoder
VOCAB, SEQ, BATCH = 56, 64, 8


def _small(param_dtype: str = "fp32") -> Any:
    return model_facts("megatron-gpt-1.2b", (SEQ,), VOCAB, options=SMALL, param_dtype=param_dtype)


def _fsdp(p: int, **changes: Any) -> Plan:
    return Plan(batch_size=BATCH, devices=p, strategy="fsdp", optimizer="adamw", **changes)


def test_sharded_state_divides_by_the_ranks() -> None:
    f, c = model_facts("resnet50"), load_cluster("a100-cluster")
    full = memory_breakdown(f, c, Plan(batch_size=32, strategy="allreduce", optimizer="adam"), 32, 8)
    zero = memory_breakdown(f, c, Plan(batch_size=32, strategy="zero1", optimizer="adam"), 32, 8)
    shard = memory_breakdown(f, c, Plan(batch_size=32, strategy="fsdp", optimizer="adam"), 32, 8)
    assert full["optimizer_state"] == 8 * f.params and zero["optimizer_state"] == f.params
    assert zero["weights"] == full["weights"] and zero["ddp_buckets"] == full["ddp_buckets"] == 4 * f.params
    assert shard["weights"] == shard["gradients"] == 4 * f.params / 8 and shard["ddp_buckets"] == 0
    assert shard["optimizer_state"] == f.params and shard["gathered_params"] > 0
    assert shard["total"] < zero["total"] < full["total"]
    assert shard["activations"] == full["activations"]  # sharding leaves activations alone


def test_fsdp_gathers_two_units_at_a_time_unless_it_keeps_them() -> None:
    f = _small()
    c = load_cluster(PRESETS["laptop"])
    trace = f.trace
    assert trace is not None and [u.name for u in trace.units] == ["layers.0", "layers.1"]
    unit = trace.units[0].params
    kept = memory_breakdown(f, c, _fsdp(2, reshard_after_forward=False), BATCH, 2)
    freed = memory_breakdown(f, c, _fsdp(2), BATCH, 2)
    assert freed["gathered_params"] == 4 * (trace.root_params + 2 * unit)  # two units: this and the next
    assert kept["gathered_params"] == 4 * f.params
    half = memory_breakdown(_small("bf16"), c, _fsdp(2, param_dtype="bf16"), BATCH, 2)
    assert half["gathered_params"] == freed["gathered_params"] / 2
    offload = memory_breakdown(f, c, _fsdp(2, cpu_offload=True), BATCH, 2)
    assert offload["weights"] == offload["gradients"] == offload["optimizer_state"] == 0


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_bytes_per_step_follow_the_collectives(backend: str) -> None:
    f = _small()
    c = load_cluster({**PRESETS["laptop"], "backend": backend})
    m = 4.0 * f.params
    root = 4.0 * (f.trace.root_params if f.trace else 0)
    rs = ring_allreduce_bytes(m, 4) if backend == "gloo" else 3 / 4 * m  # gloo reduce-scatters as an all-reduce
    fsdp = predict(f, c, _fsdp(4)).cost
    assert fsdp.bytes_per_step == pytest.approx(3 / 4 * m + 3 / 4 * (m - root) + rs)  # root stays gathered
    again = predict(f, c, _fsdp(4, reshard_root=True)).cost
    assert again.bytes_per_step == pytest.approx(2 * 3 / 4 * m + rs)
    kept = predict(f, c, _fsdp(4, reshard_after_forward=False)).cost
    assert kept.bytes_per_step == pytest.approx(3 / 4 * m + rs)
    zero = predict(f, c, replace(_fsdp(4), strategy="zero1")).cost
    assert zero.bytes_per_step == pytest.approx(ring_allreduce_bytes(m, 4) + 3 / 4 * m)
    assert predict(f, c, _fsdp(1)).cost.bytes_per_step == 0


def test_fsdp_hides_its_collectives_under_compute_until_the_network_is_slow() -> None:
    f = model_facts("tinyllama-1.1b", param_dtype="bf16")
    plan = Plan(batch_size=4, devices=64, strategy="fsdp", param_dtype="bf16", optimizer="adamw")
    fast = predict(f, load_cluster("h100-cluster"), plan).cost
    assert fast.exposed_comm_s < 0.05 * fast.comm_s + 1e-3  # prefetching one unit ahead hides nearly all
    slow_net = load_cluster({**PRESETS["h100-cluster"], "inter_node": "10gbe", "rails": 1})
    slow = predict(f, slow_net, plan).cost
    assert slow.comm_s > slow.compute_s and slow.exposed_comm_s > 0.5 * (slow.comm_s - slow.compute_s)
    assert slow.network_bytes_per_node == pytest.approx(fast.network_bytes_per_node)


def test_precheck_admits_a_trial_that_fits_only_when_sharded() -> None:
    c = load_cluster({**PRESETS["laptop"], "device": {**_cpu(), "memory_bytes": 12e6}})
    train = {"model": "cnn", "dataset": "digits", "batch_size": 8, "optimizer": "adam", "epochs": 1,
             "model_options": {"channels": 64, "hidden": 1024}}
    replicated = check_trial({**train, "strategy": "allreduce"}, 4, 0, c)
    assert not replicated.feasible and "largest batch" in replicated.reason
    # the trainer's fsdp options (hpoflow.train.options.FSDPOptions), read through its oracle_plan()
    sharded = check_trial({**train, "strategy": "fsdp",
                           "strategy_options": {"mixed_precision": "bf16", "reduce_dtype": "bf16"}}, 4, 0, c)
    assert sharded.feasible, sharded.reason
    assert sharded.reason.startswith("fits only when sharded: fsdp needs")
    assert "replicated (allreduce)" in sharded.reason
    predicted = sharded.predicted
    assert predicted["strategy"] == "fsdp" and predicted["bytes_per_step"] > 0
    assert predicted["memory_per_device_bytes"] <= 12e6 < replicated.predicted["memory_per_device_bytes"]
    bad = check_trial({**train, "strategy": "fsdp", "strategy_options": {"shard": 2}}, 4, 0, c)
    assert bad.feasible and bad.reason.startswith("not checked") and "shard" in bad.reason


def _cpu() -> dict[str, Any]:
    from hpoflow.oracle.catalog import DEVICES

    return dict(DEVICES["cpu"])


# -- real FSDP2 and ZeroRedundancyOptimizer over gloo: the bytes each rank writes per step ---------------
def _wchar() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))


def _worker(rank: int, world: int, port: int, out: str, strategy: str, param_dtype: str) -> None:
    """One rank, forked from the forkserver that has torch loaded (``run_ranks``): 2 warm-up steps, then
    the bytes this process writes per step over 4 steps, in ``out/rank<rank>.pt``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = decoder((SEQ,), VOCAB, preset="megatron-gpt-1.2b", **SMALL)
        opt: Any
        if strategy == "fsdp":
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if param_dtype == "bf16" else None)
            for block in model.get_submodule("layers").children():
                fully_shard(block, mp_policy=policy)
            fully_shard(model, mp_policy=policy)  # the root: FSDP2 keeps it gathered after forward
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            model = nn.parallel.DistributedDataParallel(model)
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
        x, y = torch.randint(0, VOCAB, (BATCH, SEQ)), torch.randint(0, VOCAB, (BATCH, SEQ))

        def step() -> None:
            opt.zero_grad()
            logits = model(x)
            nn.functional.cross_entropy(logits.reshape(-1, VOCAB).float(), y.reshape(-1)).backward()
            opt.step()

        for _ in range(2):
            step()
        dist.barrier()
        before = _wchar()
        for _ in range(4):
            step()
        torch.save({"sent": (_wchar() - before) / 4}, Path(out, f"rank{rank}.pt"))
    except BaseException:
        Path(out, f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        destroy()


@pytest.mark.slow
@pytest.mark.parametrize(("strategy", "world", "param_dtype"),
                         [("fsdp", 2, "fp32"), ("fsdp", 4, "bf16"), ("zero1", 2, "fp32")])
def test_bytes_per_step_match_real_collectives_over_gloo(tmp_path: Path, strategy: str, world: int,
                                                          param_dtype: str) -> None:
    # ranks forked from the forkserver that has torch loaded (not spawned: ~2 CPU-s of imports each)
    sent = [r["sent"] for r in run_ranks(_worker, world, strategy, param_dtype, out_dir=tmp_path)]
    f = _small(param_dtype if strategy == "fsdp" else "fp32")
    plan = Plan(batch_size=BATCH, devices=world, strategy=strategy, optimizer="adamw", param_dtype=param_dtype,
                bucket_mb=25.0)
    predicted = predict(f, load_cluster(PRESETS["laptop"]), plan).cost.bytes_per_step
    # FSDP2 pads each shard to a multiple of the world size, and ZeRO's shares are whole tensors
    # (uneven): the rank average is what the oracle predicts, within a few percent
    assert sum(sent) / world == pytest.approx(predicted, rel=0.05)


def test_the_start_up_is_priced_beside_the_step() -> None:
    """fsdp is built in shards (its shard and the largest tensor whole), a replica whole plus DDP's first
    broadcast of it (buckets of up to 250 MiB); the memory per device is the larger of start-up and step."""
    f = _small()
    c = load_cluster(PRESETS["laptop"])
    assert 0 < f.largest_param_tensor < f.params
    shard = memory_breakdown(f, c, _fsdp(4), BATCH, 4)
    assert shard["startup"] == pytest.approx(4 * f.params / 4 + 4 * f.largest_param_tensor + c.device.reserved_bytes)
    replica = memory_breakdown(f, c, replace(_fsdp(4), strategy="allreduce"), BATCH, 4)
    assert replica["startup"] == pytest.approx(2 * 4 * f.params + c.device.reserved_bytes)
    alone = memory_breakdown(f, c, replace(_fsdp(1), strategy="allreduce"), BATCH, 1)
    assert alone["startup"] == pytest.approx(4 * f.params + c.device.reserved_bytes)  # no peer: no broadcast
    for parts in (shard, replica, alone):
        assert parts["startup"] < parts["step"] == parts["total"]
    tight = load_cluster({**PRESETS["laptop"], "device": {**_cpu(), "memory_bytes": replica["startup"] * 0.99}})
    assert predict(f, tight, replace(_fsdp(4), strategy="allreduce")).max_batch_per_device == 0
