"""Promotion-type ASHA on the local engine with the real built-in trainer: a trial paused at its rung
(the answer to its report) and later promoted resumes from its checkpoint bitwise; a driver killed
with trials paused and running resumes the brackets from the storage."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.run.ledger import ATTR_PAUSED, ATTR_REPLACES, ATTR_RUNGS, ATTR_SEGMENTS, count_finished, interrupted
from hpoflow.run.storage import open_storage
from tests.conftest import ROOT, RUN_ENV, kill_run_when, start_run

pytestmark = pytest.mark.slow  # real studies of real (small) trainings

GOOD, BAD = 3e-3, 1e-5  # adam on digits: one learns in an epoch, the other hardly at all


def _spec(lrs: list[float], epochs: int, slots: int, every: int = 0, name: str = "promo") -> dict[str, Any]:
    return {
        "study": {"name": name, "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 1e-6, "high": 1e-1, "log": True}},
        "search": {"algorithm": "random", "n_trials": len(lrs), "max_concurrent": slots, "seed": 1,
                   "enqueue": [{"lr": lr} for lr in lrs],
                   "scheduler": {"type": "asha", "min_resource": 1, "reduction_factor": 2}},
        "training": {"model": "mlp", "dataset": "digits", "epochs": epochs, "batch_size": 32, "optimizer": "adam",
                     "lr": "${lr}", "seed": 5, "checkpoint": {"every": every, "keep": 2}},
        "resources": {"processes": 1, "cpus_per_process": 1},
        "oracle": {"enabled": False},
    }


def _sha(run_dir: Path, number: int) -> str:
    return (run_dir / "trials" / str(number) / "weights_rank0.sha256").read_text()


def test_a_paused_trial_is_promoted_and_resumes_bitwise_from_its_checkpoint(tmp_path: Path) -> None:
    # one slot, the good configuration first: it pauses at rung 1 (alone there), the bad ones join the
    # rung, it is promoted, pauses at rung 2, and is promoted again to the end
    res = optimize(_spec([GOOD, BAD, BAD, BAD], epochs=4, slots=1), tmp_path / "run")
    trials = res.study.get_trials()
    assert count_finished(res.study) == 4 and len(trials) == 4
    good = trials[0]
    assert good.state == TrialState.COMPLETE, [(t.number, t.state, t.user_attrs.get(ATTR_RUNGS)) for t in trials]
    segments = good.user_attrs[ATTR_SEGMENTS]
    assert [s["step"] for s in segments] == [1, 2], segments  # paused at both rungs, promoted from both
    assert good.user_attrs["metrics"]["resumed_from_epoch"] == 2.0  # the last run started at its rung-2 pause
    assert sorted(map(int, good.user_attrs[ATTR_RUNGS])) == [1, 2]
    assert {t.state for t in trials[1:]} == {TrialState.PRUNED}  # stopped at a rung, never promoted to the end
    # the same configuration, uninterrupted (no scheduler): bitwise the same final weights
    ref = _spec([GOOD], epochs=4, slots=1, name="ref")
    ref["search"]["scheduler"] = {"type": "none"}
    ref_res = optimize(ref, tmp_path / "ref")
    assert ref_res.study.trials[0].state == TrialState.COMPLETE
    assert _sha(tmp_path / "run", 0) == _sha(tmp_path / "ref", 0)
    assert good.value == ref_res.study.trials[0].value


def test_a_killed_driver_resumes_its_brackets_from_the_storage(tmp_path: Path) -> None:
    data = _spec([GOOD, BAD, GOOD * 0.5, BAD, GOOD * 2, BAD, GOOD * 0.3, BAD], epochs=8, slots=2, every=1,
                 name="killed")
    proc, run_dir, args = start_run(tmp_path, data)
    paused_then: set[int] = set()

    def paused_and_running(study: optuna.Study) -> bool:
        nonlocal paused_then
        trials = study.get_trials(states=(TrialState.RUNNING,))
        paused_then = {t.number for t in trials if t.user_attrs.get(ATTR_PAUSED) is not None}
        return len(paused_then) >= 2 and len(trials) > len(paused_then)  # paused trials and running ones

    kill_run_when(proc, run_dir, "killed", paused_and_running)
    assert len(paused_then) >= 2, "the study never had two trials paused while others ran"
    again = subprocess.run(args, env=RUN_ENV, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr
    study = optuna.load_study(study_name="killed", storage=open_storage(None, run_dir))
    trials = study.get_trials()
    gone = interrupted(trials)
    assert count_finished(study) == 8
    assert json.loads(again.stdout)["n_complete"] >= 1
    assert gone  # the trials running at the kill were rerun (from their checkpoints)
    assert not gone & paused_then  # a paused trial is nobody's: never rerun as a dead driver's trial
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials if t.number not in gone)
    for t in trials:
        if t.number in gone:
            continue
        rungs = t.user_attrs.get(ATTR_RUNGS) or {}
        if t.number in paused_then and t.state == TrialState.COMPLETE:  # promoted after the resume
            assert t.user_attrs["metrics"]["resumed_from_epoch"] >= 1.0
        if ATTR_REPLACES in t.user_attrs:  # the rerun of a trial running at the kill: its rungs carried over,
            old = trials[int(t.user_attrs[ATTR_REPLACES])]  # and it went on from its checkpoint
            old_rungs = old.user_attrs.get(ATTR_RUNGS) or {}
            assert rungs.items() >= old_rungs.items()
            resumed = t.user_attrs.get("metrics", {}).get("resumed_from_epoch")
            if resumed is not None and old_rungs:
                # it checkpointed every epoch: it lost at most the epoch in progress at the kill (whose
                # report may have reached the driver before its checkpoint reached the disk)
                assert resumed >= max(map(int, old_rungs)) - 1


def test_the_compss_engine_pauses_and_promotes_through_its_answer_files(tmp_path: Path) -> None:
    """The compss engine's file protocol (sequential mode: the same task body and rank processes,
    without a COMPSs runtime): the pause goes out in ``answer-<seq>.json``, each run of a trial has its
    own attempt directory, and the promoted trial ends bitwise where an uninterrupted run does."""
    from hpoflow.engines.compss import CompssEngine

    def run(data: dict[str, Any], run_dir: Path) -> optuna.Study:
        eng = CompssEngine(run_dir=run_dir, sequential=True, poll_interval_s=0.05)
        try:
            return optimize(data, run_dir, engine=eng).study
        finally:
            eng.close()

    # 2 epochs, one rung (epoch 1): the good trial pauses there alone, the bad one joins the rung and
    # pauses, the good one is promoted and completes; the bad one is closed at its rung
    study = run(_spec([GOOD, BAD], epochs=2, slots=1, name="compss"), tmp_path / "run")
    good, bad = study.get_trials()
    assert good.state == TrialState.COMPLETE and [s["step"] for s in good.user_attrs[ATTR_SEGMENTS]] == [1]
    assert bad.state == TrialState.PRUNED
    trial_dir = tmp_path / "run" / "trials" / "0"
    assert sorted(p.name for p in trial_dir.glob("attempt-*")) == ["attempt-0", "attempt-1"]
    assert any('"pause": true' in p.read_text() for p in (trial_dir / "attempt-0").glob("answer-*.json"))
    # the uninterrupted reference runs on the local engine (warm workers: no rank interpreter importing
    # torch, ~2.5 CPU-s), the same trainer with the same seed and one thread: the same weights bitwise
    ref = _spec([GOOD], epochs=2, slots=1, name="ref")
    ref["search"]["scheduler"] = {"type": "none"}
    optimize(ref, tmp_path / "ref")
    assert _sha(tmp_path / "run", 0) == _sha(tmp_path / "ref", 0)
