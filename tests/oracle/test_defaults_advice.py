"""What a prediction assumes (data set size and epochs per model family) and what it advises."""

from __future__ import annotations

import pytest

from hpoflow.oracle import Plan, load_cluster, model_facts, predict
from hpoflow.oracle.advice import advise
from hpoflow.oracle.catalog import DEVICES, PRESETS
from hpoflow.oracle.defaults import training_length


@pytest.mark.parametrize(("model", "size", "epochs", "words"), [
    ("resnet50", 1_281_167, 90.0, "ImageNet-1k"),
    ("inception-v3", 1_281_167, 90.0, "ImageNet-1k"),
    ("bert-base", 67_349, 3.0, "SST-2"),
    ("cnn", 1_437, 10.0, "digits"),
])
def test_each_family_has_its_own_training_length(model: str, size: int, epochs: float, words: str) -> None:
    assumed = training_length(model_facts(model))
    assert (assumed.dataset_size, assumed.epochs) == (size, epochs) and words in assumed.why


def test_language_models_train_20_tokens_per_parameter() -> None:
    f = model_facts("tinyllama-1.1b")
    assumed = training_length(f)
    assert assumed.epochs == 1 and assumed.dataset_size * f.tokens_per_sample == pytest.approx(20 * f.params, rel=1e-6)
    assert "20 tokens per parameter" in assumed.why


def test_advice_for_a_plan_that_does_not_fit_names_what_makes_it_fit() -> None:
    f = model_facts("megatron-gpt-1.2b", precision="fp16")
    plan = Plan(batch_size=8, devices=8, precision="fp16", optimizer="adam")
    # 16 GB V100s: replicated weights, gradients and Adam state alone do not fit; no one change is enough
    c = load_cluster({**PRESETS["v100-cluster"], "nodes": 2})
    pred = predict(f, c, plan)
    assert not pred.fits and pred.max_batch_per_device == 0
    advice = advise(f, c, plan, pred)
    changes = {a.change for a in advice}
    assert "--strategy fsdp --activation-checkpointing full" in changes
    assert any(a.startswith("--strategy fsdp --batch-size ") for a in changes)  # sharded, at a smaller batch
    assert advice and all(a.fits for a in advice)
    # 32 GB V100s: checkpointing alone fits batch 8 (Megatron's own recipe), or a smaller batch
    v100_32gb = {**DEVICES["v100"], "memory_bytes": 32 * 2**30}
    big = load_cluster({**PRESETS["v100-cluster"], "nodes": 2, "device": v100_32gb})
    pred = predict(f, big, plan)
    assert not pred.fits and 1 <= pred.max_batch_per_device < 8
    changes = {a.change for a in advise(f, big, plan, pred)}
    expected = {f"--batch-size {pred.max_batch_per_device}", "--activation-checkpointing full", "--strategy fsdp"}
    assert expected <= changes


def test_advice_for_a_plan_that_fits_comes_with_the_predicted_gain() -> None:
    f = model_facts("resnet50")
    c = load_cluster("v100-cluster")
    plan = Plan(batch_size=32, devices=64)
    advice = advise(f, c, plan, predict(f, c, plan), lambda precision, _: model_facts("resnet50", precision=precision))
    by_change = {a.change: a for a in advice}
    assert "--precision fp16" in by_change and by_change["--precision fp16"].gain > 0.5  # tensor cores
    assert all(a.gain >= 0.03 for a in advice) and advice == sorted(advice, key=lambda a: -a.gain)
    assert "step" in by_change["--precision fp16"].why and "ms ->" in by_change["--precision fp16"].why
    slow = load_cluster({**PRESETS["v100-cluster"], "inter_node": "10gbe"})
    bucket = [a for a in advise(f, slow, Plan(batch_size=32, devices=64, bucket_mb=0.0),
                                predict(f, slow, Plan(batch_size=32, devices=64, bucket_mb=0.0)))
              if a.change.startswith("--bucket-mb")]
    assert bucket and bucket[0].gain > 0.03  # one all-reduce per tensor pays 161 latencies
