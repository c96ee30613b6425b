"""The simulated engine: the real driver, sampler, pruner and journal on a virtual clock."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import hpoflow
from hpoflow.engines import TrialReport, TrialRequest, TrialResult
from hpoflow.engines.elastic import Candidate, longest_remaining, most_promising, speedup
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.engine import SimulatedEngine
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.errors import SpecError
from hpoflow.spec import TrainConfig, spec_from_mapping


def _spec(n: int, slots: int, **search: Any) -> dict[str, Any]:
    return {"study": {"name": "sim", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": slots, "seed": 0, **search},
            "training": {"model": "cnn", "epochs": 10}, "oracle": {"enabled": False}}


def _engine(slots: int, **opts: Any) -> SimulatedEngine:
    return SimulatedEngine(SimulatedOptions.model_validate({"slots": slots, **opts}))


def _req(number: int, processes: int = 1) -> TrialRequest:
    return TrialRequest(number, {}, {}, "val_accuracy", "maximize", "", processes=processes)


def test_known_durations_on_two_slots_give_the_asynchronous_schedule() -> None:
    durations = [3.0, 1.0, 2.0, 2.0]
    eng = SimulatedEngine(SimulatedOptions.model_validate({"slots": 2, "lognormal": {}}),
                          cost=lambda r: TrialCost(durations[r.number], {"val_accuracy": 0.5}))
    ends: dict[int, float] = {}
    eng.submit(_req(0))
    eng.submit(_req(1))
    nxt = 2
    while len(ends) < 4:
        for ev in eng.poll(None):
            assert isinstance(ev, TrialResult) and ev.status == "complete"
            ends[ev.number] = ev.timings["started_at"] - eng.epoch_wall + ev.timings["duration_s"]
            if nxt < 4:  # a freed slot is refilled at once, as the driver does
                eng.submit(_req(nxt))
                nxt += 1
    # slot A: trial 0 (0-3); slot B: 1 (0-1), 2 (1-3); then 3 on whichever freed first at t=3 (3-5)
    assert ends == {0: 3.0, 1: 1.0, 2: 3.0, 3: 5.0}
    assert eng.stats()["makespan_s"] == 5.0
    assert eng.stats()["busy"] == pytest.approx(sum(durations) / (2 * 5.0))


def test_a_study_runs_end_to_end_with_virtual_timings_and_the_usual_outputs(tmp_path: Path) -> None:
    eng = _engine(16, lognormal={"median_s": 60.0, "sigma": 1.0, "seed": 1})
    res = hpoflow.optimize(_spec(100, 16), tmp_path / "run", engine=eng)
    assert res.summary.n_complete == 100 and res.summary.exit_code == 0
    stats = eng.stats()
    assert stats["makespan_s"] > 60.0 * 100 / 16 / 3  # virtual hours, not the seconds it took
    assert 0.0 < stats["busy"] <= 1.0
    rows = (tmp_path / "run" / "trials.csv").read_text().splitlines()
    assert len(rows) == 101 and "timing_started_at" in rows[0]
    result = json.loads((tmp_path / "run" / "trials" / "0" / "result.json").read_text())
    assert result["timings"]["duration_s"] > 0 and result["status"] == "complete"


def test_pruning_sees_learning_curves_and_frees_slots_early(tmp_path: Path) -> None:
    eng = _engine(8, lognormal={"median_s": 60.0, "sigma": 0.5, "seed": 2}, epochs=10)
    spec = _spec(60, 8, pruner={"type": "median", "startup_trials": 5, "warmup_steps": 1})
    res = hpoflow.optimize(spec, tmp_path / "run", engine=eng)
    assert res.summary.n_pruned > 0 and res.summary.n_complete + res.summary.n_pruned == 60
    pruned = [t for t in res.study.trials if t.state.name == "PRUNED"]
    assert all(t.intermediate_values and max(t.intermediate_values) < 10 for t in pruned)


def test_idle_slots_in_the_drain_tail_go_to_elastic_trials(tmp_path: Path) -> None:
    base = {"lognormal": {"median_s": 60.0, "sigma": 1.0, "seed": 0}}
    fixed = _engine(16, **base)
    hpoflow.optimize(_spec(200, 16), tmp_path / "fixed", engine=fixed)
    grown = _engine(16, **base, elastic={"policy": "longest_remaining", "max_slots": 16, "efficiency": 0.9})
    hpoflow.optimize(_spec(200, 16), tmp_path / "elastic", engine=grown)
    f, g = fixed.stats(), grown.stats()
    assert g["resizes"] > 0 and f["resizes"] == 0
    assert g["busy"] > f["busy"] and g["makespan_s"] < f["makespan_s"]


def test_a_new_trial_takes_lent_slots_back_at_once() -> None:
    eng = SimulatedEngine(SimulatedOptions.model_validate({"slots": 4, "lognormal": {}, "elastic": {
        "policy": "fifo", "max_slots": 4}}), cost=lambda r: TrialCost(100.0, {"val_accuracy": 1.0}, [
            {"val_accuracy": 0.1 * k} for k in range(1, 11)]))
    eng.submit(_req(0))
    events = eng.poll(None)  # idle slots lent to trial 0; it takes them at its first epoch boundary
    assert isinstance(events[0], TrialReport) and events[0].step == 1
    assert eng._running[0].slots == 4
    for n in (1, 2, 3):  # new trials reclaim a slot each, immediately
        eng.submit(_req(n))
    assert eng._running[0].slots == 1 and sum(s.slots for s in eng._running.values()) == 4


def test_replay_reads_a_recorded_run(tmp_path: Path) -> None:
    for n, d in enumerate([0.5, 1.5]):
        p = tmp_path / "old" / "trials" / str(n)
        p.mkdir(parents=True)
        (p / "result.json").write_text(json.dumps({"number": n, "status": "complete", "value": 0.1 * n,
                                                   "metrics": {}, "timings": {"duration_s": d}}))
    eng = _engine(1, replay=str(tmp_path / "old"))
    res = hpoflow.optimize(_spec(4, 1), tmp_path / "new", engine=eng)
    assert res.summary.n_complete == 4
    assert eng.stats()["makespan_s"] == pytest.approx(0.5 + 1.5 + 0.5 + 1.5)


def test_simulated_options_are_checked_at_validate_time() -> None:
    spec = _spec(4, 2)
    with pytest.raises(SpecError, match="exactly one cost model"):
        spec_from_mapping({**spec, "engine": "simulated", "engine_options": {"slots": 4}})
    with pytest.raises(SpecError, match="elastic policy"):
        spec_from_mapping({**spec, "engine": "simulated", "engine_options": {
            "lognormal": {}, "elastic": {"policy": "biggest"}}})
    ok = spec_from_mapping({**spec, "engine": "simulated", "engine_options": {"slots": 4096, "lognormal": {}}})
    assert ok.engine == "simulated"


def test_policies_and_the_scaling_curve() -> None:
    cands = [Candidate(0, 1, 8, 10.0, 0.0, 0.9), Candidate(1, 1, 8, 50.0, 1.0, 0.2),
             Candidate(2, 1, 8, 30.0, 2.0, None)]
    assert [c.number for c in longest_remaining(cands, "maximize")] == [1, 2, 0]
    assert [c.number for c in most_promising(cands, "maximize")] == [0, 1, 2]
    assert [c.number for c in most_promising(cands, "minimize")] == [1, 0, 2]
    assert speedup(1) == 1.0 and speedup(2, efficiency=0.9) == pytest.approx(1.8)
    assert speedup(2, [1.0, 1.6]) == 1.6 and 1.6 < speedup(4, [1.0, 1.6]) < 3.2


def test_a_user_cost_function_sets_durations_values_and_curves(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.conftest import ROOT

    monkeypatch.syspath_prepend(str(ROOT / "tests"))
    spec = {**_spec(8, 2), "engine": "simulated",
            "engine_options": {"slots": 2, "function": "trainfns_light:sim_cost"}}
    res = hpoflow.optimize(spec, tmp_path / "run")
    assert res.summary.n_complete == 8
    for t in res.study.trials:
        x = t.params["x"]
        assert t.value == pytest.approx(1.0 - x)
        assert t.user_attrs["timings"]["duration_s"] == pytest.approx(10.0 + 100.0 * x)
        assert sorted(t.intermediate_values) == [1, 2, 3]  # the last epoch is the final value


def test_the_oracle_cost_model_gives_each_trial_the_predicted_time_to_train(tmp_path: Path) -> None:
    from hpoflow.oracle.cluster import load_cluster
    from hpoflow.oracle.feasibility import check_trial

    spec = {**_spec(6, 2), "space": {"batch_size": {"type": "categorical", "choices": [32, 128]}},
            "training": {"model": "cnn", "dataset": "digits", "epochs": 4, "batch_size": "${batch_size}"}}
    eng = _engine(2, cost={"type": "oracle", "cluster": "p100-cluster"})
    res = hpoflow.optimize(spec, tmp_path / "run", engine=eng, handle_signals=False)
    assert res.summary.n_complete == 6
    cluster = load_cluster("p100-cluster")
    for f in (tmp_path / "run" / "trials").glob("*/result.json"):
        data = json.loads(f.read_text())
        train = TrainConfig(model="cnn", dataset="digits", epochs=4,
                            batch_size=data["params"]["batch_size"]).model_dump(mode="json")
        predicted = check_trial(train, 1, 0, cluster).predicted["time_to_train_s"]
        assert data["timings"]["duration_s"] == pytest.approx(predicted, rel=1e-9)
    # the learning curve is reported at each epoch boundary before the end (the 4th is the result)
    assert len(res.study.trials[0].intermediate_values) == 3


def test_cost_models_are_plugins_checked_at_validate_time() -> None:
    spec = {**_spec(4, 2), "engine": "simulated"}
    with pytest.raises(SpecError, match=r"unknown cost model 'orcale'.*did you mean 'oracle'"):
        spec_from_mapping({**spec, "engine_options": {"cost": {"type": "orcale"}}})
    with pytest.raises(SpecError, match=r"cost\.clustr"):
        spec_from_mapping({**spec, "engine_options": {"cost": {"type": "oracle", "clustr": "x"}}})
    with pytest.raises(SpecError, match="exactly one cost model"):
        spec_from_mapping({**spec, "engine_options": {"lognormal": {}, "cost": {"type": "oracle"}}})


def test_resources_processes_min_max_makes_simulated_trials_elastic_too(tmp_path: Path) -> None:
    base = {"lognormal": {"median_s": 60.0, "sigma": 1.0, "seed": 0}}
    spec = {**_spec(200, 16), "resources": {"processes": {"min": 1, "max": 16, "policy": "longest_remaining"}}}
    fixed = _engine(16, **base)
    hpoflow.optimize(_spec(200, 16), tmp_path / "fixed", engine=fixed)
    grown = _engine(16, **base)  # no engine_options.elastic: the spec's elastic range is enough
    hpoflow.optimize(spec, tmp_path / "elastic", engine=grown)
    f, g = fixed.stats(), grown.stats()
    assert g["resizes"] > 0 and g["busy"] > f["busy"]
