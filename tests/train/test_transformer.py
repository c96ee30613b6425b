"""The built-in transformer (gpt on chars), the next-token task and training.precision, in-process."""

from __future__ import annotations

import hashlib
import math
import mmap
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from hpoflow.errors import SpecError
from hpoflow.spec import BUILTIN_METRICS, TrainConfig, load_spec
from hpoflow.spec._load import DATASET_TASKS
from hpoflow.train.builtin import evaluate, task_loss, train_builtin
from hpoflow.train.context import TrialContext
from hpoflow.train.data import CHARS_LENGTH, DATASETS, chars_corpus, dataset_info, load_dataset
from hpoflow.train.memory import PeakMemory
from hpoflow.train.models import build_model
from hpoflow.train.precision import Precision
from hpoflow.train.strategies import StrategyEnv, make_strategy

# the corpus is generated, not shipped: it must be the same text everywhere (Random(0)'s stable draws)
CHARS_SHA256 = "d185b8d68b968d0af9ec1dab122d43d5bf7d22a1179eee30cb94b4d6ad93378d"


def test_the_corpus_is_deterministic_and_has_the_declared_vocabulary() -> None:
    text = chars_corpus()
    assert len(text) == CHARS_LENGTH
    assert len(set(text)) == DATASETS["chars"].n_classes
    assert text.startswith('"Where is the book?" shouted Nils.')
    assert hashlib.sha256(text.encode()).hexdigest() == CHARS_SHA256


@pytest.mark.parametrize("t", [16, 64])
def test_chars_windows_are_next_character_pairs_and_dataset_info_agrees(t: int) -> None:
    d = load_dataset("chars", 0.2, sequence_length=t)
    assert d.task == "next_token" and d.input_shape == (t,) and d.n_classes == 56
    assert d.x_train.shape[1] == t and d.y_train.shape == d.x_train.shape
    assert torch.equal(d.x_train[0, 1:], d.y_train[0, :-1])  # targets: the window shifted by one
    assert torch.equal(d.y_train[0, -1:], d.x_train[1, :1])  # windows follow each other without overlap
    shape, classes, samples = dataset_info("chars", 0.2, sequence_length=t)
    assert (shape, classes, samples) == ((t,), 56, len(d.x_train))
    assert len(d.x_val) == (round(CHARS_LENGTH * 0.2) - 1) // t


def test_gpt_shapes_options_and_causality() -> None:
    model = build_model("gpt", (16,), 56, layers=2, heads=2, width=32, context=16)
    ids = torch.randint(0, 56, (3, 16))
    out = model(ids)
    assert out.shape == (3, 16, 56)
    changed = ids.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 56
    out2 = model(changed)
    torch.testing.assert_close(out[:, :10], out2[:, :10])  # positions before 10 never see it
    assert not torch.allclose(out[:, 10:], out2[:, 10:])
    with pytest.raises(ValueError, match="input_shape must be"):
        build_model("gpt", (1, 8, 8), 10)
    assert len(list(model.get_submodule("blocks").children())) == 2  # the units FSDP shards


def test_next_token_loss_and_evaluation_are_per_position() -> None:
    model = build_model("gpt", (8,), 56, layers=1, heads=1, width=8, context=8)
    x, y = torch.randint(0, 56, (5, 8)), torch.randint(0, 56, (5, 8))
    out = model(x)
    flat = torch.nn.functional.cross_entropy(out.reshape(-1, 56), y.reshape(-1))
    torch.testing.assert_close(task_loss(out, y), flat)
    loss, acc = evaluate(model, x, y, torch.device("cpu"), batch=16)  # 2 sequences of 8 at a time
    assert loss == pytest.approx(float(flat.detach()), rel=1e-5)
    assert acc == pytest.approx(float((out.argmax(-1) == y).float().mean()), abs=1e-6)


def test_spec_checks_model_dataset_and_metric_tasks(tmp_path: Path) -> None:
    assert "val_perplexity" in BUILTIN_METRICS
    assert DATASET_TASKS == {name: info.task for name, info in DATASETS.items()}  # the torch-free copy agrees

    def spec(metric: str, model: str, dataset: str) -> Path:
        p = tmp_path / "s.yaml"
        p.write_text(f"study: {{name: s, metric: {metric}, direction: minimize}}\n"
                     "space: {lr: {type: float, low: 0.001, high: 0.01}}\nsearch: {algorithm: random, n_trials: 1}\n"
                     f"training: {{model: {model}, dataset: {dataset}, lr: '${{lr}}'}}\n")
        return p

    load_spec(spec("val_perplexity", "gpt", "chars"))
    with pytest.raises(SpecError, match=re.escape("model 'gpt' learns a next_token task, but dataset 'digits' is "
                                                  "a classify task. Fix: use dataset chars with it")):
        load_spec(spec("val_loss", "gpt", "digits"))
    with pytest.raises(SpecError, match="model 'cnn' learns a classify task, but dataset 'chars'"):
        load_spec(spec("val_loss", "cnn", "chars"))
    with pytest.raises(SpecError, match="val_perplexity is the perplexity of a next-token"):
        load_spec(spec("val_perplexity", "cnn", "digits"))
    with pytest.raises(ValidationError, match="width must be a multiple of heads"):
        TrainConfig(model="gpt", dataset="chars", model_options={"width": 30, "heads": 4})


