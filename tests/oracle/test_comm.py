"""Collectives priced per network level, and the fastest one chosen as NCCL would."""

from __future__ import annotations

import math

import pytest

from hpoflow.oracle import load_cluster
from hpoflow.oracle._comm import allreduce, allreduce_costs, best_allreduce, explain, network, parameter_server
from hpoflow.oracle.catalog import PRESETS

M = 100e6  # bytes per device


def _net(p: int, nodes: int = 16, per_node: int = 8, rails: int = 1, torus: list[int] | None = None):  # type: ignore[no-untyped-def]
    c = load_cluster({"name": "t", "nodes": nodes, "devices_per_node": per_node, "device": "a100", "rails": rails,
                      "torus": torus, "intra_node": {"name": "i", "bandwidth": 100e9, "latency": 2e-6},
                      "inter_node": {"name": "n", "bandwidth": 10e9, "latency": 10e-6}})
    return network(c, p)


def test_each_algorithm_prices_each_level_with_its_own_link() -> None:
    net = _net(128)  # 16 nodes of 8
    assert (net.nodes, net.per_node, net.node_bw) == (16, 8, 10e9)
    c = allreduce_costs(net, M)
    # NCCL's count: 2(n-1) steps at the network's latency, the others at the node's
    assert c["ring"] == pytest.approx((2 * 127 / 128 * M / 10e9, (254 - 30) * 2e-6 + 30 * 10e-6))
    assert c["tree"] == pytest.approx((2 * M / (0.9 * 10e9), 2 * (7 * 2e-6 + 4 * 10e-6)))
    intra = (2 * 7 / 8 * M / 100e9, 14 * 2e-6)
    assert c["hier-ring"] == pytest.approx((intra[0] + 2 * 15 / 16 * M / 10e9, intra[1] + 30 * 10e-6))
    assert c["hier-hd"] == pytest.approx((intra[0] + 2 * 15 / 16 * M / 10e9, intra[1] + 2 * 4 * 10e-6))
    assert "torus" not in c


def test_rails_torus_and_odd_node_counts() -> None:
    assert _net(128, rails=4).node_bw == 40e9
    odd = allreduce_costs(_net(96), M)  # 12 nodes: halving/doubling on 8, the other 4 fold in and out
    assert odd["hier-hd"][1] == pytest.approx(14 * 2e-6 + (2 * 3 + 2) * 10e-6)
    assert odd["hier-hd"][0] == pytest.approx(2 * 7 / 8 * M / 100e9 + 2 * 7 / 8 * M / 10e9 + 2 * M / 10e9)
    torus = allreduce_costs(_net(128, torus=[4, 4]), M)["torus"]
    assert torus == pytest.approx((2 * 7 / 8 * M / 100e9 + (2 * 3 / 4 + 2 * 3 / 16) * M / 10e9,
                                   14 * 2e-6 + 12 * 10e-6))
    assert "torus" not in allreduce_costs(_net(64, torus=[4, 4]), M)  # 8 nodes used: not the torus


def test_one_node_is_a_ring_and_large_scale_is_not() -> None:
    assert best_allreduce(_net(8), M)[0] == "ring"
    assert set(allreduce_costs(_net(8), M)) == {"ring"}
    assert allreduce(_net(8), M, "tree")[0] == "ring"  # the tree needs nodes: falls back
    big = _net(4096, nodes=512)
    name, (bw, lat) = best_allreduce(big, 1e6)
    ring_bw, ring_lat = allreduce_costs(big, 1e6)["ring"]
    assert name != "ring" and bw + lat < ring_bw + ring_lat
    assert ring_lat > 8190 * 2e-6  # 2(p-1) hops: the flat ring is latency-bound at scale
    assert "8190" in explain(big, name) and "across nodes" in explain(big, name)
    assert "one node" in explain(_net(8), "ring")


def test_parameter_server_shares_the_nodes_adapters() -> None:
    one = _net(8)
    assert parameter_server(one, 1, M) == pytest.approx((2 * max(8 * M / 100e9, M / 100e9), 2 * 2e-6))
    many = _net(64)
    assert parameter_server(many, 4, M) == pytest.approx((2 * max(64 * M / 4 / 10e9, M / (10e9 / 8)), 2 * 10e-6))


def test_presets_carry_their_rails() -> None:
    assert load_cluster(PRESETS["h100-cluster"]).rails == 8 and load_cluster(PRESETS["p100-cluster"]).rails == 1
    assert math.isclose(network(load_cluster("h100-cluster"), 128).node_bw, 8 * 50e9)
