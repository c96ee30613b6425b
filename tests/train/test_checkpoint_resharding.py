"""Checkpoint formats in real trials (local engine, gloo DDP on loopback, warm worker processes).

* A 2-rank DDP trial (CNN on digits, dropout, Adam) whose rank is SIGKILLed after its first checkpoint
  resumes to bitwise the weights and exactly the metrics of an uninterrupted run, in every format; in
  ``rank0`` it writes half the bytes of ``replica`` (plus the other rank's RNG states, a few kB).
* A ``dcp`` checkpoint written by 2 ranks resumes on 1 and on 4 ranks (an elastic trial: its global batch
  is the same on every size; 4 ranks on this machine's 2 cores oversubscribe them, which is fine for
  correctness): the validation loss after every later epoch matches the uninterrupted 2-rank run within
  float tolerance (the gradient's sum runs in another order), and a resume on 2 ranks is bitwise.
* A pause in the middle of an epoch resumes bitwise in every format.
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines import TrialReport, TrialRequest, TrialResult
from hpoflow.engines.local import LocalEngine
from hpoflow.spec import TrainConfig
from hpoflow.train.checkpoint import make_checkpointer
from tests.conftest import ROOT

pytestmark = pytest.mark.slow  # real trials, killed and resumed

PYPATH = (str(ROOT / "tests"),)
EPOCHS = 5
COMPARED = ("val_accuracy", "val_loss", "train_loss", "train_accuracy", "epoch", "lr", "steps")


def _request(trial_dir: Path, fmt: str, **train: Any) -> TrialRequest:
    config = {"model": "cnn", "dataset": "digits", "epochs": EPOCHS, "batch_size": 64, "optimizer": "adam",
              "lr": 3e-3, "model_options": {"dropout": 0.2}, "seed": 7,
              "checkpoint": {"every": 1, "keep": 2, "async": True, "format": fmt}, **train}
    return TrialRequest(0, {}, TrainConfig.model_validate(config).model_dump(mode="json"), "val_accuracy",
                        "maximize", str(trial_dir), processes=2, python_path=PYPATH, seed=7, timeout=300)


def _complete(req: TrialRequest, step: int) -> bool:
    """Whether every rank's part of checkpoint ``step`` is on disk under its final name."""
    ck = req.train["checkpoint"]
    files = make_checkpointer(ck["format"], ck["options"], Path(req.checkpoints), world_size=req.processes,
                              background=False).step_files(step)
    return len(files) >= (1 if ck["format"] == "dcp" else req.processes)


def _rank_pid(engine: LocalEngine, number: int, rank: int) -> int | None:
    """The worker running ``rank`` of trial ``number``, as the engine placed it."""
    trial = engine._trials.get(number)
    workers = [w for w in (trial.workers if trial else []) if w.rank == rank]
    return workers[0].proc.pid if workers else None


def _run(engine: LocalEngine, req: TrialRequest, kill_rank: int | None = None, pause_after: int | None = None
         ) -> tuple[TrialResult, list[TrialReport]]:
    """Run ``req`` to its result, answering an elastic trial's reports (it waits for them); with
    ``kill_rank``, SIGKILL that rank once checkpoint 1 is complete; with ``pause_after``, pause the
    trial a moment after that epoch's report (in the middle of the next epoch)."""
    engine.submit(req)
    killed = kill_rank is None
    reports: list[TrialReport] = []
    deadline = time.monotonic() + 300  # a bound for a hang: a trial takes seconds
    while time.monotonic() < deadline:
        if not killed and _complete(req, 1):
            pid = _rank_pid(engine, req.number, kill_rank)  # type: ignore[arg-type]
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
        for ev in engine.poll(0.01):
            if isinstance(ev, TrialReport):
                reports.append(ev)
                if pause_after is not None and ev.step == pause_after:
                    time.sleep(0.1)  # past the epoch-end should_stop(), into the next epoch
                    engine.pause(req.number, "walltime")
                if req.elastic:  # it waits for the answer (the size to go on with); others ask none
                    engine.answer(ev.number, False)
            elif isinstance(ev, TrialResult):
                return ev, reports
    raise TimeoutError(f"trial {req.number} did not finish")


def _weights(trial_dir: Path, ranks: int = 2) -> list[str]:
    return [(trial_dir / f"weights_rank{r}.sha256").read_text() for r in range(ranks)]


