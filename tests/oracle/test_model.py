"""Communication formulas and monotonic behaviour of the predictions."""

from __future__ import annotations

import pytest

from hpoflow.oracle import OracleError, Plan, load_cluster, model_facts, predict
from hpoflow.oracle._comm import ring_allreduce, tree_allreduce
from hpoflow.oracle.catalog import PRESETS
from hpoflow.train.collectives import ring_allreduce_bytes


def _cluster(**changes: object):  # type: ignore[no-untyped-def]
    data = {**PRESETS["p100-cluster"], **changes}
    return load_cluster(data)


def test_ring_allreduce_volume_and_time() -> None:
    assert ring_allreduce_bytes(100.0, 1) == 0
    assert ring_allreduce_bytes(100.0, 4) == pytest.approx(150.0)  # 2(p-1)/p M
    bw, lat = ring_allreduce(4, 100.0, 10.0, 0.5)
    assert bw == pytest.approx(15.0) and lat == pytest.approx(3.0)  # 2(p-1) alpha
    assert tree_allreduce(8, 100.0, 10.0, 0.5) == pytest.approx((20.0, 3.0))


def test_plan_errors_name_the_field_and_the_value_given() -> None:
    c = _cluster()
    for field, value, rule in (("devices", 0, "between 1 and the 64"), ("batch_size", 0, ">= 1"),
                               ("epochs", 0.0, "> 0"), ("dataset_size", 0, ">= 1"), ("algorithm", "star", "auto")):
        with pytest.raises(OracleError, match=rf"{field} must be .*{rule}.*but got {value!r}; change {field}"):
            Plan(**{"batch_size": 32, field: value}).validate(c)  # type: ignore[arg-type]
    assert Plan(batch_size=32).validate(c).devices == 64  # None: every device of the cluster


def test_more_bandwidth_means_less_comm_time() -> None:
    f = model_facts("resnet50")
    plan = Plan(batch_size=32, devices=64)
    slow = predict(f, _cluster(inter_node="10gbe"), plan)
    fast = predict(f, _cluster(inter_node="ib-hdr"), plan)
    assert fast.cost.comm_bandwidth_s < slow.cost.comm_bandwidth_s
    assert fast.cost.step_s <= slow.cost.step_s


def test_more_devices_more_throughput_less_efficiency() -> None:
    f = model_facts("resnet50")
    c = _cluster(inter_node="10gbe", overlap=0.0)
    small, big = (predict(f, c, Plan(batch_size=32, devices=d)) for d in (4, 64))
    assert big.throughput > small.throughput
    assert big.scaling_efficiency < small.scaling_efficiency <= 1.0


def test_bottleneck_detection() -> None:
    f = model_facts("vgg16")
    assert predict(f, _cluster(), Plan(batch_size=32, devices=1)).bottleneck == "compute"
    slow_net = _cluster(inter_node="10gbe", overlap=0.0)
    assert predict(f, slow_net, Plan(batch_size=8, devices=64)).bottleneck == "communication"
    assert predict(f, _cluster(), Plan(batch_size=4096, devices=4)).bottleneck == "memory"
    tiny = model_facts("mlp")
    high_lat = _cluster(inter_node={"name": "slow", "bandwidth": 1e12, "latency": 1e-3},
                        overlap=0.0)
    assert predict(tiny, high_lat, Plan(batch_size=32, devices=64)).bottleneck == "latency"


def test_max_speedup_point_exists_and_fits_batch() -> None:
    f = model_facts("resnet50")
    p = predict(f, _cluster(), Plan(batch_size=32, devices=64))
    assert 1 < p.max_speedup_devices <= p.global_batch
    assert p.max_speedup > 1 and p.useful_devices <= p.max_speedup_devices
    assert p.max_batch_per_device > 32 and p.fits
    # a flat ring's latency grows as 2(p-1): strong scaling stops well before one sample per device
    ring = predict(f, _cluster(), Plan(batch_size=32, devices=64, strategy="ring"))
    assert 1 < ring.max_speedup_devices < ring.global_batch and ring.max_speedup < p.max_speedup


@pytest.mark.parametrize("strategy", ["allreduce", "ring", "tree", "ps", "easgd", "pipeline"])
def test_every_strategy_predicts(strategy: str) -> None:
    p = predict(model_facts("resnet18"), _cluster(),
                Plan(batch_size=32, devices=16, strategy=strategy, stages=4))
    d = p.to_dict()
    assert d["step_s"] > 0 and d["time_to_train_s"] > d["epoch_s"] > 0
    assert d["bottleneck"] in ("compute", "communication", "latency", "memory")
    assert d["forward_s"] > 0 and d["backward_s"] > d["forward_s"]


def test_easgd_period_and_ps_servers_reduce_comm() -> None:
    f, c = model_facts("resnet50"), _cluster()
    comm = {s: predict(f, c, Plan(batch_size=32, devices=32, strategy="ps", servers=s)).cost.comm_s
            for s in (1, 8)}
    assert comm[8] < comm[1]
    e = {t: predict(f, c, Plan(batch_size=32, devices=32, strategy="easgd", period=t)).cost.comm_s
         for t in (1, 8)}
    assert e[8] < e[1]
