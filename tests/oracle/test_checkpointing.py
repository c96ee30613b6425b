"""Activation checkpointing: what each policy keeps, what it recomputes, and Megatron's published
1.2B GPT (batch 8, one 32 GB V100, --checkpoint-activations) fitting only with it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hpoflow.oracle import Plan, load_cluster, model_facts, predict
from hpoflow.oracle._memory import activation_bytes, saved_bytes

GIB = 2**30
# one DGX-2H V100 32 GB (450 W: 130 TFLOPS fp16 on its tensor cores, NVIDIA's ADLR blog on Megatron-LM v1.0)
V100_32GB = {"name": "dgx2h-v100-32gb", "nodes": 1, "devices_per_node": 16, "intra_node": "nvlink2",
             "inter_node": "ib-edr",
             "device": {"name": "V100 SXM3 32GB", "peak_flops": {"fp32": 16.4e12, "fp16": 130e12},
                        "memory_bytes": 32 * GIB, "memory_bandwidth": 900e9, "efficiency": 0.8,
                        "memory_efficiency": 0.8, "kernel_s": 4e-6, "reserved_bytes": GIB, "memory_overhead": 0.05}}


def _megatron(policy: str) -> Plan:
    return Plan(batch_size=8, devices=1, precision="fp16", optimizer="adam", activation_checkpointing=policy)


def test_megatron_1_2b_fits_a_32gb_v100_at_batch_8_only_with_checkpointing() -> None:
    f, c = model_facts("megatron-gpt-1.2b", precision="fp16"), load_cluster(V100_32GB)
    assert 1.20e9 < f.params < 1.22e9 and f.tokens_per_sample == 1024  # Shoeybi et al. 2019, Table 1
    plain = predict(f, c, _megatron("none"))
    full = predict(f, c, _megatron("full"))
    selective = predict(f, c, _megatron("op"))
    assert not plain.fits and plain.max_batch_per_device < 8
    assert full.fits and full.max_batch_per_device >= 8  # Megatron-LM's recipe: --checkpoint-activations
    assert full.memory_per_device_bytes < selective.memory_per_device_bytes < plain.memory_per_device_bytes
    # recomputation costs time: full recomputes every block's forward, op only what it did not keep
    assert plain.cost.recompute_s == 0 < selective.cost.recompute_s < full.cost.recompute_s
    assert full.cost.recompute_s == pytest.approx(full.cost.forward_s, rel=0.1)  # nearly the whole forward
    assert plain.cost.step_s < selective.cost.step_s < full.cost.step_s


def test_policies_keep_what_they_say() -> None:
    f = model_facts("megatron-gpt-1.2b", precision="fp16")
    trace = f.trace
    assert trace is not None and len(trace.units) == 40
    u = trace.units[0]
    assert 0 < u.input < u.kept < u.saved
    per, _ = saved_bytes(f, _megatron("none"))
    full, _ = saved_bytes(f, _megatron("full"))
    root = per - sum(x.saved for x in trace.units)
    assert full == pytest.approx(root + sum(x.input for x in trace.units))  # full: every block keeps its input
    every_other, _ = saved_bytes(f, replace(_megatron("full"), checkpoint_interval=2))
    assert full < every_other < per
    # at the peak: the larger of backward's gradients and one block's saved tensors while recomputed
    peak, _ = activation_bytes(f, _megatron("full"))
    again = max(x.saved - x.input for x in trace.units)
    assert peak == pytest.approx(full + max(trace.transient_bytes, again))
    assert activation_bytes(f, _megatron("none"))[0] == pytest.approx(per + trace.transient_bytes)


def test_checkpointing_a_unit_whose_input_is_saved_anyway_changes_nothing() -> None:
    f = model_facts("mlp")  # its units are single Linears whose inputs the parameterless ReLUs already save
    plain = activation_bytes(f, Plan(batch_size=8))
    assert activation_bytes(f, Plan(batch_size=8, activation_checkpointing="full")) == plain
