"""PBT (search.scheduler: {type: pbt}) on the local engine with the real built-in trainer: the best trial's
lineage replayed from best.yaml as one plain trial ends with bitwise its weights; a driver killed with
SIGKILL mid-study and run again continues the population: every (member, interval) exactly once among the
complete trials, a complete lineage, and no epoch trained twice."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import FrozenTrial, TrialState

from hpoflow.api import optimize
from hpoflow.run.ledger import ATTR_LINEAGE, ATTR_REPLACES, is_counted
from hpoflow.run.storage import open_storage
from tests.conftest import ROOT, RUN_ENV, kill_run_when, start_run

pytestmark = pytest.mark.slow  # real studies of real (small) trainings


def _spec(name: str, population: int, epochs: int, slots: int, every: int = 0) -> dict[str, Any]:
    # sgd on digits: the second root learns slowly (lr 1e-3, no momentum); doubling lr and momentum (the
    # only perturbation) makes an exploiting member better than its donor, so the best lineage exploits
    roots = [{"lr": 0.01, "momentum": 0.5}, {"lr": 0.001, "momentum": 0.0}, {"lr": 0.004, "momentum": 0.3},
             {"lr": 0.002, "momentum": 0.1}][:population]
    return {
        "study": {"name": name, "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 1e-4, "high": 0.2, "log": True},
                  "momentum": {"type": "float", "low": 0.0, "high": 0.95}},
        "search": {"algorithm": "random", "n_trials": 100, "max_concurrent": slots, "seed": 1, "enqueue": roots,
                   "scheduler": {"type": "pbt", "population": population, "interval": 1, "quantile": 0.5,
                                 "resample_probability": 0.0, "perturb": [2.0]}},
        "training": {"model": "mlp", "dataset": "digits", "epochs": epochs, "batch_size": 32, "optimizer": "sgd",
                     "lr": "${lr}", "momentum": "${momentum}", "seed": 5,
                     "checkpoint": {"every": every, "keep": 2}},
        "resources": {"processes": 1, "cpus_per_process": 1},
        "oracle": {"enabled": False},
    }


def _lin(t: FrozenTrial) -> dict[str, Any]:
    lin = t.user_attrs[ATTR_LINEAGE]
    assert isinstance(lin, dict)
    return lin


def test_the_best_lineage_replayed_from_best_yaml_ends_with_bitwise_the_same_weights(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    res = optimize(_spec("pbt", population=2, epochs=4, slots=1), run_dir)
    trials = res.study.get_trials()
    assert res.summary.n_complete == 8 and all(t.state == TrialState.COMPLETE for t in trials)
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    by = {t.number: t for t in trials}
    chain = [by[n] for n in best["lineage"]]
    assert chain[-1].number == best["best_trial"] and _lin(chain[0])["parent"] is None
    assert any(_lin(t)["donor"] is not None for t in chain), "no exploit in the best lineage"
    training = best["rerun_spec"]["training"]
    assert training["epochs"] == 4 and training["seed"] == _lin(chain[-1])["seed"]
    assert training["schedule"]["lr"][0] == [0, chain[0].params["lr"]] and len(training["schedule"]["lr"]) > 1
    assert "member,interval,parent" in (run_dir / "trials.csv").read_text().splitlines()[0]
    replay = optimize(best["rerun_spec"], tmp_path / "replay")
    assert replay.study.trials[0].state == TrialState.COMPLETE
    sha = (run_dir / "trials" / str(best["best_trial"]) / "weights_rank0.sha256").read_text()
    assert (tmp_path / "replay" / "trials" / "0" / "weights_rank0.sha256").read_text() == sha
    assert replay.study.trials[0].value == best["best_value"]


def test_a_driver_killed_mid_pbt_continues_the_population_from_the_storage(tmp_path: Path) -> None:
    data = _spec("killed", population=4, epochs=6, slots=2, every=1)
    data["search"]["scheduler"]["interval"] = 2
    proc, run_dir, args = start_run(tmp_path, data)
    seen: tuple[int, int] = (0, 0)

    def mid_pbt(study: optuna.Study) -> bool:
        nonlocal seen
        later = [t for t in study.get_trials() if _lin_or_none(t) and _lin_or_none(t)["interval"] > 0]  # type: ignore[index]
        running = [t for t in later if t.state == TrialState.RUNNING]
        seen = (len(later), len(running))
        return bool(running) and any(t.state == TrialState.COMPLETE for t in later)  # an interval running

    kill_run_when(proc, run_dir, "killed", mid_pbt)
    assert seen[1] >= 1, f"the study never had a later interval running: {seen}"
    # the resume runs in-process (the driver ``hpoflow run`` runs, on this process's preloaded forkserver):
    # what is checked is the population it continues from the storage, not a process
    optimize(args[args.index("run") + 1], run_dir)
    study = optuna.load_study(study_name="killed", storage=open_storage(None, run_dir))
    trials = study.get_trials()
    counted = is_counted(trials)
    done = [t for t in trials if counted(t) and t.state == TrialState.COMPLETE]
    assert any(ATTR_REPLACES in t.user_attrs for t in trials)  # the interval running at the kill was rerun
    keys = [(_lin(t)["member"], _lin(t)["interval"]) for t in done]
    assert len(keys) == len(set(keys))  # no interval twice
    by = {t.number: t for t in done}
    for m in range(4):  # none lost: each member's intervals are 0..k without a gap, the last ends at epoch 6
        mine = sorted((t for t in done if _lin(t)["member"] == m), key=lambda t: _lin(t)["interval"])
        assert [_lin(t)["interval"] for t in mine] == list(range(len(mine)))
        assert _lin(mine[-1])["end"] == 6  # (fewer than 3 intervals: it exploited a member ahead of it)
    for t in done:
        lin = _lin(t)
        if lin["parent"] is not None:  # a complete chain: each resumes where a complete trial ended
            assert _lin(by[lin["parent"]])["end"] == lin["start"]
        # no epoch trained twice: a complete trial resumed at its interval's start (its parent's checkpoint)
        # and reported each epoch from there to its end once; the rerun of the interval running at the kill
        # resumed from that interval's own last checkpoint (every epoch): it trained again at most the
        # epoch in progress at the kill (whose report may have reached the driver before its checkpoint
        # reached the disk)
        resumed = int(t.user_attrs["metrics"]["resumed_from_epoch"])
        assert sorted(t.intermediate_values) == list(range(resumed + 1, lin["end"] + 1)), (t.number, lin)
        if ATTR_REPLACES in t.user_attrs:
            old = next(o for o in trials if o.number == t.user_attrs[ATTR_REPLACES])
            assert lin["start"] <= resumed and resumed >= max(old.intermediate_values, default=lin["start"]) - 1
        else:
            assert resumed == lin["start"], (t.number, lin, resumed)


def _lin_or_none(t: FrozenTrial) -> dict[str, Any] | None:
    lin = t.user_attrs.get(ATTR_LINEAGE)
    return lin if isinstance(lin, dict) else None


KILL_AT_COPY = """
import os, shutil, signal, sys
real = shutil.copytree
def copytree(src, dst, *args, **kwargs):  # the driver dies as it copies a parent's checkpoints
    os.kill(os.getpid(), signal.SIGKILL)
