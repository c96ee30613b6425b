"""Energy over every run of a trial (hpoflow.run.energy, docs/energy.md): a paused-then-promoted trial's
energy (the figure objectives and constraints read) is the sum of its segments, and
``search.energy_budget_kwh`` and ``hpoflow status``'s ``energy_kwh`` count every run: paused segments,
retried attempts and cancelled runs too. The engines are the simulated one (pauses and promotions, on a
virtual clock) and the thread engine, each result given a measured energy here."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.engine import SimulatedEngine
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.engines.threads import Reporter, ThreadEngine
from hpoflow.report.tables import study_energy_kwh
from hpoflow.run.energy import ATTR_ENERGY_CARRIED, ATTR_ENERGY_SPENT, carried_energy, spent_j, trial_energy
from hpoflow.run.ledger import ATTR_SEGMENTS
from hpoflow.search.driver import Driver
from hpoflow.search.scheduling import carried
from hpoflow.spec import spec_from_mapping
from hpoflow.trial import Event, TrialRequest, TrialResult, TrialStatus

EPOCHS = 9
J_PER_KWH = 3.6e6


def _cost(request: TrialRequest) -> TrialCost:
    x = float(request.params["x"])
    curve = [{"val_accuracy": x * (e + 1) / EPOCHS} for e in range(EPOCHS)]
    return TrialCost(EPOCHS * 10.0, {"val_accuracy": x}, curve)


class _Metered(SimulatedEngine):
    """Each run's result carries a measured energy: ``paused_j`` for a run that ended in a pause, ``run_j``
    for one that ended its trial. ``runs``: the energies of each trial's runs, in order."""

    def __init__(self, paused_j: float, run_j: float) -> None:
        super().__init__(SimulatedOptions.model_validate({"slots": 2, "lognormal": {}}), cost=_cost)
        self.paused_j, self.run_j = paused_j, run_j
        self.runs: dict[int, list[float]] = {}

    def poll(self, timeout: float | None) -> list[Event]:
        out: list[Event] = []
        for ev in super().poll(timeout):
            if isinstance(ev, TrialResult):
                j = self.paused_j if (ev.error or "").startswith("paused") else self.run_j
                ev = replace(ev, system={**ev.system, "energy_j": j, "cpu_energy_j": j, "cpu_energy_share": 0.5})
                self.runs.setdefault(ev.number, []).append(j)
            out.append(ev)
        return out


def _asha(**search: Any) -> dict[str, Any]:
    return {"study": {"name": "runs", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 27, "max_concurrent": 2, "seed": 3,
                       "scheduler": {"type": "asha", "min_resource": 1, "reduction_factor": 3}, **search},
            "training": {"model": "mlp", "epochs": EPOCHS}, "oracle": {"enabled": False}}


def test_a_promoted_trial_s_energy_is_the_sum_of_its_segments(tmp_path: Path) -> None:
    engine = _Metered(paused_j=5.0, run_j=1.0)
    study = optimize(_asha(), tmp_path / "run", engine=engine).study
    trials = study.get_trials()
    promoted = [t for t in trials if t.user_attrs.get(ATTR_SEGMENTS) and "system" in t.user_attrs]
    assert promoted, "no trial paused and was later promoted"
    for t in promoted:
        runs = engine.runs[t.number]
        system = t.user_attrs["system"]
        assert len(runs) == len(t.user_attrs[ATTR_SEGMENTS]) + 1  # its segments, then the run that ended it
        assert system["energy_j"] == pytest.approx(sum(runs))  # not its last segment's 1 J
        assert system["cpu_energy_j"] == pytest.approx(sum(runs)) and system["energy_runs"] == len(runs)
        assert system["energy_spent_j"] == pytest.approx(sum(runs))
        assert system["cpu_energy_share"] == 0.5  # (a share is not added up)
    # what the study spent: every run, the segments of trials closed at a rung for good included
    assert study_energy_kwh(trials) == pytest.approx(sum(map(sum, engine.runs.values())) / J_PER_KWH)
    closed = [t for t in trials if t.user_attrs.get(ATTR_SEGMENTS) and "system" not in t.user_attrs]
    for t in closed:
        assert spent_j(t.user_attrs) == pytest.approx(sum(engine.runs[t.number]))


def test_the_budget_counts_paused_segments(tmp_path: Path) -> None:
    """Runs that pause use 1000 J, runs that end a trial 1 J: the budget of 2500 J is spent after three
    pauses, while the finished trials' own last runs would never reach it."""
    engine = _Metered(paused_j=1000.0, run_j=1.0)
    res = optimize(_asha(energy_budget_kwh=2500.0 / J_PER_KWH), tmp_path / "run", engine=engine)
    assert res.summary.stopped_by == "energy_budget", res.summary.reason
    assert "paused, retried and cancelled runs included" in (res.summary.reason or "")
    spent = sum(map(sum, engine.runs.values()))
    assert 2500.0 <= spent < 2500.0 + 2 * 1000.0 + 2  # the running ones finished past it, no more started
    assert len(res.study.get_trials()) < 27


def _thread_spec(**search: Any) -> Any:
    return spec_from_mapping(copy.deepcopy({
        "study": {"name": "runs", "metric": "score", "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": 4, "max_concurrent": 1, "seed": 7, **search},
        "training": {"function": "trainfns:counter"}, "resources": {"max_retries": 1}}))


