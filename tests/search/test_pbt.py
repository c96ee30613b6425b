"""Population-based training (search.scheduler: {type: pbt}) on the simulated engine: intervals as trials,
lineage in the storage, exploit from a copied (virtual) checkpoint, explore within the space, exact budget,
no epoch trained twice."""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from optuna.trial import FrozenTrial, TrialState

from hpoflow.api import optimize
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.engine import SimulatedEngine
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.errors import SpecError, StudyTaken
from hpoflow.run.claims import Claims
from hpoflow.run.ledger import ATTR_LINEAGE, is_counted
from hpoflow.run.shared import SharedStudy
from hpoflow.search.options import PbtSchedulerOptions
from hpoflow.search.pbt import PbtPolicy, PbtScheduling, explore_pbt, fit
from hpoflow.spec import FloatParam, IntParam, Param, TrainConfig, spec_from_mapping
from hpoflow.trial import TrialRequest
from tests.conftest import ROOT

EPOCHS = 8
EPOCH_S = 10.0


def _cost(request: TrialRequest) -> TrialCost:
    """val_accuracy after epoch e (1-based) is x * e / EPOCHS, so the ranks never change; the trial's
    curve is as long as its ``training.epochs`` (the interval's end)."""
    x = float(request.params["x"])
    end = int(request.train["epochs"])
    curve = [{"val_accuracy": x * (e + 1) / EPOCHS} for e in range(end)]
    return TrialCost(end * EPOCH_S, dict(curve[-1]), curve)


def _spec(n_trials: int, **pbt: Any) -> dict[str, Any]:
    return {"study": {"name": "pbt", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0},
                      "lr": {"type": "float", "low": 1e-4, "high": 1e-1, "log": True},
                      "units": {"type": "int", "low": 8, "high": 64, "step": 8}},
            "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": 2, "seed": 5,
                       "scheduler": {"type": "pbt", "population": 4, "interval": 2, "quantile": 0.25,
                                     "hyperparams": ["x", "lr", "units"], **pbt}},
            "training": {"model": "mlp", "epochs": EPOCHS}, "oracle": {"enabled": False}}


def _engine() -> SimulatedEngine:
    return SimulatedEngine(SimulatedOptions.model_validate({"slots": 2, "lognormal": {}}), cost=_cost)


def _lineage(t: FrozenTrial) -> dict[str, Any]:
    lin = t.user_attrs[ATTR_LINEAGE]
    assert isinstance(lin, dict)
    return lin


def _check_lineage(trials: list[FrozenTrial]) -> list[FrozenTrial]:
    """Every counted trial is a member interval with a complete chain; returns the complete ones."""
    counted = is_counted(trials)
    done = [t for t in trials if counted(t) and t.state == TrialState.COMPLETE]
    by = {t.number: t for t in done}
    seen = set()
    for t in done:
        lin = _lineage(t)
        assert set(lin) == {"member", "interval", "parent", "donor", "start", "end", "seed"}
        key = (lin["member"], lin["interval"])
        assert key not in seen  # every (member, interval) once
        seen.add(key)
        assert lin["end"] - lin["start"] == 2 or lin["end"] == EPOCHS
        if lin["interval"] == 0:
            assert lin["parent"] is None and lin["start"] == 0
        else:
            parent = by[lin["parent"]]  # the parent is complete, and this trial starts where it ended
            assert _lineage(parent)["end"] == lin["start"]
            assert lin["seed"] == _lineage(parent)["seed"]
            assert lin["donor"] in (None, lin["parent"])
            if lin["donor"] is None:
                assert _lineage(parent)["member"] == lin["member"] and t.params == parent.params
        # no epoch trained twice: the trial reports only the epochs of its interval (the simulated engine
        # reports every epoch but the last), and its virtual duration is the interval's
        assert set(t.intermediate_values) <= set(range(lin["start"] + 1, lin["end"] + 1))
        assert min(t.intermediate_values, default=lin["start"] + 1) == lin["start"] + 1
        assert t.user_attrs["timings"]["duration_s"] == pytest.approx((lin["end"] - lin["start"]) * EPOCH_S)
    for m in {k[0] for k in seen}:  # a member's intervals are 0..k without a gap
        got = sorted(i for mm, i in seen if mm == m)
        assert got == list(range(len(got)))
    return done


