"""Checkpoints: the file format and its failure modes in-process, then real crashes.

The key test kills one rank of a real 2-rank trial (local engine, gloo on loopback) once a checkpoint
exists, resubmits the request with ``attempt=1`` (what the driver does for a retryable failure) and
checks the resumed trial ends with bitwise the weights and exactly the metrics of an uninterrupted
run with the same seed, for all-reduce (async and sync writes) and EASGD.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hpoflow.engines import TrialReport, TrialRequest, TrialResult
from hpoflow.engines.local import LocalEngine
from hpoflow.fileio import write_atomic
from hpoflow.spec import TrainConfig
from hpoflow.train.checkpoint import (
    MAGIC,
    Checkpointer,
    UnsafeCheckpoint,
    checkpoint_name,
    encode,
    read_checkpoint,
)
from hpoflow.train.context import TrialContext
from tests.conftest import ROOT

# -- the file format, in-process ----------------------------------------------------------------------


def _files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir()) if d.exists() else []


def test_save_load_roundtrip_and_keep_pruning(tmp_path: Path) -> None:
    cp = Checkpointer(tmp_path, keep=2, background=False)
    for step in range(1, 6):
        cp.save({"w": torch.full((3,), float(step)), "n": step, "nested": [{"a": (1, 2.5, None, "x")}]}, step)
    assert _files(tmp_path) == [checkpoint_name(4, 0), checkpoint_name(5, 0)]
    found = Checkpointer(tmp_path).latest()
    assert found is not None
    step, state = found
    assert step == 5 and state["n"] == 5 and torch.equal(state["w"], torch.full((3,), 5.0))
    assert state["nested"] == [{"a": (1, 2.5, None, "x")}]
    head = (tmp_path / checkpoint_name(5, 0)).read_bytes()[:8]
    assert head == MAGIC


def test_async_save_copies_the_state_before_returning(tmp_path: Path) -> None:
    cp = Checkpointer(tmp_path, background=True)
    w = torch.zeros(1000)
    cp.save({"w": w}, 1)
    w.add_(1.0)  # training goes on while the background thread writes
    cp.close()
    found = Checkpointer(tmp_path).latest()
    assert found is not None and torch.equal(found[1]["w"], torch.zeros(1000))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the expected ones are checked
def test_truncated_or_damaged_newest_file_falls_back_and_all_corrupt_gives_none(tmp_path: Path) -> None:
    cp = Checkpointer(tmp_path, keep=3, background=False)
    for step in (1, 2, 3):
        cp.save({"step": step}, step)
    newest = tmp_path / checkpoint_name(3, 0)
    newest.write_bytes(newest.read_bytes()[:-100])  # truncated
    with pytest.warns(RuntimeWarning, match="truncated"):
        found = Checkpointer(tmp_path, keep=3).latest()
    assert found is not None and found[0] == 2 and found[1]["step"] == 2
    assert not newest.exists()  # newer than the one resumed from: removed

    middle = tmp_path / checkpoint_name(2, 0)
    data = bytearray(middle.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit in the payload
    middle.write_bytes(bytes(data))
    with pytest.warns(RuntimeWarning, match="SHA-256"):
        found = Checkpointer(tmp_path, keep=3).latest()
    assert found is not None and found[0] == 1

    oldest = tmp_path / checkpoint_name(1, 0)
    oldest.write_bytes(b"garbage")
    with pytest.warns(RuntimeWarning, match="no checkpoint .* is valid"):
        assert Checkpointer(tmp_path).latest() is None


class _Evil:
    """Unpickling this would create a file (arbitrary code)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (pathlib.Path.touch, (self.marker,))