# -- precision -------------------------------------------------------------------------------------------

def _steps(precision: str, steps: int = 6) -> tuple[list[float], Precision, torch.nn.Module]:
    torch.manual_seed(0)
    strategy = make_strategy("allreduce", {}, StrategyEnv())
    model = strategy.wrap(build_model("gpt", (16,), 56, layers=1, heads=2, width=32, context=16))
    opt = strategy.build_optimizer(model.parameters(), torch.optim.Adam, lr=3e-3)
    amp = Precision(precision, torch.device("cpu"), strategy)
    d = load_dataset("chars", 0.2, sequence_length=16)
    losses = []
    for k in range(steps):
        opt.zero_grad()
        with amp.autocast():
            out = model(d.x_train[8 * k : 8 * k + 8])
            loss = task_loss(out, d.y_train[8 * k : 8 * k + 8])
        amp.backward(loss)
        strategy.step(amp.optimizer(opt))
        losses.append(loss.item())
    return losses, amp, model


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains_on_the_cpu_with_16_bit_matmuls_and_fp32_weights(precision: str) -> None:
    losses, amp, model = _steps(precision)
    ref, _, _ = _steps("fp32")
    assert losses[-1] < losses[0]
    assert losses != ref  # it really computed in 16 bits
    assert abs(losses[0] - ref[0]) < 0.05  # ... and close to fp32
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with amp.autocast():
        assert (torch.ones(4, 4) @ torch.ones(4, 4)).dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    if precision == "fp16":  # the loss scaler ran: its scale is saved with checkpoints
        state = amp.state_dict()
        assert state["scale"] > 0 and "_growth_tracker" in state
    else:
        assert amp.scaler is None and amp.state_dict() == {}


def test_fp16_scaler_skips_a_step_with_an_infinite_gradient() -> None:
    strategy = make_strategy("allreduce", {}, StrategyEnv())
    w = torch.nn.Parameter(torch.ones(3))
    opt = strategy.build_optimizer([w], torch.optim.SGD, lr=0.1)
    amp = Precision("fp16", torch.device("cpu"), strategy)
    amp.backward((w * torch.tensor([1.0, float("inf"), 1.0])).sum())  # an infinite gradient
    strategy.step(amp.optimizer(opt))
    assert torch.equal(w.detach(), torch.ones(3))  # skipped
    assert amp.state_dict()["scale"] < 65536.0  # and the scale backed off


def test_peak_memory_counts_what_training_allocates() -> None:
    meter = PeakMemory(torch.device("cpu"))
    if meter.mb() is None:
        pytest.skip("no /proc/self/clear_refs here")
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert big.sum() > 0
    assert 60 <= meter.mb() <= 200  # type: ignore[operator]  # the allocation, plus the sum's slack
    del big


def _rss_file_kib() -> int:
    with open("/proc/self/status") as f:
        m = re.search(r"^RssFile:\s+(\d+) kB", f.read(), re.MULTILINE)
    return int(m.group(1)) if m else 0


def test_peak_memory_leaves_out_the_file_pages_a_rank_maps(tmp_path: Path) -> None:
    """Library code is mapped page by page as it first runs (file-backed, like this file's pages):
    ~30 MB of libtorch in a gpt trial's first steps, which is no memory training holds."""
    path = tmp_path / "pages.bin"
    path.write_bytes(b"\x01" * (32 * 2**20))
    meter = PeakMemory(torch.device("cpu"))
    if meter.mb() is None:
        pytest.skip("no /proc/self/clear_refs here")
    before = _rss_file_kib()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
        assert sum(pages[i] for i in range(0, len(pages), mmap.PAGESIZE)) == len(pages) // mmap.PAGESIZE
        if _rss_file_kib() - before < 24 * 1024:
            pytest.skip("the mapped pages do not show as RssFile here")
        assert meter.mb() < 8  # type: ignore[operator]  # the mapping's 32 MiB are not counted
        big = torch.ones(16 * 2**20 // 4)  # while anonymous memory is
        assert big.sum() > 0
        assert 14 <= meter.mb() <= 40  # type: ignore[operator]
        del big


def _ctx(tmp_path: Path, **train: Any) -> TrialContext:
    cfg = TrainConfig(**{"model": "gpt", "dataset": "chars", "epochs": 1, "batch_size": 32, "optimizer": "adam",
                         "lr": 3e-3, "model_options": {"layers": 1, "heads": 2, "width": 32, "context": 32},
                         **train})
    return TrialContext(params={}, config=cfg, trial_number=0, trial_dir=tmp_path, metric="val_perplexity")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_builtin_trainer_reports_perplexity_tokens_and_peak_memory(tmp_path: Path, precision: str) -> None:
    m = train_builtin(_ctx(tmp_path, precision=precision))
    assert m["val_perplexity"] == pytest.approx(math.exp(m["val_loss"]))
    assert 1 < m["val_perplexity"] < 56  # learned something: below a uniform guess over 56 characters
    assert m["tokens_per_s"] == pytest.approx(32 * m["samples_per_s"])
    assert 0 <= m["train_accuracy"] <= 1 and 0 <= m["val_accuracy"] <= 1
    if "peak_memory_mb" in m:  # Linux
        assert m["peak_memory_mb"] > 0
