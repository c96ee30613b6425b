"""Surviving crashes: killed ranks are retried, a killed driver resumes without losing or doubling."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
import psutil
import pytest
import yaml
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.engines.local import LocalEngine
from hpoflow.run.ledger import interrupted
from tests.conftest import ROOT, RUN_ENV, start_run

pytestmark = pytest.mark.slow  # kills and resumes real studies


def spec(n_trials: int, processes: int, seconds: float, retries: int) -> dict[str, Any]:
    return {
        "study": {"name": "ft", "metric": "score", "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": 2, "seed": 5},
        "training": {"function": "trainfns:allreduce_loop", "options": {"seconds": seconds}},
        "resources": {"processes": processes, "max_retries": retries},
    }


def _study_under_fire(tmp_path: Path, data: dict[str, Any], kill: Callable[[LocalEngine, random.Random], str],
                      n_kills: int, seed: int, pause_s: Callable[[random.Random], float]) -> tuple[Any, list[str]]:
    """Run ``data`` on a local engine while a thread calls ``kill(engine, rng)`` up to ``n_kills`` times
    (each returns what it killed, '' for nothing); the study's result and the kills."""
    engine = LocalEngine()
    kills: list[str] = []
    done = threading.Event()

    def killer() -> None:
        rng = random.Random(seed)
        while len(kills) < n_kills and not done.is_set():
            time.sleep(pause_s(rng))
            victim = kill(engine, rng)
            if victim:
                kills.append(victim)

    thread = threading.Thread(target=killer, daemon=True)
    thread.start()
    try:
        result = optimize(data, tmp_path / "run", engine=engine, handle_signals=False)
    finally:
        done.set()
        thread.join()
        engine.close()
    return result, kills


def _kill_a_busy_rank(engine: LocalEngine, rng: random.Random) -> str:
    busy = [w.proc.pid for w in list(engine._pool.workers.values()) if w.trial is not None and w.proc.pid]
    if not busy:
        return ""
    pid = rng.choice(busy)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return ""
    return str(pid)


def test_ten_killed_ranks_lose_no_trial(tmp_path: Path) -> None:
    result, kills = _study_under_fire(tmp_path, spec(8, 2, 0.8, 10), _kill_a_busy_rank, 10, 0, lambda rng: 0.35)
    assert len(kills) == 10
    trials = result.study.trials
    assert result.summary.n_complete == 8 and result.summary.n_failed == 0
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 8  # no trial lost, none extra
    retried = [t for t in trials if t.user_attrs.get("attempts", 1) > 1]
    assert retried  # the kills were absorbed by retries
    extra_attempts = sum(t.user_attrs.get("attempts", 1) - 1 for t in trials)
    assert 1 <= extra_attempts <= len(kills)  # each retry answers a kill, no retry without one


def _multiprocessing_helper(p: psutil.Process) -> bool:
    try:
        cmd = " ".join(p.cmdline())
    except psutil.Error:
        return False
    return "forkserver" in cmd or "resource_tracker" in cmd


def _descendants(pid: int) -> set[int]:
    try:
        return {c.pid for c in psutil.Process(pid).children(recursive=True)}
    except psutil.Error:
        return set()