def test_pbt_runs_members_in_intervals_with_exploits_and_a_complete_lineage(tmp_path: Path) -> None:
    res = optimize(_spec(100), tmp_path / "run", engine=_engine())
    trials = res.study.get_trials()
    done = _check_lineage(trials)
    assert res.summary.n_trials == 16  # population 4 x ceil(8 / 2) intervals: n_trials caps at that
    assert len({_lineage(t)["member"] for t in done}) == 4
    exploits = [t for t in done if _lineage(t)["donor"] is not None]
    assert exploits, "no member exploited another"
    by = {t.number: t for t in trials}
    for t in exploits:
        donor = by[_lineage(t)["donor"]]
        assert _lineage(donor)["member"] != _lineage(t)["member"]
        # explored within the space: x in [0, 1], lr in [1e-4, 1e-1], units a multiple of 8 in [8, 64]
        assert 0.0 <= t.params["x"] <= 1.0 and 1e-4 <= t.params["lr"] <= 1e-1
        assert t.params["units"] in range(8, 65, 8)
    # the first 4 trials are the sampled roots; every member reaches the last epoch
    assert sorted(_lineage(by[n])["interval"] for n in range(4)) == [0, 0, 0, 0]
    ends: dict[int, int] = {}
    for t in done:
        lin = _lineage(t)
        ends[lin["member"]] = max(ends.get(lin["member"], 0), lin["end"])
    assert set(ends.values()) == {EPOCHS}
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_pbt_n_trials_is_exact_below_population_times_intervals(tmp_path: Path) -> None:
    res = optimize(_spec(10), tmp_path / "run", engine=_engine())
    trials = res.study.get_trials()
    done = _check_lineage(trials)
    assert len(done) == 10 and res.summary.n_complete == 10
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]


def test_a_rerun_of_the_same_command_adds_nothing_to_a_finished_pbt_study(tmp_path: Path) -> None:
    from hpoflow.report.tables import status_dict
    from hpoflow.run.open import run_budget

    optimize(_spec(100), tmp_path / "run", engine=_engine())
    res = optimize(_spec(100), tmp_path / "run", engine=_engine())
    assert res.summary.n_complete == 16 and not res.summary.results
    # status and report show the budget the population allows (4 members x 8 epochs / 2), not n_trials
    assert run_budget(tmp_path / "run") == 16 == res.summary.n_trials
    assert status_dict(res.study, "journal", budget=run_budget(tmp_path / "run"))["n_trials"] == 16


def test_pbt_explore_perturbs_or_resamples_within_the_space() -> None:
    policy = PbtPolicy(PbtSchedulerOptions(resample_probability=0.0, perturb=[2.0]), "maximize")
    space: dict[str, Param] = {"lr": FloatParam(type="float", low=1e-4, high=1e-1, log=True),
             "units": IntParam(type="int", low=8, high=64, step=8), "m": FloatParam(type="float", low=0.0, high=0.9)}
    out = explore_pbt(policy, space, ["lr", "units", "m"], {"lr": 0.08, "units": 24, "m": 0.3},
                      np.random.default_rng(0))
    assert out == {"lr": 0.1, "units": 48, "m": 0.6}  # x2, clipped to the bound; an int stays on its step
    policy = PbtPolicy(PbtSchedulerOptions(resample_probability=1.0), "maximize")
    rng = np.random.default_rng(1)
    for _ in range(50):
        out = explore_pbt(policy, space, ["lr", "units"], {"lr": 0.01, "units": 8}, rng)
        assert 1e-4 <= out["lr"] <= 1e-1 and out["units"] in range(8, 65, 8)
    assert fit(space["units"], 13.9) == 16 and fit(space["m"], -1.0) == 0.0
    assert math.isclose(fit(space["lr"], 5.0), 0.1)


