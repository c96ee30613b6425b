"""Size-dependent efficiency tables: interpolation, per-layer facts, backward compatibility."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from hpoflow.oracle import Plan, load_cluster, model_facts
from hpoflow.oracle._compute import ACTIVATION_TRAFFIC, matrix_precision
from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.model import step_cost

TABLE = {"conv": [(1e5, 0.01), (1e7, 0.1), (1e9, 0.5)], "linear": [(1e4, 0.02), (1e8, 0.8)]}


def _cluster(table: object = None, **device: object):  # type: ignore[no-untyped-def]
    data = {**PRESETS["p100-cluster"]}
    dev = {**data["device"], **device} if isinstance(data["device"], dict) else \
        load_cluster(data).device.model_dump() | device
    if table is not None:
        dev["efficiency_table"] = table
    return load_cluster({**data, "device": dev})


def test_log_space_interpolation_and_clamping() -> None:
    dev = _cluster(TABLE).device
    assert dev.layer_efficiency("conv", 1e5) == pytest.approx(0.01)
    assert dev.layer_efficiency("conv", 1e6) == pytest.approx(math.sqrt(0.01 * 0.1))  # log-log midpoint
    assert dev.layer_efficiency("conv", 1e8) == pytest.approx(math.sqrt(0.1 * 0.5))
    assert dev.layer_efficiency("conv", 10.0) == pytest.approx(0.01)  # clamped below
    assert dev.layer_efficiency("conv", 1e12) == pytest.approx(0.5)  # clamped above
    assert dev.layer_efficiency("linear", 1e6) == pytest.approx(math.sqrt(0.02 * 0.8))
    assert dev.layer_efficiency("conv", 1e6, "fp16") is None  # tables are fp32 only
    assert _cluster().device.layer_efficiency("conv", 1e6) is None


def test_bad_tables_are_rejected() -> None:
    tables: list[dict[str, list[tuple[float, float]]]] = [
        {"conv": [(1e7, 0.1), (1e5, 0.01)]}, {"conv": [(1e5, 1.5)]}, {"gemm": [(1.0, 0.5)]}, {"conv": []}]
    for bad in tables:
        with pytest.raises(OracleError, match="efficiency_table"):
            _cluster(bad)


def test_facts_record_per_layer_flops() -> None:
    f = model_facts("cnn")
    assert [k for k, *_ in f.layers] == ["conv", "conv", "linear", "linear"]
    assert sum(fl * n for _, fl, n, _ in f.layers) == pytest.approx(f.forward_flops)
    conv = sum(fl * n for k, fl, n, _ in f.layers if k == "conv")
    assert conv / f.forward_flops == pytest.approx(f.conv_flops_fraction)
    assert f.to_dict()["layers"][0][0] == "conv"
    # training FLOPs as autograd runs them: the first conv computes no gradient of the input (the
    # data), so it trains at 2 x its forward; every later layer at 3 x
    train = [t / fl for _, fl, _, t in f.layers]
    assert train == pytest.approx([2.0, 3.0, 3.0, 3.0])
    assert f.train_flops == pytest.approx(sum(t * n for *_, n, t in f.layers))


def test_a_first_layer_trains_without_an_input_gradient_on_the_real_autograd() -> None:
    # what the traced 2 x stands for, on real tensors: convolution_backward of the first layer is
    # asked for no input gradient (output_mask[0] false), a later layer's is
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    conv = torch.nn.Conv2d(1, 4, 3)
    for needs_grad, factor in ((False, 2.0), (True, 3.0)):
        x = torch.randn(2, 1, 6, 6, requires_grad=needs_grad)
        with FlopCounterMode(display=False) as fwd:
            y = conv(x)
        with FlopCounterMode(display=False) as bwd:
            y.sum().backward()
        assert (fwd.get_total_flops() + bwd.get_total_flops()) / fwd.get_total_flops() == pytest.approx(factor)


def test_layer_pricing_matches_hand_computation() -> None:
    f = model_facts("cnn")
    c = _cluster(TABLE, efficiency={"fp32": 0.3}, conv_efficiency={"fp32": 0.4})
    b = 32
    cost = step_cost(f, c, Plan(batch_size=b, devices=1).validate(c), 1, b)
    peak = c.device.peak_flops["fp32"]
    want = sum(t * n * b / (peak * c.device.layer_efficiency(k, t * b))
               for k, _, n, t in f.layers)
    assert cost.flops_s == pytest.approx(want)
    # a conv table's efficiencies include the per-call fixed cost: per_conv_s is not added again
    with_conv = load_cluster({**c.model_dump(), "overheads": {"per_conv_s": 1.0}})
    assert step_cost(f, with_conv, Plan(batch_size=b, devices=1).validate(c), 1, b).overhead_s < 1.0
    lin_only = c.model_dump()
    lin_only["device"]["efficiency_table"] = {"linear": TABLE["linear"]}
    lin_only["overheads"] = {"per_conv_s": 1.0}
    assert step_cost(f, load_cluster(lin_only), Plan(batch_size=b, devices=1).validate(c), 1, b).overhead_s >= 2.0


def test_smaller_layers_run_further_below_peak() -> None:
    c = _cluster(TABLE)
    f = model_facts("cnn")
    t8, t64 = (step_cost(f, c, Plan(batch_size=b, devices=1).validate(c), 1, b).flops_s / b for b in (8, 64))
    assert t8 > t64  # per sample, small batches (less work per call) are slower


def test_without_tables_every_traced_kernel_is_priced_by_the_roofline(tmp_path: Path) -> None:
    f = model_facts("cnn")
    assert f.trace is not None
    for name in PRESETS:
        c = load_cluster(name)
        assert not c.device.calibrated
        dev, b = c.device, 32
        cost = step_cost(f, c, Plan(batch_size=b, devices=1).validate(c), 1, b)
        mem_rate = dev.memory_bandwidth * dev.memory_efficiency
        want = 0.0
        for k in f.trace.kernels:
            t_mem = (k.bytes * b + k.fixed_bytes) / mem_rate
            at = matrix_precision(k.half, "fp32", k.kind, dev)
            t_flop = k.flops * b / dev.matrix_rate(at) if k.kind != "mem" else 0.0
            # a tensor-core (TF32) convolution in the default NCHW layout transposes in and out
            transposes = 2 * k.bytes * b / mem_rate if k.kind == "conv" and at == "tf32" else 0.0
            want += max(t_flop, t_mem) + transposes + dev.kernel_s
        assert cost.flops_s + cost.memory_traffic_s == pytest.approx(want, rel=1e-9)
        assert cost.forward_s + cost.backward_s == pytest.approx(want, rel=1e-9)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(dict(PRESETS["p100-cluster"])))
    assert load_cluster(path).device.efficiency_table is None


def test_a_calibrated_device_keeps_the_validated_cpu_formula() -> None:
    f, c = model_facts("cnn"), _cluster(TABLE)
    assert c.device.calibrated
    cost = step_cost(f, c, Plan(batch_size=32, devices=1).validate(c), 1, 32)
    # FLOPs from the table, memory traffic from the leaf outputs moved ACTIVATION_TRAFFIC times
    traffic = ACTIVATION_TRAFFIC * f.leaf_output_bytes * 32 / c.device.memory_bandwidth
    assert cost.memory_traffic_s == pytest.approx(traffic)
    assert cost.backward_s == pytest.approx(2 / 3 * (cost.flops_s + cost.memory_traffic_s))


def test_table_round_trips_through_yaml(tmp_path: Path) -> None:
    from hpoflow.oracle.calibration import write_cluster

    c = _cluster(TABLE)
    back = load_cluster(write_cluster(c, tmp_path / "t.yaml"))
    assert back.device.layer_efficiency("conv", 1e6) == pytest.approx(c.device.layer_efficiency("conv", 1e6))


def test_calibration_probes_count_the_flops_their_steps_run() -> None:
    # the probes' first layers compute no input gradient: a step of Linear-ReLU-Linear runs 5/6
    # of the naive 3 x forward (2 x for the first layer, 3 x for the second), and the measured
    # efficiency divides by what ran, not by the naive count
    import torch
    from torch import nn

    from hpoflow.oracle.calibration import step_flops

    lin = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    x, y = torch.randn(4, 32), torch.randint(0, 8, (4,))
    fwd = 2 * 4 * (32 * 16 + 16 * 8)
    assert step_flops(lin, x, y) == pytest.approx(2 * 2 * 4 * 32 * 16 + 3 * 2 * 4 * 16 * 8)
    assert step_flops(lin, x, y) < 3 * fwd
    assert all(p.grad is None for p in lin.parameters())  # the count leaves no gradients behind
