"""``search.algorithm: auto`` (hpoflow.spec._auto): the benchmark's winning arm: the GP with the ASHA pruner
(fitted per budget, Thompson sampling) for trials of several epochs, one at a time or many at once; the GP
alone for one-epoch trials; a pruner or scheduler the study names is kept."""

from __future__ import annotations

from typing import Any

from hpoflow.search.bohb import BOHBSampler
from hpoflow.search.gp_parallel import ThompsonGPSampler
from hpoflow.search.history import ViewedSampler
from hpoflow.search.samplers import make_sampler
from hpoflow.spec import StudySpec
from hpoflow.spec._auto import AUTO_ALGORITHM, AUTO_PRUNER

BASE: dict[str, Any] = {"study": {"name": "a", "metric": "val_accuracy", "direction": "maximize"},
                        "space": {"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}}}


def _search(training: dict[str, Any], **search: Any) -> Any:
    return StudySpec.model_validate({**BASE, "training": training, "search": {
        "algorithm": "auto", "n_trials": 8, "max_concurrent": 4, **search}}).search


def test_auto_is_the_gp_per_budget_with_the_asha_pruner_one_at_a_time_and_many_at_once() -> None:
    assert (AUTO_ALGORITHM, AUTO_PRUNER["type"]) == ("gp", "asha")  # docs/search.md's tables say why
    for at_once in (1, 4, 1024):
        s = _search({"model": "mlp", "epochs": 52}, max_concurrent=at_once, sampler_options={"n_startup_trials": 4})
        assert (s.algorithm, s.pruner.type, s.sampler_options["n_startup_trials"]) == ("gp", "asha", 4)
        sampler = make_sampler(s)
        assert isinstance(sampler, BOHBSampler) and sampler._random_fraction == 0.0  # fitted per budget
        assert isinstance(sampler._model, ThompsonGPSampler) and sampler._min_evaluations == 4, at_once
    s = _search({"function": "tests.trainfns_light:costly"})  # epochs: 10
    assert (s.algorithm, s.pruner.type) == ("gp", "asha")


def test_auto_keeps_what_the_study_names_and_stops_nothing_of_one_epoch() -> None:
    one = _search({"model": "mlp", "epochs": 1}, max_concurrent=1, sampler_options={"n_startup_trials": 3})
    assert (one.algorithm, one.pruner.type) == ("gp", "none")
    sampler = make_sampler(one)
    assert isinstance(sampler, ViewedSampler) and not isinstance(sampler.inner, ThompsonGPSampler)  # Optuna's GP
    assert _search({"model": "mlp", "epochs": 20}, pruner={"type": "median"}).pruner.type == "median"
    s = _search({"model": "mlp", "epochs": 20}, scheduler={"type": "asha"})
    assert s.pruner.type == "none" and s.scheduler.type == "asha" and s.algorithm == AUTO_ALGORITHM
