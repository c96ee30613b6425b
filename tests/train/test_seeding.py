"""A rank's seeds: torch's CPU generator as ``torch.manual_seed`` leaves it, without that call's per-device
lazy seeds (each with a stack trace) where the machine has no accelerator."""

from __future__ import annotations

import pytest
import torch

from hpoflow.train.runner import _seed_everything


def _draws(seed: int) -> torch.Tensor:
    hook, numpy_hook = _seed_everything(seed, 1)
    for h in (hook, numpy_hook):
        if h is not None:
            h.remove()
    return torch.rand(5)


def test_torchs_cpu_generator_is_seeded_as_manual_seed_seeds_it() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(5)
    torch.manual_seed(99)  # something else first: the setup must reseed
    assert torch.equal(_draws(1234), expected)


@pytest.mark.skipif(not hasattr(torch, "accelerator") or torch.accelerator.is_available(),
                    reason="the fast path is for a machine without CUDA, MPS, XPU or another accelerator")
def test_without_an_accelerator_no_lazy_device_seed_is_queued(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(seed: int) -> None:
        raise AssertionError("torch.manual_seed called: it queues a lazy seed per device kind, with a stack trace")

    monkeypatch.setattr(torch, "manual_seed", refuse)
    torch.default_generator.manual_seed(1)
    first = _draws(7)
    torch.default_generator.manual_seed(2)
    assert torch.equal(_draws(7), first)
