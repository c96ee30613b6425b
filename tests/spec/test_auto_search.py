"""``search.algorithm: auto`` (hpoflow.spec._auto): the benchmark's winning arms: GP one trial at a time;
with trials at once, TPE fitted per budget with the ASHA pruner for trials of several epochs, TPE for
one-epoch trials; a pruner or scheduler the study names is kept."""

from __future__ import annotations

from typing import Any

from hpoflow.search.bohb import BOHBSampler
from hpoflow.search.samplers import make_sampler
from hpoflow.spec import StudySpec
from hpoflow.spec._auto import AUTO_ALGORITHM, AUTO_ONE_AT_A_TIME, AUTO_PRUNER

BASE: dict[str, Any] = {"study": {"name": "a", "metric": "val_accuracy", "direction": "maximize"},
                        "space": {"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}}}


def _search(training: dict[str, Any], **search: Any) -> Any:
    return StudySpec.model_validate({**BASE, "training": training, "search": {
        "algorithm": "auto", "n_trials": 8, "max_concurrent": 4, **search}}).search


def test_auto_is_gp_one_trial_at_a_time() -> None:
    for training in ({"model": "mlp", "epochs": 52}, {"model": "mlp", "epochs": 1}):
        s = _search(training, max_concurrent=1, sampler_options={"n_startup_trials": 4})
        assert (s.algorithm, s.pruner.type, s.sampler_options["n_startup_trials"]) == (AUTO_ONE_AT_A_TIME, "none", 4)
    assert AUTO_ONE_AT_A_TIME == "gp"  # docs/search.md's table says why


def test_auto_is_the_winning_arm_of_those_that_stop_early_when_trials_run_at_once() -> None:
    s = _search({"model": "mlp", "epochs": 52}, sampler_options={"n_ei_candidates": 32})
    assert (s.algorithm, s.pruner.type, s.sampler_options["n_ei_candidates"]) == (AUTO_ALGORITHM,
                                                                                  AUTO_PRUNER["type"], 32)
    assert (AUTO_ALGORITHM, AUTO_PRUNER["type"]) == ("tpe", "asha")  # docs/search.md's table says why
    sampler = make_sampler(s)
    assert isinstance(sampler, BOHBSampler) and sampler._random_fraction == 0.0  # fitted per budget
    s = _search({"function": "tests.trainfns_light:costly"})  # epochs: 10
    assert (s.algorithm, s.pruner.type) == (AUTO_ALGORITHM, AUTO_PRUNER["type"])


def test_auto_keeps_what_the_study_names_and_stops_nothing_of_one_epoch() -> None:
    one = _search({"model": "mlp", "epochs": 1}, sampler_options={"n_startup_trials": 3})
    assert (one.algorithm, one.pruner.type) == ("tpe", "none")
    assert _search({"model": "mlp", "epochs": 20}, pruner={"type": "median"}).pruner.type == "median"
    s = _search({"model": "mlp", "epochs": 20}, scheduler={"type": "asha"})
    assert s.pruner.type == "none" and s.scheduler.type == "asha" and s.algorithm == AUTO_ALGORITHM
