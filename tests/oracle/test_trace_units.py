"""The traced step of transformers: fused attention, units (what FSDP and checkpointing wrap),
per-token logits, parameters computing in 16 bits, and models registered for training."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

from hpoflow.oracle import model_facts
from hpoflow.oracle._trace import sharding_units
from hpoflow.oracle._zoo import ZOO

SMALL = {"layers": 2, "hidden": 128, "heads": 4, "kv_heads": 4, "ffn": 512}


@pytest.mark.parametrize(("name", "params"), [
    ("megatron-gpt-1.2b", 1_213_479_936), ("tinyllama-1.1b", 1_100_048_384), ("llama3-8b", 8_030_261_248),
    ("resnet101", 44_549_160), ("inception-v3", 23_834_568)])
def test_published_shapes_have_their_parameter_counts(name: str, params: int) -> None:
    f = model_facts(name)
    assert f.params == params


def test_attention_is_fused_so_activations_grow_linearly_with_the_sequence() -> None:
    short = model_facts("megatron-gpt-1.2b", (256,), 56, options=SMALL)
    long = model_facts("megatron-gpt-1.2b", (1024,), 56, options=SMALL)
    assert short.tokens_per_sample == 256 and long.tokens_per_sample == 1024
    # the math path would save a (heads x sequence x sequence) score matrix per layer: 16x for 4x the tokens
    assert long.activation_bytes / short.activation_bytes == pytest.approx(4.0, rel=0.05)
    kinds = {k.kind for k in long.trace.kernels} if long.trace else set()
    assert "mm" in kinds


def test_causal_attention_counts_half_its_flops() -> None:
    f = model_facts("megatron-gpt-1.2b", (1024,), 56, options=SMALL)
    assert f.trace is not None
    # the fused kernel runs in the attention module itself (the projections are its child Linears)
    attention = sum(k.flops for k in f.trace.kernels if k.kind == "mm" and not k.backward
                    and f.trace.layers[k.layer].endswith(".attn"))
    full = 4 * 1024 * 1024 * 128  # 4 s^2 (heads x head_dim) per sequence, forward, one layer
    assert attention == pytest.approx(2 * full / 2, rel=0.01)  # two layers, each half the full count


def test_units_are_the_repeated_blocks() -> None:
    with torch.device("meta"):
        gpt = ZOO["megatron-gpt-1.2b"].builder((64,), 56, **SMALL)
        resnet = ZOO["resnet50"].builder((3, 224, 224), 1000)
    assert sharding_units(gpt) == ["layers.0", "layers.1"]
    units = sharding_units(resnet)
    # stem conv, bn + 16 bottlenecks (the relu and pool between them hold no parameters)
    assert units[0] == "features.0" and len(units) == 2 + 16
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    assert sharding_units(flat) == ["0", "2"]


def test_parameters_in_16_bits_have_no_autocast_copies() -> None:
    autocast = model_facts("megatron-gpt-1.2b", (64,), 56, precision="bf16", options=SMALL)
    pure = model_facts("megatron-gpt-1.2b", (64,), 56, options=SMALL, param_dtype="bf16")
    assert autocast.trace is not None and pure.trace is not None
    assert autocast.trace.saved_weight_copy_bytes > 0 and pure.trace.saved_weight_copy_bytes == 0
    assert all(k.half for k in pure.trace.kernels if k.kind == "mm" and k.flops > 0)
    assert pure.activation_bytes < autocast.activation_bytes  # the residual stream is 16-bit too


def test_a_model_registered_for_training_is_measured_through_the_registry(forget_plugin_kit: None) -> None:
    import tests.plugin_kit  # noqa: F401  registers kit_tiny

    f = model_facts("kit_tiny", (1, 8, 8), 10, options={"hidden": 16})
    assert f.params == 64 * 16 + 16 + 16 * 10 + 10


def test_the_trace_does_not_depend_on_which_address_a_storage_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Storages are told apart by their address while they are alive. With an allocator that gives a freed
    storage's address to the very next one, the facts are the same as with this process's own: every
    storage a trace knows by its address is kept alive until the trace ends (a unit's input once was
    not, and the Llama 3 8B memory row of docs/oracle.md moved with the heap's history)."""
    import dataclasses

    from hpoflow.oracle import _modes, _trace
    from hpoflow.oracle import facts as facts_module

    def facts() -> object:
        facts_module._facts_cached.cache_clear()
        return model_facts("llama3-8b", (512,), options={"layers": 4}, precision="bf16", param_dtype="bf16")

    normal = facts()
    keys: dict[int, tuple[StorageWeakRef, int]] = {}  # address -> (weak reference, the key it goes by)
    free: list[int] = []

    def recycling_key(t: torch.Tensor) -> int | None:
        """A key per live storage, a freed storage's key handed to the next new storage at once."""
        for address, (ref, key) in list(keys.items()):
            if ref.expired():
                del keys[address]
                free.append(key)
        storage = t.untyped_storage()
        address = int(storage._cdata)
        if address not in keys:
            keys[address] = (StorageWeakRef(storage), free.pop() if free else len(keys) + len(free) + 1)
        return keys[address][1]

    monkeypatch.setattr(_trace, "storage_key", recycling_key)
    monkeypatch.setattr(_modes, "storage_key", recycling_key)
    recycled = facts()
    assert free or len(keys) > 1  # the recycling allocator was used
    assert dataclasses.asdict(recycled) == dataclasses.asdict(normal)  # type: ignore[call-overload]
