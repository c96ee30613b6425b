"""Model facts vs independently known values (parameter counts and MACs from the literature)."""

from __future__ import annotations

import pytest

from hpoflow.oracle import OracleError, model_facts, optimizer_state_bytes


@pytest.mark.parametrize(
    ("name", "params", "gmacs"),
    [("resnet18", 11_689_512, 1.82), ("resnet50", 25_557_032, 4.09),
     ("vgg16", 138_357_544, 15.47)],
)
def test_vision_models_match_published_counts(name: str, params: int, gmacs: float) -> None:
    f = model_facts(name)
    assert f.params == params
    # convention: forward_macs is the customary "GFLOPs"; forward_flops counts a MAC as 2
    assert f.forward_macs / 1e9 == pytest.approx(gmacs, rel=0.02)
    assert f.forward_flops == pytest.approx(2 * f.forward_macs)
    # forward + backward as autograd runs it: 3 x forward less the first conv's input gradient
    conv1 = f.layers[0][1]
    assert f.train_flops == pytest.approx(3 * f.forward_flops - conv1, rel=1e-3)


def test_bert_base_is_about_110m_params() -> None:
    f = model_facts("bert-base")
    assert 108e6 < f.params < 111e6
    assert f.input_shape == (128,)
    # ~2 x 85M weight MACs x 128 tokens + attention: ~11 GMACs per sequence
    assert 10e9 < f.forward_macs < 12.5e9


def test_project_models_and_memory_facts() -> None:
    f = model_facts("cnn")
    assert f.input_shape == (1, 8, 8) and f.n_classes == 10
    assert f.grad_bytes == 4 * f.params
    assert f.activation_bytes > 0 and f.ops_per_step > 10 and f.conv_layers == 2
    half = model_facts("cnn", precision="bf16")
    assert half.activation_bytes < f.activation_bytes
    assert half.leaf_output_bytes == pytest.approx(f.leaf_output_bytes / 2, rel=0.01)


def test_the_traced_step_has_forward_and_backward_kernels_and_every_gradient() -> None:
    f = model_facts("resnet50")
    t = f.trace
    assert t is not None
    fwd = sum(k.flops for k in t.kernels if not k.backward)
    bwd = sum(k.flops for k in t.kernels if k.backward)
    assert fwd == pytest.approx(f.forward_flops, rel=0.01)
    # backward computes input and weight gradients (2x forward), except the first layer's input's
    assert 1.9 < bwd / fwd < 2.0
    assert sorted(i for i, _, _ in t.grad_ready) == list(range(f.param_tensors))
    assert sum(n for _, n, _ in t.grad_ready) == f.params
    ready_at = [k for _, _, k in t.grad_ready]
    assert ready_at == sorted(ready_at) and min(ready_at) >= t.forward_kernels  # in backward, in order
    # the classifier's gradients are ready first, the stem convolution's last
    assert t.grad_ready[0][0] in (f.param_tensors - 1, f.param_tensors - 2) and t.grad_ready[-1][0] == 0
    assert {k.kind for k in t.kernels} == {"conv", "mm", "mem"}
    half = model_facts("resnet50", precision="fp16").trace
    assert half is not None and all(k.half for k in half.kernels if k.kind == "conv")
    assert "kernels_per_step" in f.to_dict() and "trace" not in f.to_dict()


def test_optimizer_state_sizes() -> None:
    assert optimizer_state_bytes(10, "sgd", 0.0) == 0
    assert optimizer_state_bytes(10, "sgd", 0.9) == 40
    assert optimizer_state_bytes(10, "adam") == 80
    with pytest.raises(OracleError, match="lbfgs"):
        optimizer_state_bytes(10, "lbfgs")


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(OracleError, match="resnet50"):
        model_facts("resnet51")


def test_user_model_needs_and_uses_input_shape() -> None:
    with pytest.raises(OracleError, match="input shape"):
        model_facts("hpoflow.oracle._zoo:resnet18")
    f = model_facts("hpoflow.oracle._zoo:resnet18", (3, 32, 32), 10)
    assert f.params == 11_689_512 - 1000 * 512 - 1000 + 10 * 512 + 10