def test_pbt_quantiles_follow_ray_tunes_rule() -> None:
    policy = PbtPolicy(PbtSchedulerOptions(quantile=0.25), "minimize")
    top, bottom = policy.split({0: 0.5, 1: 0.1, 2: 0.9, 3: 0.3, 4: 0.7})
    assert top == [1, 3] and bottom == [4, 2]  # ceil(5 x 0.25) = 2 each, lower is better
    assert policy.split({0: 1.0}) == ([], [])


@pytest.mark.parametrize(("options", "key"), [({"quantile": 0.75}, "search.scheduler.quantile"),
                                              ({"population": 1}, "search.scheduler.population"),
                                              ({"explore": "bo"}, "search.scheduler.explore"),
                                              ({"hyperparams": ["nope"]}, "search.scheduler.hyperparams")])
def test_bad_pbt_options_are_one_line_naming_the_key(options: dict[str, Any], key: str) -> None:
    spec = _spec(10)
    spec["search"]["scheduler"] = {"type": "pbt", **options}
    with pytest.raises(SpecError) as err:
        spec_from_mapping(spec)
    assert key in str(err.value)


@pytest.mark.parametrize(("training", "at"), [
    ({"model_options": {"hidden": "${units}"}}, "training.model_options.hidden"),
    ({"schedule": {"lr": [[0, "${lr}"]]}}, "training.schedule.lr.0.1"),
    ({"batch_size": "${units}"}, "training.batch_size"),
])
def test_an_explored_parameter_only_feeds_what_a_resume_may_change_at_any_depth(training: dict[str, Any],
                                                                                  at: str) -> None:
    """A nested ``${param}`` used to validate, and then every explored interval failed in the built-in
    trainer's checkpoint restore (its fingerprint covers model_options)."""
    spec = _spec(10)
    spec["training"].update(training)
    with pytest.raises(SpecError) as err:
        spec_from_mapping(spec)
    assert f"{at}: PBT changes" in str(err.value) and "Fix: list search.scheduler.hyperparams without" in str(
        err.value)
    spec["search"]["scheduler"]["hyperparams"] = ["x"]  # not explored: each member keeps its value
    spec_from_mapping(spec)


def test_validate_names_the_nested_placeholder_pbt_would_change(tmp_path: Path) -> None:
    spec = _spec(10)
    spec["training"]["model_options"] = {"hidden": "${units}"}
    path = tmp_path / "pbt.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(path)], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (issue,) = [line for line in r.stderr.splitlines() if "PBT changes" in line]
    assert "training.model_options.hidden: PBT changes 'units'" in issue and f"{path}:" in issue


