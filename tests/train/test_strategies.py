"""Data-parallel strategies with real gloo processes on loopback.

One 2-rank session (``_session`` fixture) runs every scenario once and each test checks its part:
identical all-reduce weights after every step, parameter server and all-reduce with 2 ranks x batch
b against one process with batch 2b, the EASGD center on every rank, and measured bytes per step
against the theoretical volume. A second fixture runs real trials through the local engine.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from hpoflow.spec import TrainConfig
from hpoflow.train.collectives import ring_allreduce_bytes
from hpoflow.train.strategies import (
    EASGD,
    Strategy,
    StrategyEnv,
    make_strategy,
    register_strategy,
    strategy_names,
)
from hpoflow.train.strategies._base import flat_params
from hpoflow.train.strategies._parameter_server import shard_parameters
from tests.train.ranks import run_ranks

WORLD = 2
B = 8  # per-rank batch
STEPS = 5
LR = 0.1
EQUIV: dict[str, tuple[str, dict[str, Any]]] = {  # name -> (strategy, options): must match one process with batch 2B
    "allreduce": ("allreduce", {}),
    "allreduce_small_buckets": ("allreduce", {"bucket_cap_mb": 0.001,
                                              "gradient_as_bucket_view": True}),
    "parameter_server": ("parameter_server", {"servers": 1}),
    "parameter_server_2": ("parameter_server", {"servers": 2}),
}
VOLUME: dict[str, tuple[str, dict[str, Any], int]] = {  # name -> (strategy, options, steps)
    "allreduce": ("allreduce", {}, 4),
    "allreduce_fp16": ("allreduce", {"compression": "fp16"}, 4),
    "parameter_server": ("parameter_server", {"servers": 1}, 4),
    "parameter_server_2": ("parameter_server", {"servers": 2}, 4),
    "easgd": ("easgd", {"tau": 2}, 4),
    "local_sgd": ("local_sgd", {"period": 2}, 4),
}


def _small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))


def _volume_model() -> nn.Module:  # ~400 kB of parameters: protocol overhead is negligible
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 128), nn.ReLU(),
                         nn.Linear(128, 10))


def _data(steps: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    return torch.randn(steps * batch, 64, generator=g), torch.randint(0, 10, (steps * batch,),
                                                                      generator=g)


def _options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    return TrainConfig(strategy=name, strategy_options=options, optimizer="sgd").strategy_options


def _digest(params: list[nn.Parameter]) -> str:
    return hashlib.sha256(flat_params(params).numpy().tobytes()).hexdigest()


def _train(strategy: Strategy, model: nn.Module, x: torch.Tensor, y: torch.Tensor, steps: int,
           batch: int, rank: int, world: int, momentum: float = 0.9) -> list[str]:
    """``steps`` steps; rank r takes rows [k*world*batch + r*batch, +batch) of global batch k.
    Returns the digest of the parameters after every step."""
    net = strategy.wrap(model)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum, weight_decay=1e-4)
    strategy.prepare_optimizer(opt)
    digests = []
    for k in range(steps):
        lo = k * world * batch + rank * batch
        xb, yb = x[lo : lo + batch], y[lo : lo + batch]
        strategy.meter.begin_step()
        opt.zero_grad(set_to_none=True)
        strategy.before_step()
        nn.functional.cross_entropy(net(xb), yb).backward()
        strategy.after_backward()
        strategy.step(opt)
        strategy.meter.end_step()
        digests.append(_digest(strategy.params))
    return digests


def _session_rank(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    out = Path(out_dir)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        res: dict[str, Any] = {"equiv": {}, "digests": {}, "volume": {}}
        x, y = _data(STEPS, WORLD * B)
        for key, (name, opts) in EQUIV.items():
            s = make_strategy(name, _options(name, opts), StrategyEnv(rank, world, LR))
            res["digests"][key] = _train(s, _small_model(), x, y, STEPS, B, rank, world)
            res["equiv"][key] = flat_params(s.params).clone()
        for key, momentum in (("easgd", False), ("measgd", True)):
            s = make_strategy("easgd", _options("easgd", {"tau": 2, "momentum": momentum}),
                              StrategyEnv(rank, world, LR))
            _train(s, _small_model(), x, y, 6, B, rank, world, momentum=0.0)
            assert isinstance(s, EASGD)
            res[key] = {"center": s.center_vector(), "local": flat_params(s.params).clone()}
        xv, yv = _data(8, WORLD * 32)
        for key, (name, opts, steps) in VOLUME.items():
            s = make_strategy(name, _options(name, opts), StrategyEnv(rank, world, LR))
            _train(s, _volume_model(), xv, yv, steps, 32, rank, world)
            res["volume"][key] = s.comm_stats()
        torch.save(res, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.error").write_text(traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def session() -> list[dict[str, Any]]:
    return run_ranks(_session_rank, WORLD, hang_s=90)


def _reference() -> torch.Tensor:
    """One process, batch 2B, the same global batches in the same order."""
    model = _small_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9, weight_decay=1e-4)
    x, y = _data(STEPS, WORLD * B)
    for k in range(STEPS):
        xb, yb = x[k * WORLD * B : (k + 1) * WORLD * B], y[k * WORLD * B : (k + 1) * WORLD * B]
        opt.zero_grad()
        nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()
    return flat_params(list(model.parameters()))


# -- all-reduce and parameter server: consistency and equivalence ---------------------------------
@pytest.mark.parametrize("key", list(EQUIV))
def test_ranks_hold_identical_weights_after_every_step(session: list[dict[str, Any]], key: str
                                                      ) -> None:
    d0, d1 = session[0]["digests"][key], session[1]["digests"][key]
    assert len(d0) == STEPS
    assert d0 == d1, f"{key}: ranks diverged at step {next(i for i in range(STEPS) if d0[i] != d1[i])}"


@pytest.mark.parametrize("key", list(EQUIV))
def test_two_ranks_match_one_process_with_double_batch(session: list[dict[str, Any]], key: str
                                                       ) -> None:
    ref = _reference()
    got = session[0]["equiv"][key]
    assert not torch.equal(ref, _small_model_flat()), "the reference did not train"
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def _small_model_flat() -> torch.Tensor:
    return flat_params(list(_small_model().parameters()))


# -- EASGD ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["easgd", "measgd"])
def test_easgd_center_identical_on_every_rank(session: list[dict[str, Any]], key: str) -> None:
    c0, c1 = session[0][key]["center"], session[1][key]["center"]
    assert torch.equal(c0, c1)
    assert not torch.equal(c0, _small_model_flat()), "the center never moved"
    # the workers themselves explore apart (that is the point of elastic averaging)
    assert not torch.equal(session[0][key]["local"], session[1][key]["local"])


def test_measgd_differs_from_easgd(session: list[dict[str, Any]]) -> None:
    assert not torch.equal(session[0]["easgd"]["center"], session[0]["measgd"]["center"])


# -- measured communication volume ---------------------------------------------------------------
def _theory(key: str, model_bytes: float, rank: int) -> float:
    """The volume formulas, written out independently of the strategies' own code."""
    m, p = model_bytes, WORLD
    ring = 2 * (p - 1) / p * m
    return {
        "allreduce": ring,
        "allreduce_fp16": ring / 2,
        # one server (rank 0): it sends the updated M to p-1 workers; a worker pushes M
        "parameter_server": (p - 1) * m if rank == 0 else m,
        "easgd": ring / 2,  # tau = 2
        "local_sgd": ring / 2,  # period = 2
    }.get(key, float("nan"))


