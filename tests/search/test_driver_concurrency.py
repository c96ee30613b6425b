"""The driver's bookkeeping per trial stays flat as a study grows (bench/driver_concurrency.py at scale).

Timing a study on a shared 2-core machine is noise; counting is not. These tests count, per trial,
how often a trial's record is looked at (``FrozenTrial.user_attrs`` read: every pass hpoflow makes
over trials to find rungs, paused trials, PBT members or reruns reads it) and how often the whole
study is read (``get_trials``), in a small study and in one four times as long (promotion ASHA, the
median pruner, PBT), on the simulated engine (seeded sampler, virtual clock: the same events every
run). Work that grows with the study shows as a count per trial about four times higher in the long
one (2x to 4x before the driver's indexes); the bound allows 1.5x, for the few reads that grow
slowly. Optuna's own reads (its pruners' and samplers') are not counted: no ``user_attrs`` there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import FrozenTrial

from hpoflow.api import optimize
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.engine import SimulatedEngine
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.run.ledger import Tally
from hpoflow.run.storage import open_storage
from hpoflow.trial import TrialRequest

EPOCHS = 9
SLOTS = 8


def _cost(request: TrialRequest) -> TrialCost:
    """A curve that rises to x over the epochs (its ranks never change), 10 s per epoch."""
    x = float(request.params["x"])
    end = int(request.train.get("epochs") or EPOCHS)
    return TrialCost(10.0 * end, {"val_accuracy": x}, [{"val_accuracy": x * (e + 1) / EPOCHS} for e in range(end)])


def _spec(search: dict[str, Any], n_trials: int, epochs: int) -> dict[str, Any]:
    return {"study": {"name": "flat", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}, "y": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": SLOTS, "seed": 5, **search},
            "training": {"model": "mlp", "epochs": epochs}, "oracle": {"enabled": False}}


class _Counts:
    def __init__(self) -> None:
        self.records = 0  # FrozenTrial.user_attrs reads
        self.studies = 0  # Study.get_trials calls


def _per_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, search: dict[str, Any], n_trials: int,
               name: str, epochs: int = EPOCHS) -> tuple[float, float]:
    """(records looked at, whole-study reads) per finished trial of a study of ``n_trials``."""
    counts = _Counts()
    attrs: property = FrozenTrial.__dict__["user_attrs"]

    def read_attrs(self: FrozenTrial) -> dict[str, Any]:
        counts.records += 1
        return attrs.fget(self)  # type: ignore[misc]

    get_trials = optuna.Study.get_trials

    def read_study(self: optuna.Study, *args: Any, **kwargs: Any) -> list[FrozenTrial]:
        counts.studies += 1
        return get_trials(self, *args, **kwargs)

    engine = SimulatedEngine(SimulatedOptions.model_validate({"slots": SLOTS, "lognormal": {}}), cost=_cost)
    with monkeypatch.context() as m:
        m.setattr(FrozenTrial, "user_attrs", property(read_attrs, attrs.fset))
        m.setattr(optuna.Study, "get_trials", read_study)
        res = optimize(_spec(search, n_trials, epochs), tmp_path / name, engine=engine, handle_signals=False)
    s = res.summary
    done = s.n_complete + s.n_pruned + s.n_failed
    assert done == n_trials, s
    return counts.records / done, counts.studies / done


@pytest.mark.parametrize("search", [
    pytest.param({"scheduler": {"type": "asha", "reduction_factor": 3}}, id="promotion-asha"),
    pytest.param({"pruner": {"type": "median", "startup_trials": 5}}, id="median-pruner"),
])
def test_the_bookkeeping_per_trial_does_not_grow_with_the_study(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                search: dict[str, Any]) -> None:
    small = _per_trial(tmp_path, monkeypatch, search, 30, "small")
    large = _per_trial(tmp_path, monkeypatch, search, 120, "large")
    assert large[0] <= 1.5 * small[0], f"records looked at per trial: {small[0]:.1f} at 30, {large[0]:.1f} at 120"
    assert large[1] <= 1.5 * small[1], f"whole-study reads per trial: {small[1]:.2f} at 30, {large[1]:.2f} at 120"


def test_pbt_bookkeeping_per_interval_does_not_grow_with_the_study(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """PBT with a population of the slots, intervals of one epoch: 32 intervals, then 128 (the same members
    over more epochs)."""
    search = {"scheduler": {"type": "pbt", "population": SLOTS, "interval": 1}}
    small = _per_trial(tmp_path, monkeypatch, search, SLOTS * 4, "small", epochs=4)
    large = _per_trial(tmp_path, monkeypatch, search, SLOTS * 16, "large", epochs=16)
    assert large[0] <= 1.5 * small[0], f"records looked at per interval: {small[0]:.1f} at 32, {large[0]:.1f} at 128"
    assert large[1] <= 1.5 * small[1], f"whole-study reads per interval: {small[1]:.2f} at 32, {large[1]:.2f} at 128"


def test_a_watcher_of_the_tally_sees_an_attr_set_through_an_optuna_trial(tmp_path: Path) -> None:
    """``optuna.Trial.set_user_attr`` also writes into the record it read when it was asked (the journal's
    own, shared with later records until one changes the attrs): so the tally does not compare a record
    with the one of its last read, which may hold the new attrs already; a new record is a change."""
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="watched")
    tally = Tally()
    seen: list[tuple[int, dict[str, Any]]] = []
    tally.watch(lambda changed, gone: seen.extend((t.number, dict(t.user_attrs)) for t in changed))
    trial = study.ask()
    tally.refresh(study)
    trial.report(0.5, 1)
    trial.set_user_attr("member", 3)
    tally.refresh(study)
    assert seen == [(0, {}), (0, {"member": 3})]
    tally.refresh(study)
    assert len(seen) == 2  # nothing changed since