shutil.copytree = copytree
from hpoflow.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_interval_whose_driver_died_before_its_checkpoint_was_copied_resumes_from_its_parent(
        tmp_path: Path) -> None:
    """The driver is killed in the moment between asking a later interval and copying its parent's
    checkpoint: the rerun of that interval resumes where its parent ended, not from scratch."""
    data = _spec("copy", population=2, epochs=4, slots=1, every=1)
    data["search"]["scheduler"]["interval"] = 2
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    args = ["run", str(spec), "--run-dir", str(run_dir), "--json"]
    killed = subprocess.run([sys.executable, "-c", KILL_AT_COPY, *args], env=RUN_ENV, cwd=ROOT, capture_output=True,
                            text=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    study = optuna.load_study(study_name="copy", storage=open_storage(None, run_dir))
    orphan = [t for t in study.get_trials() if t.state == TrialState.RUNNING]
    assert len(orphan) == 1 and _lin(orphan[0])["start"] == 2, [t.user_attrs for t in study.get_trials()]
    optimize(spec, run_dir)  # the resume, in-process: what is checked is where the rerun resumed from
    study = optuna.load_study(study_name="copy", storage=open_storage(None, run_dir))
    reruns = [t for t in study.get_trials() if t.user_attrs.get(ATTR_REPLACES) == orphan[0].number]
    assert len(reruns) == 1 and reruns[0].state == TrialState.COMPLETE, [t.user_attrs for t in reruns]
    assert reruns[0].user_attrs["metrics"]["resumed_from_epoch"] == 2  # from its parent's checkpoint at epoch 2
    assert sorted(reruns[0].intermediate_values) == [3, 4]  # epochs 1 and 2 not trained again