def _running(p: psutil.Process) -> bool:
    """``p`` (the very process: psutil checks its start time) runs, and is no zombie."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone meanwhile
        return False


def test_killed_driver_resumes_at_five_moments_without_loss_or_duplicates(tmp_path: Path) -> None:
    n_trials = 10
    # A torch-free trial (light workers, no forkserver preloading torch): what is checked here is the
    # resume (no trial lost, none doubled) and that no process of a killed driver lives on, neither of
    # which depends on torch; six `hpoflow run`s of torch trials cost ~3.3 CPU-s each in the preload
    # alone. Orphans of warm workers and the forkserver after a driver kill:
    # tests/engines/test_workers.py::test_a_driver_killed_alone_leaves_nothing_of_its_trials_running[warm].
    data = {
        "study": {"name": "ft", "metric": "value", "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": 2, "seed": 5},
        "training": {"function": "trainfns_light:slow", "options": {"sleep": 0.25}},
        "resources": {"processes": 1, "max_retries": 0},
    }
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hpoflow", "run", str(f), "--run-dir", str(run_dir), "--quiet"]
    # Kill when this many trials have a result file: before any, and at four points after.
    for finished_before_kill in (0, 2, 4, 6, 8):
        proc = subprocess.Popen(args, env=RUN_ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                start_new_session=True)
        deadline = time.monotonic() + 120  # a bound for a hang only
        while time.monotonic() < deadline and proc.poll() is None:
            # (a glob of a few files: cheap; the process table is read once, just before the kill)
            n = len(list(run_dir.glob("trials/*/result.json")))
            started = any(run_dir.glob("trials/*/rank0.log"))
            if n >= finished_before_kill and (finished_before_kill > 0 or started):
                break
            time.sleep(0.01)
        old = psutil.Process(proc.pid).children(recursive=True) if proc.poll() is None else []
        os.killpg(proc.pid, signal.SIGKILL)  # the driver and its process group, at once
        proc.wait(timeout=30)
        # every process the driver had is gone within 0.5 s (the bound the test always had; they go
        # within milliseconds, and the wait ends as soon as they are)
        deadline = time.monotonic() + 0.5
        while (alive := [p.pid for p in old if _running(p)]) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert alive == [], f"orphans after kill at {finished_before_kill}: {alive}"
    final = subprocess.run([*args[:-1], "--json"], env=RUN_ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr
    status = json.loads(final.stdout)
    assert status["n_complete"] == n_trials and status["n_failed"] == 0 and status["n_running"] == 0

    from hpoflow.run.storage import open_storage

    study = optuna.load_study(study_name="ft", storage=open_storage(None, run_dir))
    skipped = interrupted(study.trials)
    counted = [t for t in study.trials if t.number not in skipped]
    reruns = [t for t in study.trials if t.number in skipped]
    assert len(counted) == n_trials and all(t.state == TrialState.COMPLETE for t in counted)
    assert reruns, "the kills should have interrupted running trials"
    params = [t.params["x"] for t in counted]
    assert len(set(params)) == n_trials  # none duplicated
    for t in reruns:  # every interrupted trial was rerun exactly once, with its own params
        if "x" in t.params:  # (a kill between ask() and the first suggestion leaves none to rerun)
            assert params.count(t.params["x"]) == 1


def test_a_trial_interrupted_by_a_driver_kill_resumes_from_its_checkpoint(tmp_path: Path) -> None:
    data = {
        "study": {"name": "ckpt", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "categorical", "choices": [0.003]}},
        "search": {"algorithm": "grid", "n_trials": 1},
        # 16 epochs: the kill comes once two checkpoints are written, with 14 epochs to go, many times
        # the 50 ms poll even on a loaded machine; the resume then trains what is left (it was 40)
        "training": {"model": "mlp", "epochs": 16, "batch_size": 32, "lr": "${lr}",
                     "checkpoint": {"every": 1, "keep": 2}},
    }
    proc, run_dir, args = start_run(tmp_path, data)
    ckpts = run_dir / "trials" / "0" / "checkpoints"
    t0 = time.monotonic()
    while len(list(ckpts.glob("ckpt-*.pt"))) < 2 and time.monotonic() - t0 < 120:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    again = subprocess.run(args, env=RUN_ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["n_complete"] == 1
    from hpoflow.run.storage import open_storage

    study = optuna.load_study(study_name="ckpt", storage=open_storage(None, run_dir))
    rerun = study.trials[-1]
    assert 0 in interrupted(study.trials) and rerun.state == TrialState.COMPLETE
    assert rerun.user_attrs["hpoflow_replaces"] in {t.number for t in study.trials[:-1]}  # a rerun chain
    assert rerun.user_attrs["checkpoint_dir"] == str(ckpts)  # it inherited the killed trial's checkpoints
    assert rerun.user_attrs["metrics"]["resumed_from_epoch"] >= 1  # and resumed instead of starting over


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_any_process_of_the_engine_can_die(tmp_path: Path, seed: int) -> None:
    """SIGKILL of random descendants of the driver (the forkserver, idle or busy workers, ranks) many
    times: each death is detected, the process replaced, the affected trial retried, and the study
    completes every trial."""
    me = psutil.Process()
    # what this process ran before the study, other than multiprocessing's forkserver and resource
    # tracker (which the engine uses), is an xdist worker's session fixture (a SLURM cluster's slurmd,
    # a PostgreSQL server): not the engine's, and neither is anything those start later
    shared = [p for p in me.children() if not _multiprocessing_helper(p)]

    def kill_any_descendant(engine: LocalEngine, rng: random.Random) -> str:
        not_ours = {p.pid for p in shared} | {c for p in shared for c in _descendants(p.pid)}
        victims = [p for p in me.children(recursive=True) if p.is_running() and p.pid not in not_ours]
        if not victims:
            return ""
        victim = rng.choice(victims)
        try:
            name = " ".join(victim.cmdline()[:3]) or victim.name()
            victim.kill()
        except psutil.Error:
            return ""
        return name

    result, kills = _study_under_fire(tmp_path, spec(8, 1, 0.6, 8), kill_any_descendant, 6, seed,
                                      lambda rng: 0.4 + rng.random() * 0.4)
    assert len(kills) >= 3, kills
    trials = result.study.trials
    assert result.summary.n_complete == 8 and result.summary.n_failed == 0, (kills, [t.user_attrs for t in trials])
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 8
