"""Congestion: network levels with oversubscription divide the inter-node bandwidth of a job that
spans more than one switch of a level; defaults of a cluster YAML without overheads."""

from __future__ import annotations

import pytest

from hpoflow.oracle import OracleError, Plan, _comm, load_cluster, model_facts, predict
from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.cluster import DEFAULT_OVERHEADS

LEVELS = [{"nodes": 4, "oversubscription": 2.0}, {"nodes": 8, "oversubscription": 1.5}]


def test_a_job_inside_one_switch_keeps_the_full_bandwidth() -> None:
    c = load_cluster({**PRESETS["p100-cluster"], "network_levels": LEVELS})
    assert [c.congestion(n) for n in (1, 4, 5, 8, 9, 16)] == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    inside, across = _comm.network(c, 16), _comm.network(c, 64)  # 4 and 16 nodes of 4 GPUs
    assert inside.node_bw == c.inter_node.bandwidth and inside.congestion == 1.0
    assert across.node_bw == pytest.approx(c.inter_node.bandwidth / 3.0) and across.congestion == 3.0


def test_congestion_slows_communication_and_lowers_efficiency() -> None:
    f = model_facts("vgg16")
    plan = Plan(batch_size=32, devices=64, algorithm="ring")
    free = predict(f, load_cluster(PRESETS["p100-cluster"]), plan)
    shared = predict(f, load_cluster({**PRESETS["p100-cluster"], "network_levels": LEVELS}), plan)
    assert shared.cost.comm_s > free.cost.comm_s and shared.scaling_efficiency < free.scaling_efficiency
    assert shared.cost.congestion == 3.0 and shared.cost.network_bytes_per_node == free.cost.network_bytes_per_node


def test_network_levels_are_validated_with_the_key_and_fix() -> None:
    with pytest.raises(OracleError, match=r"network_levels.*bottom up.*sort them"):
        load_cluster({**PRESETS["p100-cluster"], "network_levels": list(reversed(LEVELS))})
    with pytest.raises(OracleError, match=r"network_levels\.0\.oversubscription"):
        load_cluster({**PRESETS["p100-cluster"], "network_levels": [{"nodes": 4, "oversubscription": 0.5}]})


def test_a_cluster_without_overheads_gets_the_documented_defaults() -> None:
    bare = load_cluster({"name": "bare", "nodes": 2, "devices_per_node": 8, "device": "a100",
                         "intra_node": "nvlink3", "inter_node": "ib-hdr"})
    assert bare.overheads.collective_s == DEFAULT_OVERHEADS["collective_s"] == 8.4e-6
    assert bare.overheads.step_jitter == DEFAULT_OVERHEADS["step_jitter"] == 0.022
    assert load_cluster("a100-cluster").overheads == bare.overheads  # the GPU presets' values
    laptop = load_cluster("laptop")  # a CPU preset says its own (gloo on one machine)
    assert laptop.overheads.step_jitter == 0 and laptop.backend == "gloo"
