"""Large-batch control: lr scaling, warm-up, LARS and gradient accumulation in the trainer."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from hpoflow.spec import TrainConfig
from hpoflow.train.builtin import train_epoch
from hpoflow.train.context import TrialContext
from hpoflow.train.largebatch import LARS, LrSchedule, global_batch, scaled_lr
from hpoflow.train.strategies import StrategyEnv, make_strategy
from hpoflow.train.strategies._base import flat_params


def test_scaled_lr_rules() -> None:
    assert scaled_lr(0.1, "none", 512, 64) == 0.1
    assert scaled_lr(0.1, "linear", 512, 64) == pytest.approx(0.8)
    assert scaled_lr(0.1, "sqrt", 256, 64) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="valid: none, linear, sqrt"):
        scaled_lr(0.1, "cubic", 2, 1)


def test_global_batch_counts_ranks_and_accumulation() -> None:
    assert global_batch(32, 4, 2) == 256


def test_schedule_from_config_scales_with_world_size_and_accumulation() -> None:
    cfg = TrainConfig(lr=0.1, batch_size=32, lr_scaling="linear", grad_accum_steps=2)
    sched = LrSchedule.from_config(cfg, world_size=4, steps_per_epoch=10)
    assert sched.target_lr == pytest.approx(0.8)  # global 256 / base 32
    cfg = TrainConfig(lr=0.1, batch_size=32, lr_scaling="sqrt", base_batch_size=64)
    assert LrSchedule.from_config(cfg, 8, 10).target_lr == pytest.approx(0.2)


def test_warmup_ramps_from_unscaled_lr_to_target_then_holds() -> None:
    cfg = TrainConfig(lr=0.1, batch_size=32, lr_scaling="linear", warmup_epochs=2)
    s = LrSchedule.from_config(cfg, world_size=4, steps_per_epoch=5)  # 10 warm-up steps
    lrs = [s.lr_at(t) for t in range(14)]
    assert lrs[0] == pytest.approx(0.1)
    assert lrs[9] == pytest.approx(0.4)
    assert all(a < b for a, b in itertools.pairwise(lrs[:10]))
    assert lrs[10:] == [pytest.approx(0.4)] * 4


def test_warmup_without_scaling_starts_small() -> None:
    s = LrSchedule.from_config(TrainConfig(lr=0.1, warmup_epochs=1), 1, 4)
    assert s.lr_at(0) == pytest.approx(0.025)
    assert s.lr_at(3) == pytest.approx(0.1)
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    assert s.apply(opt, 1) == pytest.approx(opt.param_groups[0]["lr"])


def test_lars_moves_each_matrix_by_lr_times_trust_times_norm() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(20, 10)
    w0, b0 = layer.weight.detach().clone(), layer.bias.detach().clone()
    lr, trust = 0.5, 0.01
    opt = LARS(torch.optim.SGD(layer.parameters(), lr=lr), trust_coefficient=trust)
    (layer(torch.randn(8, 20)).pow(2).sum() * 1000).backward()  # a huge gradient
    assert layer.bias.grad is not None
    bias_grad = layer.bias.grad.detach().clone()
    opt.step()
    moved = float(torch.linalg.vector_norm(layer.weight.detach() - w0))
    assert moved == pytest.approx(lr * trust * float(torch.linalg.vector_norm(w0)), rel=1e-4)
    torch.testing.assert_close(layer.bias.detach(), b0 - lr * bias_grad)  # vectors: plain SGD


def test_lars_folds_weight_decay_into_the_trust_ratio_and_restores_it() -> None:
    p = nn.Parameter(torch.ones(3, 3))
    opt = LARS(torch.optim.SGD([p], lr=1.0, weight_decay=0.1), trust_coefficient=0.02)
    p.grad = torch.full((3, 3), 0.5)
    opt.step()
    w, g, wd = 3.0, 1.5, 0.1  # norms of ones(3,3) and of the gradient
    local = 0.02 * w / (g + wd * w)
    assert p.detach()[0, 0].item() == pytest.approx(1 - local * (0.5 + 0.1), rel=1e-5)
    assert opt.param_groups[0]["weight_decay"] == 0.1


def _ctx(tmp: Path, **cfg: object) -> TrialContext:
    return TrialContext(params={}, config=TrainConfig(**cfg), trial_number=0, trial_dir=tmp)


@pytest.mark.parametrize("n_batches", [4, 5])
def test_grad_accumulation_matches_the_big_batch(tmp_path: Path, n_batches: int) -> None:
    b = 6
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(n_batches * b, 1, 8, 8, generator=g),
                         torch.randint(0, 10, (n_batches * b,), generator=g))

    def run(batch: int, accum: int) -> torch.Tensor:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 10))
        ctx = _ctx(tmp_path, batch_size=batch, grad_accum_steps=accum, optimizer="sgd", lr=0.1)
        strategy = make_strategy("allreduce", ctx.config.strategy_options, StrategyEnv())
        net = strategy.wrap(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = LrSchedule(0.1, 0.1, 0)
        loader = DataLoader(data, batch_size=batch, shuffle=False)
        _, steps, paused = train_epoch(ctx, net, strategy, opt, loader, sched, 0)
        assert paused is None
        assert steps == math.ceil(n_batches / 2)
        return flat_params(list(model.parameters()))

    torch.testing.assert_close(run(b, 2), run(2 * b, 1), rtol=1e-5, atol=1e-6)