@pytest.mark.skipif(importlib.util.find_spec("hpoflow.search.pb2") is not None, reason="PB2's explore step is here")
def test_explore_pb2_without_its_module_is_one_line_before_anything_is_written(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as err:
        optimize(_spec(10, explore="pb2"), tmp_path / "run", engine=_engine())
    assert "search.scheduler.explore" in str(err.value) and "Fix: use explore: pbt" in str(err.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("schedule", "words"), [({"lrr": [[0, 0.1]]}, "changes only lr, momentum, weight_decay"),
                                                 ({"lr": [[1, 0.1]]}, "epochs increasing from 0"),
                                                 ({"lr": [[0, 0.1], [0, 0.2]]}, "epochs increasing from 0"),
                                                 ({"momentum": [[0, 1.5]]}, "must be in [0, 1)"),
                                                 ({"lr": [[0, 0.0]]}, "must be > 0")])
def test_a_bad_training_schedule_is_one_line_naming_it(schedule: dict[str, Any], words: str) -> None:
    spec = _spec(10)
    spec["search"]["scheduler"] = {"type": "none"}
    spec["training"]["schedule"] = schedule
    with pytest.raises(SpecError) as err:
        spec_from_mapping(spec)
    assert "training.schedule" in str(err.value) and words in str(err.value)


def test_the_fingerprint_lets_a_resume_change_only_what_a_schedule_may() -> None:
    from hpoflow.train.builtin import at_epoch, config_fingerprint

    cfg = TrainConfig(lr=0.1, momentum=0.5, schedule={"lr": [(0, 0.1), (3, 0.05)]})
    assert config_fingerprint(cfg) == config_fingerprint(cfg.model_copy(update={"lr": 0.2, "momentum": 0.9,
                                                                                 "epochs": 3, "schedule": {}}))
    assert config_fingerprint(cfg) != config_fingerprint(cfg.model_copy(update={"batch_size": 16}))
    assert at_epoch(cfg, 2).lr == 0.1 and at_epoch(cfg, 3).lr == 0.05 and at_epoch(cfg, 9).momentum == 0.5


def test_a_second_driver_is_refused_while_one_owns_the_pbt_study(tmp_path: Path) -> None:
    """Two drivers could both enqueue a member's next interval: a PBT study has one owner (a claim in the
    storage, made before a driver does anything else); a driver does not join while the owner runs, and
    says so in one line; once that driver ended, the next one takes the study over and resumes."""
    storage = str(tmp_path / "shared.journal")
    first = optimize(_spec(6) | {"storage": storage}, tmp_path / "first", engine=_engine())
    owner = SharedStudy(first.study, tmp_path / "other", lease_s=60.0, pbt=True)  # a live driver of this process
    owner.lease.start()
    PbtScheduling(spec_from_mapping(_spec(10)), first.study, owner, tmp_path / "other").own()
    try:
        with pytest.raises(StudyTaken, match=r"pbt runs with one driver per study, and driver .* is running") as e:
            optimize(_spec(10) | {"storage": storage}, tmp_path / "second", engine=_engine())
        assert "\n" not in str(e.value) and owner.lease.id not in str(e.value)  # named by host:pid and run dir
    finally:
        owner.lease.end()
    res = optimize(_spec(10) | {"storage": storage}, tmp_path / "second", engine=_engine())
    assert res.summary.n_complete == 10 and len(res.summary.results) == 4  # the first driver's 6 count
    assert len(_check_lineage(res.study.get_trials())) == 10
    epochs = sorted(Claims(res.study).holders("pbt-owner:"))
    assert epochs == ["pbt-owner:0", "pbt-owner:1", "pbt-owner:2"]  # first, the live one, the resume


def test_a_spec_without_the_scheduler_is_refused_on_a_pbt_study(tmp_path: Path) -> None:
    """The same spec without its scheduler would take PBT's queued intervals and train them from scratch:
    refused before it asks anything, in one line, with exit 2, and the study is untouched."""
    storage = str(tmp_path / "shared.journal")
    first = optimize(_spec(6) | {"storage": storage}, tmp_path / "first", engine=_engine())
    before = [(t.number, t.state) for t in first.study.get_trials()]
    plain = _spec(10) | {"storage": storage, "engine": "simulated", "engine_options": {"slots": 2, "lognormal": {}}}
    del plain["search"]["scheduler"]
    spec = tmp_path / "plain.yaml"
    spec.write_text(yaml.safe_dump(plain))
    r = subprocess.run([sys.executable, "-m", "hpoflow", "run", str(spec), "--run-dir", str(tmp_path / "plain")],
                       capture_output=True, text=True, timeout=300, cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    refusal = 'search.scheduler.type (the study: "pbt", this spec: "none")'  # the study's recorded spec
    assert len(lines) == 1 and refusal in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert [(t.number, t.state) for t in first.study.get_trials()] == before