@pytest.fixture(scope="module")
def engine() -> Iterator[LocalEngine]:
    eng = LocalEngine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def reference(engine: LocalEngine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The uninterrupted run (replica format): metrics, weight digests, bytes of its last checkpoint."""
    d = tmp_path_factory.mktemp("reference")
    req = _request(d, "replica")
    res, _ = _run(engine, req)
    assert res.status == "complete" and res.metrics["ranks_identical"] == 1.0, res
    cp = make_checkpointer("replica", {}, Path(req.checkpoints), world_size=2, background=False)
    size = sum(p.stat().st_size for p in cp.step_files(EPOCHS))
    return {"metrics": res.metrics, "weights": _weights(d), "bytes": size}


@pytest.mark.parametrize("fmt", ["rank0", "dcp", "safetensors"])
def test_a_killed_rank_resumes_bitwise_in_every_format(engine: LocalEngine, reference: dict[str, Any],
                                                      tmp_path: Path, fmt: str) -> None:
    req = _request(tmp_path, fmt)
    crashed, _ = _run(engine, req, kill_rank=1)
    assert crashed.status == "failed" and crashed.retryable, crashed
    assert not (tmp_path / "weights_rank0.sha256").exists()  # it really died before the end
    resumed, _ = _run(engine, dataclasses.replace(req, attempt=1))  # what the driver does on a retry
    assert resumed.status == "complete", resumed
    assert 1 <= resumed.metrics["resumed_from_epoch"] < EPOCHS
    assert _weights(tmp_path) == reference["weights"]  # bitwise, on both ranks
    assert {k: resumed.metrics[k] for k in COMPARED} == {k: reference["metrics"][k] for k in COMPARED}
    cp = make_checkpointer(fmt, {}, Path(req.checkpoints), world_size=2, background=False)
    assert [s for s in range(EPOCHS + 1) if cp.step_files(s)] == [EPOCHS - 1, EPOCHS]  # keep: 2
    size = sum(p.stat().st_size for p in cp.step_files(EPOCHS))
    if fmt == "rank0":  # half of replica's, plus rank 1's RNG states
        rng = (Path(req.checkpoints) / f"rank0-{EPOCHS:08d}-r1.pt").stat().st_size
        assert rng < 20_000 and size == pytest.approx(reference["bytes"] / 2 + rng, rel=0.01), \
            (size, reference["bytes"], rng)
        assert size < 0.52 * reference["bytes"]


PAUSE_TRAIN: dict[str, Any] = {"epochs": 3, "batch_size": 8, "lr": 1e-3, "seed": 11}  # epochs of 90 steps


@pytest.fixture(scope="module")
def pause_reference(engine: LocalEngine, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrialResult, Path]:
    """The pause tests' uninterrupted run (the replica format), the same for every format: run once per
    module; its result and trial directory."""
    d = tmp_path_factory.mktemp("pause-reference")
    reference, _ = _run(engine, _request(d, "replica", **PAUSE_TRAIN))
    return reference, d


@pytest.mark.parametrize("fmt", ["rank0", "dcp", "safetensors"])
def test_a_paused_trial_resumes_bitwise_in_every_format(engine: LocalEngine, pause_reference: tuple[TrialResult, Path],
                                                        tmp_path: Path, fmt: str) -> None:
    """As tests/train/test_checkpoint.py's pause test, for the other formats: small batches, so a pause a
    moment after epoch 1's report lands in the middle of epoch 2; the resume ends bitwise where the
    uninterrupted run (the replica format) ends."""
    reference, reference_dir = pause_reference
    assert reference.status == "complete", reference
    req = _request(tmp_path / "paused", fmt, **PAUSE_TRAIN)
    paused, _ = _run(engine, req, pause_after=1)
    assert paused.status == "cancelled" and "paused" in (paused.error or ""), paused
    resumed, _ = _run(engine, dataclasses.replace(req, attempt=1))
    assert resumed.status == "complete" and resumed.metrics["resumed_from_epoch"] == 1.0, resumed
    for key in COMPARED:
        if key in reference.metrics:
            assert resumed.metrics[key] == reference.metrics[key], key
    assert _weights(tmp_path / "paused") == _weights(reference_dir)


# -- dcp: written by 2 ranks, resumed on 1 and on 4 ------------------------------------------------------
def _elastic(trial_dir: Path, epochs: int, processes: int) -> TrialRequest:
    """An elastic trial (sizes 1, 2, 4; global batch 64 on each) on the synthetic data set, whose 1,600
    training samples make 25 full batches on any of those sizes, so every step of every size trains
    on the same samples; no dropout (a rank's mask would depend on the size)."""
    req = _request(trial_dir, "dcp", dataset="synthetic", epochs=epochs, model_options={"dropout": 0.0})
    return dataclasses.replace(req, processes=processes, elastic_sizes=(1, 2, 4))


def _val_losses(reports: list[TrialReport]) -> dict[int, float]:
    return {r.step: float(r.metrics["val_loss"]) for r in reports}


def test_a_dcp_checkpoint_written_by_two_ranks_resumes_on_one_and_on_four(tmp_path: Path) -> None:
    def engine(cores: list[int]) -> LocalEngine:
        return LocalEngine(cores=cores)  # as many ranks as cores: an elastic trial has nowhere to grow

    two = engine([0, 1])
    try:
        reference, ref_reports = _run(two, _elastic(tmp_path / "ref", 4, 2))
        assert reference.status == "complete", reference
        first, _ = _run(two, _elastic(tmp_path / "half", 2, 2))  # 2 epochs, checkpointed by 2 ranks
        assert first.status == "complete", first
        for world in (1, 2, 4):
            shutil.copytree(tmp_path / "half" / "checkpoints", tmp_path / f"on{world}" / "checkpoints")
        same, _ = _run(two, dataclasses.replace(_elastic(tmp_path / "on2", 4, 2), attempt=1))
    finally:
        two.close()
    assert same.status == "complete" and same.metrics["resumed_from_epoch"] == 2.0, same
    assert _weights(tmp_path / "on2") == _weights(tmp_path / "ref")  # bitwise at the same size
    assert {k: same.metrics[k] for k in COMPARED} == {k: reference.metrics[k] for k in COMPARED}
    expected = _val_losses(ref_reports)
    for world, cores in ((1, [0]), (4, [0, 1, 0, 1])):  # 4 ranks on 2 cores: two per core
        eng = engine(cores)
        try:
            resumed, reports = _run(eng, dataclasses.replace(_elastic(tmp_path / f"on{world}", 4, world), attempt=1))
        finally:
            eng.close()
        assert resumed.status == "complete", resumed
        assert resumed.metrics["resumed_from_epoch"] == 2.0 and resumed.metrics["world_size"] == world
        got = _val_losses(reports)
        assert sorted(got) == [3, 4]
        for step, loss in got.items():  # the same trajectory, up to the order of float sums
            assert math.isclose(loss, expected[step], rel_tol=1e-4), (world, step, loss, expected[step])
        assert resumed.metrics["val_accuracy"] == pytest.approx(reference.metrics["val_accuracy"], abs=2 / 400)
