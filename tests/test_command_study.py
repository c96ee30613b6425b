"""Studies of command trials on the local engine (``training.command``): the median pruner stops a program
that only prints its epochs, promotion ASHA pauses and resumes a program from what it saved in
``HPOFLOW_CHECKPOINT_DIR``, and PBT runs a population of it, interval by interval; no epoch is trained
twice. The program is ``tests/commandprog.py`` (standard library only)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.run.ledger import ATTR_LINEAGE, ATTR_SEGMENTS

PROG = [sys.executable, "tests/commandprog.py"]


def _spec(name: str, command: list[str], space: dict[str, Any], search: dict[str, Any],
          **training: Any) -> dict[str, Any]:
    return {"study": {"name": name, "metric": "val_loss", "direction": "minimize"}, "space": space,
            "search": {"algorithm": "random", "max_concurrent": 1, "seed": 1, **search},
            "training": {"command": command, **training}, "resources": {"processes": 1}}


def _trained(run_dir: Path, number: int) -> list[int]:
    """The epochs the program trained in trial ``number``, over all its runs."""
    path = run_dir / "trials" / str(number) / "trained_rank0.txt"
    return [int(e) for e in path.read_text().split()] if path.exists() else []


def test_the_median_pruner_stops_a_program_that_only_prints(tmp_path: Path) -> None:
    # trial 0 (good, 3 epochs) completes; trial 1 (bad, 1000 slow epochs, never asks) is pruned at its first
    # report and, deaf to should_stop(), stopped by SIGTERM one second later
    data = _spec("median", [*PROG, "--x", "${x}", "--epochs", "${epochs}", "--sleep", "0.05"],
                 {"x": {"type": "float", "low": 0.0, "high": 1.0}, "epochs": {"type": "categorical",
                                                                            "choices": [3, 1000]}},
                 {"n_trials": 2, "enqueue": [{"x": 0.3, "epochs": 3}, {"x": 1.0, "epochs": 1000}],
                  "pruner": {"type": "median", "startup_trials": 1}}, stop_grace_s=1.0)
    study = optimize(data, tmp_path / "run").study
    good, bad = study.trials
    assert good.state == TrialState.COMPLETE and bad.state == TrialState.PRUNED
    assert len(_trained(tmp_path / "run", 1)) < 200  # not its 1000 epochs
    assert "SIGTERM" in (tmp_path / "run" / "trials" / "1" / "rank0.log").read_text()


def test_promotion_asha_pauses_a_program_and_resumes_it_from_its_checkpoint(tmp_path: Path) -> None:
    # one slot, the good configuration first: it pauses at rungs 1 and 2 (alone there), the bad ones join
    # the rungs, it is promoted from each and resumes after the epoch it saved
    xs = [0.3, 1.0, 1.0, 1.0]
    data = _spec("asha", [*PROG, "--x", "${x}", "--epochs", "4", "--report", "client", "--ask"],
                 {"x": {"type": "float", "low": 0.0, "high": 1.0}},
                 {"n_trials": 4, "enqueue": [{"x": x} for x in xs],
                  "scheduler": {"type": "asha", "min_resource": 1, "reduction_factor": 2}}, epochs=4)
    study = optimize(data, tmp_path / "run").study
    good = study.trials[0]
    assert good.state == TrialState.COMPLETE, [(t.number, t.state) for t in study.trials]
    assert [s["step"] for s in good.user_attrs[ATTR_SEGMENTS]] == [1, 2]  # paused at both rungs
    assert _trained(tmp_path / "run", 0) == [1, 2, 3, 4]  # every epoch once, over three runs
    assert {t.state for t in study.trials[1:]} == {TrialState.PRUNED}


def test_pbt_runs_a_population_of_a_program_interval_by_interval(tmp_path: Path) -> None:
    data = _spec("pbt", [*PROG, "--x", "${x}", "--epochs", "4", "--report", "client", "--ask"],
                 {"x": {"type": "float", "low": 0.0, "high": 1.0}},
                 {"n_trials": 6, "scheduler": {"type": "pbt", "population": 2, "interval": 2, "quantile": 0.5}},
                 epochs=4)
    study = optimize(data, tmp_path / "run").study
    trials = study.trials
    assert len(trials) == 4 and all(t.state == TrialState.COMPLETE for t in trials), \
        [(t.number, t.state) for t in trials]
    for t in trials:
        lineage = t.user_attrs[ATTR_LINEAGE]
        # each interval trains its own epochs once, from where its parent's checkpoint left off
        assert _trained(tmp_path / "run", t.number) == list(range(lineage["start"] + 1, lineage["end"] + 1)), lineage


def test_a_program_the_oom_killer_would_kill_is_rerun_from_its_checkpoint_up_to_max_retries(tmp_path: Path) -> None:
    # the program kills itself with SIGKILL after its first epoch on its first attempt (as the OOM killer or
    # a preemption would): a signal hpoflow did not send, so the trial is rerun, from the epoch it saved
    command = [*PROG, "--x", "${x}", "--epochs", "3", "--kill-attempts", "1"]
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    data = _spec("killed", command, space, {"n_trials": 1})
    data["resources"]["max_retries"] = 1
    trial = optimize(data, tmp_path / "retried").study.trials[0]
    assert trial.state == TrialState.COMPLETE, trial
    assert trial.user_attrs.get("attempts") == 2
    assert _trained(tmp_path / "retried", 0) == [1, 2, 3]  # epoch 1 on the killed attempt, then 2 and 3
    data["resources"]["max_retries"] = 0
    failed = optimize(data, tmp_path / "no-retries").study.trials[0]
    assert failed.state == TrialState.FAIL
    assert "killed by SIGKILL" in failed.user_attrs["error"]


def test_a_program_hpoflow_stops_for_a_timeout_is_not_rerun(tmp_path: Path) -> None:
    # resources.timeout: hpoflow kills the trial itself; the same configuration would run as long again
    data = _spec("timeout", [*PROG, "--x", "${x}", "--epochs", "1000", "--sleep", "0.05"],
                 {"x": {"type": "float", "low": 0.0, "high": 1.0}}, {"n_trials": 1})
    data["resources"].update(timeout=2, max_retries=2)
    trial = optimize(data, tmp_path / "run").study.trials[0]
    assert trial.state == TrialState.FAIL
    assert trial.user_attrs.get("attempts", 1) == 1