class _FirstAttemptLost(ThreadEngine):
    """Trial 0's first attempt is lost after using ``lost_j`` (retryable); every other run uses 1 J."""

    def __init__(self, lost_j: float, status: TrialStatus = "failed") -> None:
        super().__init__(lambda p, r: p["x"], slots=1)
        self.lost_j, self.status = lost_j, status

    def _run(self, request: TrialRequest, reporter: Reporter) -> None:
        if request.number == 0 and request.attempt == 0:
            self._events.put(TrialResult(0, self.status, error="worker lost" if self.status == "failed"
                                         else "interrupted: killed", retryable=self.status == "failed",
                                         system={"energy_j": self.lost_j}))
            return
        super()._run(request, reporter)

    def poll(self, timeout: float | None) -> list[Event]:
        return [replace(ev, system={"energy_j": 1.0, **ev.system}) if isinstance(ev, TrialResult) else ev
                for ev in super().poll(timeout)]


def test_a_retried_attempt_counts_in_the_budget_not_in_the_trial_s_energy(tmp_path: Path) -> None:
    study = optuna.create_study(direction="maximize")
    engine = _FirstAttemptLost(lost_j=100.0)
    driver = Driver(_thread_spec(), study, engine, tmp_path)
    driver.run()
    engine.close()
    t0 = study.trials[0]
    assert t0.state == TrialState.COMPLETE and t0.user_attrs["attempts"] == 2
    assert t0.user_attrs["system"]["energy_j"] == 1.0  # the configuration's run: a lost worker is no part of it
    assert t0.user_attrs["system"]["energy_spent_j"] == 101.0 and t0.user_attrs[ATTR_ENERGY_SPENT] == 100.0
    assert study_energy_kwh(study.trials) == pytest.approx((100.0 + 4 * 1.0) / J_PER_KWH)


def test_a_cancelled_run_counts_in_the_budget(tmp_path: Path) -> None:
    """Trial 0's run is interrupted (rerun as a new trial) after 500 J: a budget of 400 J is spent, so no
    other trial starts."""
    study = optuna.create_study(direction="maximize")
    engine = _FirstAttemptLost(lost_j=500.0, status="cancelled")
    driver = Driver(_thread_spec(energy_budget_kwh=400.0 / J_PER_KWH), study, engine, tmp_path)
    summary = driver.run()
    engine.close()
    assert summary.stopped_by == "energy_budget", summary.reason
    assert [t.state for t in study.trials] == [TrialState.FAIL, TrialState.WAITING]  # the rerun is left queued
    assert study_energy_kwh(study.trials) == pytest.approx(500.0 / J_PER_KWH)


def test_a_resumed_driver_counts_what_closed_and_interrupted_trials_spent(tmp_path: Path) -> None:
    """A new driver on the study (a resume, another host) counts from the storage: a trial closed at a rung
    for good (pruned with no run of its own, its segments' ``ATTR_ENERGY_SPENT`` only) and an interrupted
    trial's recorded run (a trial that does not count)."""
    study = optuna.create_study(direction="maximize")
    x: dict[str, optuna.distributions.BaseDistribution] = {"x": optuna.distributions.FloatDistribution(0.0, 1.0)}
    closed = study.ask(x)
    closed.set_user_attr(ATTR_ENERGY_SPENT, 300.0)
    closed.set_user_attr(ATTR_SEGMENTS, [{"step": 1, "outcome": "paused", "energy": {"energy_j": 300.0}}])
    study.tell(closed, state=TrialState.PRUNED)
    gone = study.ask(x)
    gone.set_user_attr("system", {"energy_j": 200.0, "energy_spent_j": 200.0})
    study.enqueue_trial({"x": 0.5}, user_attrs={"hpoflow_replaces": gone.number}, skip_if_exists=False)
    study.tell(gone, state=TrialState.FAIL)
    engine = ThreadEngine(lambda p, r: p["x"], slots=1)
    summary = Driver(_thread_spec(energy_budget_kwh=450.0 / J_PER_KWH), study, engine, tmp_path).run()
    engine.close()
    assert summary.stopped_by == "energy_budget", summary.reason  # 500 J spent before it started anything
    assert len(study.trials) == 3 and study.trials[2].state == TrialState.WAITING


def test_sums_keep_only_figures_every_run_has_and_reruns_carry_their_segments() -> None:
    attrs = {ATTR_SEGMENTS: [{"step": 1, "energy": {"energy_j": 5.0, "gpu_energy_j": 3.0}},
                             {"step": 3, "energy": {"energy_j": 7.0}}],  # its GPU counter was unreadable then
             ATTR_ENERGY_SPENT: 12.0}
    last = {"energy_j": 2.0, "gpu_energy_j": 1.0, "gpu_energy_share": 1.0, "cpu_percent": 50.0}
    out = trial_energy(last, attrs)
    assert out == {"energy_j": 14.0, "gpu_energy_share": 1.0, "cpu_percent": 50.0, "energy_runs": 3,
                   "energy_spent_j": 14.0}  # no GPU total: one segment did not measure it
    assert trial_energy({"cpu_percent": 50.0}, {}) == {"cpu_percent": 50.0}  # nothing measured: as it was
    # a rerun of that trial resumes from its segments' checkpoints: it carries their figures
    assert carried_energy(attrs) == {ATTR_ENERGY_CARRIED: {"energy_j": 12.0, "runs": 2}}
    rerun = carried({**attrs, "hpoflow_rungs": {"1": 0.5}})
    assert rerun == {"hpoflow_rungs": {"1": 0.5}, ATTR_ENERGY_CARRIED: {"energy_j": 12.0, "runs": 2}}
    own = trial_energy({"energy_j": 4.0}, rerun)
    assert own == {"energy_j": 16.0, "energy_runs": 3, "energy_spent_j": 4.0}  # its spending is its own run
    assert spent_j({"system": own}) == 4.0
    assert spent_j({"system": {"energy_j": 9.0}}) == 9.0  # recorded before energy_spent_j
    assert spent_j({"hpoflow_warm_start": "other#3", "system": {"energy_j": 9.0}}) is None  # not run here