@pytest.mark.parametrize("key", list(VOLUME))
def test_measured_bytes_per_step_match_theory(session: list[dict[str, Any]], key: str) -> None:
    for rank in range(WORLD):
        st = session[rank]["volume"][key]
        if st["bytes_measured"] != 1.0:
            pytest.skip("no kernel byte counter (/proc/self/io) here: bytes are estimates")
        theory = st["theory_bytes_per_step"]
        assert theory > 0
        independent = _theory(key, st["model_bytes"], rank)
        if not math.isnan(independent):
            assert theory == pytest.approx(independent, rel=1e-9)
        assert st["bytes_per_step"] == pytest.approx(theory, rel=0.05), (key, rank, st)
        assert 0 < st["comm_fraction"] < 1
        assert st["comm_time_s"] > 0


def test_parameter_server_two_servers_split_the_traffic(session: list[dict[str, Any]]) -> None:
    per_rank = [session[r]["volume"]["parameter_server_2"]["bytes_per_step"] for r in range(WORLD)]
    m = session[0]["volume"]["parameter_server_2"]["model_bytes"]
    # each byte of M is pushed once by its non-owner and pulled once from its owner: 2 M in all,
    # shared evenly, against (p - 1) M on the one server of a single-server layout
    assert sum(per_rank) == pytest.approx(2 * m, rel=0.05)
    assert max(per_rank) < 0.75 * session[0]["volume"]["parameter_server"]["bytes_per_step"] * 2


