"""Memory-bound layer costs, optimizer cost per parameter and the synchronous-step wait."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hpoflow.oracle import Plan, load_cluster, model_facts
from hpoflow.oracle._compute import OPTIMIZER_BYTES
from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.model import ACTIVATION_TRAFFIC, expected_max_normal, step_cost

LAYER_COST = {"relu": [(1e3, 2e-8), (1e5, 2e-9)], "maxpool2d": [(1e3, 4e-8), (1e6, 1e-8)]}


def _cluster(layer_cost: object = None, **overheads: object):  # type: ignore[no-untyped-def]
    data = load_cluster("p100-cluster").model_dump()
    if layer_cost is not None:
        data["device"]["layer_cost"] = layer_cost
    data["overheads"] = {**data["overheads"], **overheads}
    return load_cluster(data)


def _cost(cluster, facts, p: int = 1, b: int = 32, **plan: object):  # type: ignore[no-untyped-def]
    full = Plan(batch_size=b, devices=p, **plan).validate(cluster)  # type: ignore[arg-type]
    return step_cost(facts, cluster, full, p, b)


def test_facts_record_memory_bound_layers_with_their_elements() -> None:
    f = model_facts("cnn")  # 1x8x8 input: conv 16 ch, conv 32 ch, 2x2 max-pool, linear 128
    assert f.other_layers == (("relu", 1024, 1024, 1), ("relu", 2048, 2048, 1),
                              ("maxpool2d", 2048, 512, 1), ("flatten", 512, 512, 1),
                              ("relu", 128, 128, 1))
    assert f.to_dict()["other_layers"][2] == ["maxpool2d", 2048, 512, 1]
    kinds = {k for k, *_ in model_facts("resnet18").other_layers}
    assert {"batchnorm2d", "relu", "maxpool2d", "identity"} <= kinds


def test_a_module_called_twice_counts_two_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from torch import nn

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.act = nn.Linear(6, 6), nn.ReLU()

        def forward(self, x):  # type: ignore[no-untyped-def]
            return self.act(self.fc(self.act(x)))

    mod = types.ModuleType("hpoflow_test_twice")
    mod.build = Twice  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "hpoflow_test_twice", mod)
    f = model_facts("hpoflow_test_twice:build", input_shape=(6,))
    assert f.other_layers == (("relu", 6, 6, 2),)


def test_element_cost_interpolates_in_log_space_and_clamps() -> None:
    dev = _cluster(LAYER_COST).device
    assert dev.element_cost("relu", 1e3) == pytest.approx(2e-8)
    assert dev.element_cost("relu", 1e4) == pytest.approx(math.sqrt(2e-8 * 2e-9))
    assert dev.element_cost("relu", 10.0) == pytest.approx(2e-8)
    assert dev.element_cost("relu", 1e9) == pytest.approx(2e-9)
    assert dev.element_cost("gelu", 1e4) is None and dev.element_cost("relu", 1e4, "bf16") is None
    assert _cluster().device.element_cost("relu", 1e4) is None


def test_bad_layer_cost_tables_are_rejected() -> None:
    tables: list[dict[str, list[tuple[float, float]]]] = [
        {"relu": [(1e5, 1e-9), (1e3, 1e-8)]}, {"relu": [(1e3, 0.0)]}, {"relu": []}]
    for bad in tables:
        with pytest.raises(OracleError, match="layer_cost"):
            _cluster(bad)
    with pytest.raises(OracleError, match="optimizer_per_param_s"):
        _cluster(optimizer_per_param_s={"lamb": 1e-9})


def test_priced_layers_replace_their_activation_traffic() -> None:
    f, b = model_facts("cnn"), 32
    # a calibrated device (any table): without layer_cost rows every leaf output is traffic
    plain = load_cluster({**_cluster().model_dump(), "device": {
        **_cluster().device.model_dump(), "efficiency_table": {"conv": [(1e5, 0.1)]}}})
    priced = _cluster(LAYER_COST)
    w = plain.device.memory_bandwidth
    assert _cost(plain, f).memory_traffic_s == pytest.approx(ACTIVATION_TRAFFIC * f.leaf_output_bytes * b / w)
    dev = priced.device
    layer_s = sum(dev.element_cost(k, n_in * b) * n_in * calls * b
                  for k, n_in, _, calls in f.other_layers if k in LAYER_COST)
    # relu and maxpool outputs are priced, flatten is a view: all three leave the traffic term
    left = f.leaf_output_bytes - 4 * sum(n_out * calls for _, _, n_out, calls in f.other_layers)
    want = layer_s + ACTIVATION_TRAFFIC * left * b / w
    got = _cost(priced, f)
    assert got.memory_traffic_s == pytest.approx(want)
    # FLOP pricing untouched: no efficiency table, so the per-kind sustained rate
    assert got.flops_s == pytest.approx(f.train_flops * b / dev.flops("fp32", f.conv_flops_fraction))


def test_optimizer_cost_per_parameter() -> None:
    f = model_facts("mlp")
    rates = {"sgd": 1e-10, "momentum": 3e-10, "adam": 2e-9}
    base, c = _cluster(), _cluster(optimizer_per_param_s=rates)
    dev = base.device
    for optimizer, momentum, key in (("sgd", 0.0, "sgd"), ("sgd", 0.9, "momentum"), ("adamw", 0.0, "adam")):
        # measured seconds per parameter where calibrated ...
        assert _cost(c, f, optimizer=optimizer, momentum=momentum).optimizer_s == pytest.approx(rates[key] * f.params)
        # ... else the roofline: the fp32 state read and written once per step
        roofline = OPTIMIZER_BYTES[key] * f.params / (dev.memory_bandwidth * dev.memory_efficiency)
        assert _cost(base, f, optimizer=optimizer, momentum=momentum).optimizer_s == pytest.approx(roofline)


def test_expected_maximum_of_normals() -> None:
    assert expected_max_normal(1) == 0.0
    assert expected_max_normal(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert expected_max_normal(4) == pytest.approx(1.029375, rel=1e-5)  # tabulated order statistics
    assert expected_max_normal(8) == pytest.approx(1.423600, rel=1e-5)


def test_sync_wait_table_interpolates_and_clamps() -> None:
    ov = _cluster(sync_wait=[(1e-3, 0.0), (4e-3, 1e-3), (14e-3, 2e-3)]).overheads
    assert ov.sync_wait_at(5e-4) == 0.0 and ov.sync_wait_at(1e-3) == 0.0
    assert ov.sync_wait_at(2.5e-3) == pytest.approx(0.5e-3)
    assert ov.sync_wait_at(9e-3) == pytest.approx(1.5e-3)
    assert ov.sync_wait_at(1.0) == pytest.approx(2e-3)  # clamped above
    assert _cluster().overheads.sync_wait_at(1.0) == 0.0
    with pytest.raises(OracleError, match="sync_wait"):
        _cluster(sync_wait=[(4e-3, 0.0), (1e-3, 0.0)])


def test_sync_wait_scales_with_devices_and_easgd_period() -> None:
    f = model_facts("cnn")
    c = _cluster(sync_wait=[(0.0, 0.0), (1.0, 0.2)])  # 0.2 s of wait per s of compute
    one = _cost(c, f, p=1)
    assert one.sync_wait_s == 0.0 and one.step_s == pytest.approx(one.compute_s)
    two = _cost(c, f, p=2)
    assert two.sync_wait_s == pytest.approx(0.2 * two.compute_s)
    assert two.step_s == pytest.approx(two.compute_s + two.exposed_comm_s + two.sync_wait_s)
    four = _cost(c, f, p=4)
    assert four.sync_wait_s == pytest.approx(0.2 * four.compute_s * 1.029375 / (1 / math.sqrt(math.pi)),
                                             rel=1e-4)
    easgd = _cost(c, f, p=2, strategy="easgd", period=4)
    assert easgd.sync_wait_s == pytest.approx(two.sync_wait_s / 2)
    # without a table the GPU presets' step_jitter: E[max of p normals] x jitter x compute
    gpu = load_cluster(PRESETS["p100-cluster"])
    two_gpu = _cost(gpu, f, p=2)
    assert two_gpu.sync_wait_s == pytest.approx(gpu.overheads.step_jitter * two_gpu.compute_s / math.sqrt(math.pi))
    no_jitter = load_cluster({**PRESETS["p100-cluster"], "overheads": {"step_jitter": 0.0}})
    assert _cost(no_jitter, f, p=2).sync_wait_s == 0.0
    assert replace(two, sync_wait_s=0.0).to_dict()["sync_wait_s"] == 0.0