def test_weights_only_refuses_a_pickled_object_even_with_a_valid_checksum(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    path = tmp_path / checkpoint_name(1, 0)
    payload = {"format": 1, "step": 1, "rank": 0, "world_size": 1, "state": {"x": _Evil(marker)}}
    write_atomic(path, *encode(payload))
    with pytest.raises(UnsafeCheckpoint, match="weights_only"):
        read_checkpoint(path)
    with pytest.warns(RuntimeWarning, match="weights_only"):
        assert Checkpointer(tmp_path).latest() is None
    assert not marker.exists()
    with pytest.raises(TypeError, match="a checkpoint holds only tensors"):  # refused when saving, too
        Checkpointer(tmp_path, background=False).save({"x": _Evil(marker)}, 2)


def test_crash_between_temp_write_and_rename_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import os, torch
        from pathlib import Path
        import hpoflow.train.checkpoint as ck
        cp = ck.Checkpointer(Path({str(tmp_path)!r}), background=False)
        cp.save({{"w": torch.ones(4)}}, 1)
        os.replace = lambda *a, **k: os._exit(7)  # the process dies after the temp file is written
        cp.save({{"w": torch.full((4,), 2.0)}}, 2)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 7, proc.stderr
    names = _files(tmp_path)
    assert checkpoint_name(1, 0) in names and checkpoint_name(2, 0) not in names
    assert any(n.startswith(f".{checkpoint_name(2, 0)}.") and n.endswith(".tmp") for n in names)  # orphaned temp
    found = Checkpointer(tmp_path).latest()
    assert found is not None and found[0] == 1 and torch.equal(found[1]["w"], torch.ones(4))
    assert _files(tmp_path) == [checkpoint_name(1, 0)]  # the temp file was cleaned up


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the expected ones are checked
def test_ranks_agree_on_the_newest_step_complete_everywhere(tmp_path: Path) -> None:
    r0 = Checkpointer(tmp_path, rank=0, world_size=2, keep=1, background=False)
    r1 = Checkpointer(tmp_path, rank=1, world_size=2, keep=1, background=False)
    r0.save({"r": 0, "s": 1}, 1)
    r1.save({"r": 1, "s": 1}, 1)
    r0.save({"r": 0, "s": 2}, 2)
    # keep=1, but step 1 is the only step every rank has: rank 0 must not delete it yet.
    assert checkpoint_name(1, 0) in _files(tmp_path) and checkpoint_name(2, 0) in _files(tmp_path)
    # Rank 1 "died" before writing step 2: both ranks must resume from step 1.
    lists = {0: [1, 2], 1: [1]}
    a = Checkpointer(tmp_path, rank=0, world_size=2).latest(lambda mine: [lists[0], lists[1]])
    b = Checkpointer(tmp_path, rank=1, world_size=2).latest(lambda mine: [lists[0], mine])
    assert a is not None and b is not None and (a[0], b[0]) == (1, 1)
    assert a[1] == {"r": 0, "s": 1} and b[1] == {"r": 1, "s": 1}
    assert checkpoint_name(2, 0) not in _files(tmp_path)  # rank 0's abandoned step 2 is gone
    # Pruning once both ranks have step 2, then 3 on rank 0: each keeps its newest complete step.
    r0.save({"s": 2}, 2)
    r1.save({"s": 2}, 2)
    r0.save({"s": 3}, 3)
    assert _files(tmp_path) == [checkpoint_name(2, 0), checkpoint_name(2, 1), checkpoint_name(3, 0)]
    # A checkpoint of another world size is never used.
    with pytest.warns(RuntimeWarning, match="same number of processes"):
        assert Checkpointer(tmp_path, rank=0, world_size=1).latest() is None


def test_user_function_saves_and_loads_through_the_context(tmp_path: Path) -> None:
    cfg = TrainConfig(function="m:f", checkpoint={"every": 0, "keep": 2, "async": True})

    def ctx() -> TrialContext:
        return TrialContext(params={}, config=cfg, trial_number=3, trial_dir=tmp_path)

    first = ctx()
    assert first.load_checkpoint() is None and first.resumed_step is None
    torch.manual_seed(5)
    w = torch.randn(10)
    first.save_checkpoint({"w": w, "epoch": 1})  # step defaults to 1
    first.save_checkpoint({"w": w * 2, "epoch": 2})  # then 2
    after_save = torch.rand(3)  # what the run draws next
    first.flush_checkpoints()
    assert _files(tmp_path / "checkpoints") == [checkpoint_name(1, 0), checkpoint_name(2, 0)]

    second = ctx()
    torch.manual_seed(999)
    state = second.load_checkpoint()
    assert state is not None and second.resumed_step == 2 and state["epoch"] == 2
    assert torch.equal(state["w"], w * 2)
    assert torch.equal(torch.rand(3), after_save)  # the RNG continues where the checkpoint was taken
    second.save_checkpoint({"epoch": 3})
    second.flush_checkpoints()
    assert _files(tmp_path / "checkpoints") == [checkpoint_name(2, 0), checkpoint_name(3, 0)]
    with pytest.raises(TypeError, match=r"numpy\.ndarray"):
        import numpy as np

        second.save_checkpoint({"a": np.zeros(2)})


def test_spec_checkpoint_section() -> None:
    c = TrainConfig.model_validate({"checkpoint": {"every": 2, "async": False}})
    assert (c.checkpoint.every, c.checkpoint.keep, c.checkpoint.async_) == (2, 2, False)
    dumped = c.model_dump(mode="json")
    assert dumped["checkpoint"] == {"every": 2, "keep": 2, "async": False, "format": "replica", "options": {}}
    assert TrainConfig.model_validate(dumped) == c
    assert TrainConfig().checkpoint.every == 0
    with pytest.raises(ValueError, match="did you mean 'every'"):
        TrainConfig.model_validate({"checkpoint": {"evry": 1}})
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        TrainConfig.model_validate({"checkpoint": {"keep": 0}})


# -- real crashes: a killed rank, a resubmitted request, a bitwise-identical end ---------------------

PYPATH = (str(ROOT / "tests"),)
EPOCHS = 6
COMPARED = ("val_accuracy", "val_loss", "train_loss", "train_accuracy", "epoch", "lr", "steps")


def _request(trial_dir: Path, strategy: str, async_: bool) -> TrialRequest:
    options = {"tau": 2} if strategy == "easgd" else {}
    train = TrainConfig(model="cnn", dataset="digits", epochs=EPOCHS, batch_size=64, optimizer="adam", lr=3e-3,
                        model_options={"dropout": 0.2}, strategy=strategy, strategy_options=options, seed=7,
                        checkpoint={"every": 1, "keep": 2, "async": async_}).model_dump(mode="json")
    return TrialRequest(0, {}, train, "val_accuracy", "maximize", str(trial_dir), processes=2,
                        python_path=PYPATH, seed=7, timeout=120)


def _rank_pid(engine: LocalEngine, number: int, rank: int) -> int | None:
    """The worker running ``rank`` of trial ``number``, as the engine placed it."""
    trial = engine._trials.get(number)
    workers = [w for w in (trial.workers if trial else []) if w.rank == rank]
    return workers[0].proc.pid if workers else None


def _run(engine: LocalEngine, req: TrialRequest, kill_rank: int | None = None) -> TrialResult:
    """Run ``req`` to its result; with ``kill_rank``, SIGKILL that rank once every rank has
    written the first checkpoint."""
    engine.submit(req)
    ck = Path(req.checkpoints)
    first = [ck / checkpoint_name(1, r) for r in range(req.processes)]
    killed = kill_rank is None
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        if not killed and all(p.exists() for p in first):
            pid = _rank_pid(engine, req.number, kill_rank)  # type: ignore[arg-type]
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed = True
        for ev in engine.poll(0.01):
            if isinstance(ev, TrialResult):
                return ev
    raise TimeoutError(f"trial {req.number} did not finish")


def _weights(trial_dir: Path) -> list[str]:
    return [(trial_dir / f"weights_rank{r}.sha256").read_text() for r in (0, 1)]


@pytest.fixture(scope="module")
def engine() -> Any:
    eng = LocalEngine()
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def references(engine: LocalEngine, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Uninterrupted runs (checkpointing on, async), one per strategy: (metrics, weight digests)."""
    out = {}
    for strategy in ("allreduce", "easgd"):
        d = tmp_path_factory.mktemp(f"ref-{strategy}")
        res = _run(engine, _request(d, strategy, True))
        assert res.status == "complete", res
        assert res.metrics["resumed_from_epoch"] == 0.0 and res.metrics["ranks_identical"] == 1.0
        out[strategy] = (res.metrics, _weights(d))
    return out


@pytest.mark.parametrize(("strategy", "async_", "kill_rank"), [
    ("allreduce", True, 1),
    ("allreduce", False, 0),
    ("easgd", True, 1),
])
def test_killed_rank_resumes_to_bitwise_identical_weights_and_metrics(
        engine: LocalEngine, references: dict[str, Any], tmp_path: Path, strategy: str, async_: bool,
        kill_rank: int) -> None:
    req = _request(tmp_path, strategy, async_)
    crashed = _run(engine, req, kill_rank=kill_rank)
    assert crashed.status == "failed" and crashed.retryable, crashed
    assert f"rank {kill_rank}" in (crashed.error or "") or "gloo" in (crashed.error or "").lower(), crashed.error
    assert not (tmp_path / "weights_rank0.sha256").exists()  # it really died before the end

    resumed = _run(engine, dataclasses.replace(req, attempt=1))  # what the driver does on a retry
    assert resumed.status == "complete", resumed
    ref_metrics, ref_weights = references[strategy]
    assert 1 <= resumed.metrics["resumed_from_epoch"] < EPOCHS
    assert _weights(tmp_path) == ref_weights  # bitwise, on both ranks
    assert {k: resumed.metrics[k] for k in COMPARED} == {k: ref_metrics[k] for k in COMPARED}
    assert resumed.metrics["ranks_identical"] == 1.0
    names = _files(Path(req.checkpoints))
    assert names == sorted(checkpoint_name(s, r) for r in (0, 1) for s in (EPOCHS - 1, EPOCHS))  # keep: 2


# -- a pause: stop at the next step with a checkpoint, resume from the middle of the epoch ---------------

def _pause_request(trial_dir: Path, every: int) -> TrialRequest:
    # small batches: 719 training samples a rank, an epoch of 90 steps (half a second here, longer on a
    # loaded machine), so a pause sent a moment (0.1 s) after epoch 1's report lands in the middle of epoch 2
    train = TrainConfig(model="cnn", dataset="digits", epochs=3, batch_size=8, optimizer="adam", lr=1e-3,
                        model_options={"dropout": 0.2}, seed=11,
                        checkpoint={"every": every, "keep": 2, "async": True}).model_dump(mode="json")
    return TrialRequest(0, {}, train, "val_accuracy", "maximize", str(trial_dir), processes=2,
                        python_path=PYPATH, seed=11, timeout=300)


@pytest.fixture(scope="module")
def pause_reference(engine: LocalEngine, tmp_path_factory: pytest.TempPathFactory) -> tuple[TrialResult, Path]:
    """The pause tests' uninterrupted run, with checkpoints off (saving none changes nothing it trains):
    run once per module for both tests; its result and trial directory."""
    d = tmp_path_factory.mktemp("pause-reference")
    return _run(engine, _pause_request(d, 0)), d


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 0])  # also with checkpoints off: a pause saves one to resume from
def test_a_paused_trial_stops_mid_epoch_with_a_checkpoint_and_resumes_bitwise(
        engine: LocalEngine, pause_reference: tuple[TrialResult, Path], tmp_path: Path, every: int) -> None:
    reference, reference_dir = pause_reference
    assert reference.status == "complete", reference
    req = _pause_request(tmp_path / "paused", every)
    engine.submit(req)
    paused = None
    deadline = time.monotonic() + 300  # a bound for a hang: the trial takes seconds
    while paused is None and time.monotonic() < deadline:
        for ev in engine.poll(0.05):
            if isinstance(ev, TrialReport) and ev.step == 1:
                # rank 0 sent that report just before its epoch-end should_stop(): past it after a moment,
                # into epoch 2 (a pause seen there would stop it at the epoch boundary instead)
                time.sleep(0.1)
                engine.pause(req.number, "walltime")
            elif isinstance(ev, TrialResult):
                paused = ev
    assert paused is not None and paused.status == "cancelled" and "paused" in (paused.error or ""), paused
    files = list(Path(req.checkpoints).glob("ckpt-*-r0.pt"))
    newest = max(files, key=lambda p: int(p.name.split("-")[1]))
    state = read_checkpoint(newest)["state"]["user"]
    assert state["data"]["epoch"] == 1 and state["data"]["batch"] > 0, state["data"]  # in the middle of epoch 2
    resumed = _run(engine, dataclasses.replace(req, attempt=1))
    assert resumed.status == "complete", resumed
    assert resumed.metrics["resumed_from_epoch"] == 1.0
    for key in COMPARED:
        if key in reference.metrics:
            assert resumed.metrics[key] == reference.metrics[key], key
    assert _weights(tmp_path / "paused") == _weights(reference_dir)  # bitwise the uninterrupted run