# -- registry and units ---------------------------------------------------------------------------
def test_registry_lists_valid_names_on_unknown() -> None:
    assert strategy_names() == ["allreduce", "easgd", "fsdp", "local_sgd", "parameter_server", "zero1"]
    with pytest.raises(ValueError, match="valid strategies: allreduce, easgd, fsdp, local_sgd"):
        make_strategy("hogwild", {}, StrategyEnv())


def test_register_strategy_rejects_non_strategies() -> None:
    with pytest.raises(TypeError, match="must subclass"):
        register_strategy(dict)  # type: ignore[arg-type]


def test_shards_are_balanced_and_deterministic() -> None:
    owner = shard_parameters([400, 10, 300, 100, 5], 2)
    assert owner == shard_parameters([400, 10, 300, 100, 5], 2)
    load = [sum(s for s, o in zip([400, 10, 300, 100, 5], owner, strict=True) if o == k)
            for k in range(2)]
    assert max(load) - min(load) <= 100


def test_ring_formula() -> None:
    assert ring_allreduce_bytes(1000, 1) == 0
    assert ring_allreduce_bytes(1000, 2) == 1000
    assert ring_allreduce_bytes(1000, 4) == 1500


@pytest.mark.parametrize("name", ["allreduce", "parameter_server", "easgd", "local_sgd"])
def test_single_process_strategies_train_without_a_group(name: str) -> None:
    s = make_strategy(name, _options(name, {}), StrategyEnv(0, 1, LR))
    x, y = _data(4, B)
    before = _small_model_flat()
    _train(s, _small_model(), x, y, 4, B, 0, 1)
    assert not torch.equal(flat_params(s.params), before)
    assert s.comm_stats()["bytes_per_step"] == pytest.approx(0, abs=4096)


# -- real trials through the local engine --------------------------------------------------------
TRIAL = {"model": "cnn", "dataset": "digits", "epochs": 10, "batch_size": 32, "optimizer": "sgd",
         "lr": 0.05, "momentum": 0.9, "seed": 0}
TRIAL_STRATEGIES = {
    "allreduce": {},
    "parameter_server": {},
    "easgd": {"tau": 2},
    "local_sgd": {"period": 4},
}


@pytest.fixture(scope="module")
def trials(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from hpoflow.engines.local import LocalEngine
    from hpoflow.trial import TrialRequest, TrialResult

    root = tmp_path_factory.mktemp("strategy_trials")
    out: dict[str, Any] = {}
    engine = LocalEngine(cores=[0, 1] if len(os.sched_getaffinity(0)) >= 2 else None)
    try:
        for i, (name, opts) in enumerate(TRIAL_STRATEGIES.items()):
            cfg = TrainConfig(**TRIAL, strategy=name, strategy_options=opts)
            trial_dir = root / name
            engine.submit(TrialRequest(i, {}, cfg.model_dump(mode="json"), "val_accuracy",
                                       "maximize", str(trial_dir), processes=2, timeout=120))
            result = None
            while result is None:
                for ev in engine.poll(150):
                    if isinstance(ev, TrialResult):
                        result = ev
            out[name] = (result, trial_dir)
    finally:
        engine.close()
    return out


@pytest.mark.parametrize("name", list(TRIAL_STRATEGIES))
@pytest.mark.slow
def test_every_strategy_reaches_95_percent_on_digits_with_two_ranks(trials: dict[str, Any],
                                                                    name: str) -> None:
    result, _ = trials[name]
    assert result.status == "complete", (result.error, result.stderr_tail)
    m = result.metrics
    assert m["val_accuracy"] >= 0.95, m
    for key in ("samples_per_s", "step_time_s", "comm_time_s", "comm_fraction", "bytes_per_step"):
        assert key in m and m[key] >= 0, (key, m)
    assert m["world_size"] == 2
    assert m["ranks_identical"] == 1.0


def test_ddp_trial_ranks_end_with_identical_weights(trials: dict[str, Any]) -> None:
    result, trial_dir = trials["allreduce"]
    assert result.status == "complete", (result.error, result.stderr_tail)
    digests = [(trial_dir / f"weights_rank{r}.sha256").read_text().strip() for r in range(2)]
    assert len(digests[0]) == 64
    assert digests[0] == digests[1]
