"""Activation memory is what autograd saves: the oracle's meta-device count against real CPU runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hpoflow.oracle import OracleError, Plan, load_cluster, model_facts, predict
from hpoflow.oracle.catalog import PRESETS
from hpoflow.oracle.facts import resolve_model
from hpoflow.oracle.model import memory_breakdown


def measured_saved_bytes(name: str, batch: int) -> int:
    """Bytes of the storages autograd saves in one real forward pass on CPU (fp32), each storage
    counted once by its address, parameters and buffers excluded."""
    build, shape, _, tokens = resolve_model(name, None, None, {})
    torch.manual_seed(0)
    model: nn.Module = build().train()
    x = torch.randint(0, 1000, (batch, *shape)) if tokens else torch.randn(batch, *shape)
    state = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in state:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    assert out.requires_grad  # the graph (and its saved tensors) was really built
    return sum(saved.values())


@pytest.mark.parametrize("name", ["resnet18", "resnet50", "vgg16", "bert-base"])
def test_predicted_activations_match_autograds_saved_tensors(name: str) -> None:
    torch.set_num_threads(1)
    batch = 2
    f = model_facts(name)
    predicted = f.activation_bytes * batch + f.activation_fixed_bytes
    measured = measured_saved_bytes(name, batch)
    assert predicted == pytest.approx(measured, rel=0.10)
    # the old leaf-output count was not this figure (ResNet-50: 144.8 MB per sample against 85.9)
    assert f.leaf_output_bytes != f.activation_bytes


def test_views_and_in_place_results_count_once() -> None:
    f = model_facts("resnet50")
    # conv -> BN -> ReLU keeps the conv output (BN's input) and the ReLU output (the next conv's
    # input): counting every leaf output would add the BN outputs and the Identity/view outputs too
    assert f.activation_bytes < 0.7 * f.leaf_output_bytes
    half = model_facts("resnet50", precision="fp16")
    assert half.activation_bytes == pytest.approx(f.activation_bytes / 2, rel=0.05)
    # autocast keeps a 16-bit copy of every convolution/linear weight for backward
    assert half.activation_fixed_bytes == pytest.approx(2 * f.params, rel=0.01)


def test_gib_and_nvidias_16gb_v100_recipes_fit() -> None:
    c = load_cluster({**PRESETS["v100-cluster"], "nodes": 1, "devices_per_node": 8})
    assert c.device.memory_bytes == 16 * 2**30
    for precision, batch in (("fp32", 112), ("fp16", 256)):  # DeepLearningExamples' DGX1V recipes
        p = predict(model_facts("resnet50", precision=precision), c,
                    Plan(batch_size=batch, devices=8, precision=precision, momentum=0.875))
        assert p.fits and p.max_batch_per_device >= batch


def test_largest_batch_that_fits_is_the_boundary() -> None:
    f, c = model_facts("resnet50"), load_cluster("v100-cluster")
    top = predict(f, c, Plan(batch_size=32, devices=4)).max_batch_per_device
    assert predict(f, c, Plan(batch_size=top, devices=4)).fits
    over = predict(f, c, Plan(batch_size=top + 1, devices=4))
    assert not over.fits and over.bottleneck == "memory" and over.max_batch_per_device == top


def test_memory_breakdown_adds_up_and_ddp_buckets_only_with_peers() -> None:
    f, c = model_facts("resnet18"), load_cluster("a100-cluster")
    plan = Plan(batch_size=64, devices=8, optimizer="adam").validate(c)
    parts = memory_breakdown(f, c, plan, 64, 8)
    assert parts["step"] == pytest.approx(sum(v for k, v in parts.items() if k not in ("total", "step", "startup")))
    assert parts["total"] == max(parts["step"], parts["startup"]) == parts["step"]  # the step's peak is higher
    assert parts["ddp_buckets"] == parts["gradients"] == 4 * f.params
    assert parts["optimizer_state"] == 8 * f.params
    assert parts["allocator"] == pytest.approx(parts["activations"] * c.device.memory_overhead)
    assert memory_breakdown(f, c, plan, 64, 1)["ddp_buckets"] == 0


def test_facts_and_plan_precision_must_agree() -> None:
    with pytest.raises(OracleError, match="precision"):
        predict(model_facts("cnn"), load_cluster("laptop"), Plan(batch_size=8, precision="bf16"))
