"""``search.algorithm: auto`` (hpoflow.spec._auto): TPE, with the benchmark's winning pruner for trials of
several epochs; a pruner or scheduler the study names, and one-epoch trials, keep theirs."""

from __future__ import annotations

from typing import Any

from hpoflow.spec import StudySpec
from hpoflow.spec._auto import AUTO_PRUNER

BASE: dict[str, Any] = {"study": {"name": "a", "metric": "val_accuracy", "direction": "maximize"},
                        "space": {"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}}}


def _search(training: dict[str, Any], **search: Any) -> Any:
    return StudySpec.model_validate({**BASE, "training": training,
                                     "search": {"algorithm": "auto", "n_trials": 8, **search}}).search


def test_auto_is_tpe_with_the_winning_pruner_when_trials_train_epochs() -> None:
    s = _search({"model": "mlp", "epochs": 52}, sampler_options={"n_startup_trials": 3})
    assert s.algorithm == "tpe" and s.pruner.type == AUTO_PRUNER["type"] and s.sampler_options["n_startup_trials"] == 3
    assert _search({"function": "tests.trainfns_light:costly"}).pruner.type == AUTO_PRUNER["type"]  # epochs: 10


def test_auto_keeps_what_the_study_names_and_stops_nothing_of_one_epoch() -> None:
    assert _search({"model": "mlp", "epochs": 1}).pruner.type == "none"
    assert _search({"model": "mlp", "epochs": 20}, pruner={"type": "median"}).pruner.type == "median"
    s = _search({"model": "mlp", "epochs": 20}, scheduler={"type": "asha"})
    assert s.pruner.type == "none" and s.scheduler.type == "asha" and s.algorithm == "tpe"
