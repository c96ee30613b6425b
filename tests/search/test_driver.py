"""The driver, on the thread engine: budgets, ordering, grid, determinism, resume, pruning."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.engines.base import Engine
from hpoflow.engines.threads import Reporter, ThreadEngine
from hpoflow.errors import SpecError
from hpoflow.run.ledger import count_finished, interrupted
from hpoflow.search.driver import Driver
from hpoflow.search.samplers import make_pruner, make_sampler
from hpoflow.search.space import grid_points
from hpoflow.spec import spec_from_mapping

BASE: dict[str, Any] = {
    "study": {"name": "drv", "metric": "score", "direction": "maximize"},
    "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}, "k": {"type": "categorical", "choices": [1, 2, 3]}},
    "search": {"algorithm": "random", "n_trials": 12, "max_concurrent": 3, "seed": 7},
    "training": {"function": "trainfns:counter"},
}


def _sleep_then(seconds: float, value: Any) -> Any:
    time.sleep(seconds)
    return value


def make(overrides: dict[str, Any] | None = None, **search: Any) -> Any:
    data = copy.deepcopy(BASE)
    data["search"].update(search)
    for k, v in (overrides or {}).items():
        data[k] = v
    return spec_from_mapping(data)


def run_driver(spec: Any, objective: Any, slots: int, tmp_path: Path, study: optuna.Study | None = None,
               ) -> tuple[Driver, ThreadEngine, optuna.Study]:
    study = study or optuna.create_study(direction=spec.study.direction, sampler=make_sampler(spec.search),
                                         pruner=make_pruner(spec.search.pruner))
    engine = ThreadEngine(objective, slots=slots)
    driver = Driver(spec, study, engine, tmp_path)
    driver.run()
    engine.close()
    return driver, engine, study


def test_exact_budget_and_concurrency(tmp_path: Path) -> None:
    spec = make()
    driver, engine, study = run_driver(spec, lambda p, r: _sleep_then(0.01, p["x"]), 3, tmp_path)
    assert count_finished(study) == 12
    assert len(study.trials) == 12
    assert engine.max_in_flight == 3
    assert driver.summary.n_complete == 12 and driver.summary.stopped_by == "budget"


def test_results_consumed_in_completion_order(tmp_path: Path) -> None:
    spec = make(n_trials=8, max_concurrent=2)
    slow = {"first": True}

    def objective(p: dict[str, Any], r: Reporter) -> float:
        if slow.pop("first", False):
            time.sleep(0.8)  # trial 0 is slow: the other slot must keep turning over meanwhile
        else:
            time.sleep(0.02)
        return p["x"]

    driver, engine, _ = run_driver(spec, objective, 2, tmp_path)
    order = [r.number for r in driver.summary.results]
    assert order[-1] == 0 or order.index(0) >= 6, order  # no batch waits for the slow trial
    assert len(engine.submitted) == 8


@pytest.mark.parametrize("ask_s", [0.0, 0.003])  # 3 ms asks turn ask-ahead (auto) on, as a loaded machine does
def test_wall_clock_budget_lets_running_trials_finish(tmp_path: Path, ask_s: float) -> None:
    spec = make(n_trials=1000, max_concurrent=2, timeout=0.4)
    study = optuna.create_study(direction="maximize", sampler=_SlowSampler(ask_s, seed=7))
    driver, engine, study = run_driver(spec, lambda p, r: _sleep_then(0.1, 1.0), 2, tmp_path, study)
    assert driver.summary.stopped_by == "timeout"
    assert 1 <= count_finished(study) < 1000
    ran = {r.number for r in engine.submitted}
    assert all(t.state == TrialState.COMPLETE for t in study.trials if t.number in ran)  # nothing cancelled
    assert all(t.state == TrialState.WAITING for t in study.trials if t.number not in ran)  # asked ahead: queued
    assert count_finished(study) == len(ran) == driver.summary.n_complete
    starts = sorted(t.datetime_start for t in study.trials if t.datetime_start is not None)
    # Every trial was asked before the budget ran out (it starts counting before the first ask):
    assert (starts[-1] - starts[0]).total_seconds() < 0.4


def test_grid_covers_every_point_once_with_concurrency(tmp_path: Path) -> None:
    space = {
        "opt": {"type": "categorical", "choices": ["sgd", "adam"]},
        "momentum": {"type": "float", "low": 0.5, "high": 0.9, "step": 0.2, "when": {"opt": "sgd"}},
        "width": {"type": "int", "low": 1, "high": 3},
    }
    data = copy.deepcopy(BASE)
    data["space"] = space
    data["search"] = {"algorithm": "grid", "max_concurrent": 3}
    spec = spec_from_mapping(data)
    points = grid_points(spec.space)
    assert len(points) == (3 + 1) * 3  # sgd x 3 momenta + adam, times 3 widths
    _, _, study = run_driver(spec, lambda p, r: _sleep_then(0.005, 1.0), 3, tmp_path)
    seen = sorted(tuple(sorted(t.params.items())) for t in study.trials)
    assert seen == sorted(tuple(sorted(p.items())) for p in points)
    assert len(study.trials) == len(points)


@pytest.mark.parametrize("algorithm,concurrency", [("random", 2), ("tpe", 1), ("cmaes", 1), ("gp", 1)])
def test_same_seed_same_configurations(tmp_path: Path, algorithm: str, concurrency: int) -> None:
    n = 6 if algorithm == "gp" else 14
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}, "y": {"type": "float", "low": -1.0, "high": 1.0}}
    spec = make({"space": space}, algorithm=algorithm, n_trials=n, max_concurrent=concurrency, seed=3)

    def objective(p: dict[str, Any], r: Reporter) -> float:
        return -((p["x"] - 0.3) ** 2) - p["y"] ** 2

    runs = []
    for _ in range(2):
        _, _, study = run_driver(spec, objective, concurrency, tmp_path)
        runs.append(sorted((t.number, tuple(sorted(t.params.items()))) for t in study.trials))
    assert runs[0] == runs[1]


def test_resume_marks_crashed_trials_and_keeps_budget(tmp_path: Path) -> None:
    spec = make(n_trials=6, max_concurrent=2)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(spec.search))
    for _ in range(2):  # two finished trials
        t = study.ask()
        t.suggest_float("x", 0, 1)
        t.suggest_categorical("k", [1, 2, 3])
        study.tell(t, 0.5)
    crashed = study.ask()  # left RUNNING, as a killed driver leaves it
    crashed_params = {"x": crashed.suggest_float("x", 0, 1), "k": crashed.suggest_categorical("k", [1, 2, 3])}
    _, engine, study = run_driver(spec, lambda p, r: p["x"], 2, tmp_path, study)
    assert count_finished(study) == 6
    frozen = study.trials[crashed.number]
    assert crashed.number in interrupted(study.trials) and frozen.state == TrialState.FAIL
    rerun = [t for t in study.trials if t.params == crashed_params and t.number != crashed.number]
    assert len(rerun) == 1 and rerun[0].state == TrialState.COMPLETE  # rerun with the same params
    assert len(engine.submitted) == 4  # 6 - 2 already finished


def test_max_failures_stops_the_study(tmp_path: Path) -> None:
    spec = make(n_trials=50, max_concurrent=1, max_failures=3, fail_fast=0)

    def objective(p: dict[str, Any], r: Reporter) -> float:
        raise RuntimeError("always fails")

    driver, _, study = run_driver(spec, objective, 1, tmp_path)
    assert driver.summary.stopped_by == "max_failures"
    assert driver.summary.n_failed == 3 and len(study.trials) == 3
    assert "always fails" in study.trials[0].user_attrs["error"]
    assert (tmp_path / "trials" / "0" / "result.json").exists()


def test_pruning_decisions_reach_the_trial(tmp_path: Path) -> None:
    spec = make(n_trials=20, max_concurrent=1,
                pruner={"type": "median", "startup_trials": 3, "warmup_steps": 0})

    def objective(p: dict[str, Any], r: Reporter) -> dict[str, float]:
        for step in range(1, 11):
            if r.report(step, score=p["x"] * step):
                return {"score": p["x"] * step}
        return {"score": p["x"] * 10}

    driver, _, study = run_driver(spec, objective, 1, tmp_path)
    pruned = [t for t in study.trials if t.state == TrialState.PRUNED]
    assert driver.summary.n_pruned == len(pruned) > 0
    assert all(len(t.intermediate_values) < 10 for t in pruned)
    assert count_finished(study) == 20


def test_optimize_resumes_in_a_run_dir_without_exceeding_budget(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["search"]["n_trials"] = 5
    r1 = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2), n_trials=3)
    assert r1.summary.n_finished == 3
    r2 = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2))
    assert r2.summary.n_finished == 5 and len(r2.summary.results) == 2  # the whole study; 2 ran now
    r3 = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2))
    assert r3.summary.n_finished == 5 and r3.summary.results == []  # nothing left to run
    assert count_finished(r3.study) == 5
    assert (tmp_path / "run" / "trials.csv").read_text().count("\n") == 6


def test_resume_refuses_a_different_study(tmp_path: Path) -> None:
    from hpoflow.errors import RunDirError

    data = copy.deepcopy(BASE)
    optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2), n_trials=1)
    data["space"]["x"]["high"] = 2.0
    with pytest.raises(RunDirError, match=r"space\.x\.high"):
        optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2))


def test_a_trial_the_engine_can_never_hold_is_refused_before_asking(tmp_path: Path) -> None:
    from hpoflow.errors import EngineError

    spec = make(n_trials=3)
    study = optuna.create_study(direction="maximize")
    driver = Driver(spec, study, ThreadEngine(lambda p, r: 1.0, slots=0), tmp_path)
    with pytest.raises(EngineError, match="cannot run a trial"):
        driver.run()
    assert study.trials == []  # nothing left RUNNING in the storage


def test_a_resumed_seeded_study_does_not_repeat_its_configurations(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["search"]["n_trials"] = 8
    first = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2), n_trials=4)
    assert first.summary.n_finished == 4
    resumed = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2))
    xs = [t.params["x"] for t in resumed.study.trials]
    assert len(xs) == 8 and len(set(xs)) == 8


def test_a_resumed_study_samples_other_configurations_than_an_uninterrupted_one(tmp_path: Path) -> None:
    """What the README says of search.seed: same seed and spec give the same configurations in a run
    never interrupted; a resumed study reseeds its sampler (seed + the trials it holds), so from the
    resume on it draws others than the uninterrupted run of the same seed."""
    data = copy.deepcopy(BASE)
    data["search"].update(n_trials=8, max_concurrent=1)

    def xs(result: Any) -> list[float]:
        return [t.params["x"] for t in sorted(result.study.trials, key=lambda t: t.number)]

    whole = [xs(optimize(data, tmp_path / f"whole{i}", engine=ThreadEngine(lambda p, r: p["x"], 1))) for i in (0, 1)]
    assert whole[0] == whole[1] and len(whole[0]) == 8
    optimize(data, tmp_path / "resumed", engine=ThreadEngine(lambda p, r: p["x"], 1), n_trials=4)  # then stopped
    resumed = xs(optimize(data, tmp_path / "resumed", engine=ThreadEngine(lambda p, r: p["x"], 1)))
    assert resumed[:4] == whole[0][:4]  # before the stop: the same draws
    assert not set(resumed[4:]) & set(whole[0][4:])  # after the resume: others


def test_oracle_rejects_a_trial_too_large_for_the_device_without_a_slot(tmp_path: Path) -> None:
    data = {
        "study": {"name": "big", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"hidden": {"type": "categorical", "choices": [64, 200000]}},
        "search": {"algorithm": "grid", "max_concurrent": 1},
        "training": {"model": "mlp", "model_options": {"hidden": "${hidden}", "depth": 3}, "epochs": 1},
    }
    engine = ThreadEngine(lambda p, r: 0.9, slots=1)
    result = optimize(data, tmp_path / "run", engine=engine)
    by_hidden = {t.params["hidden"]: t for t in result.study.trials}
    big, small = by_hidden[200000], by_hidden[64]
    assert big.state == TrialState.PRUNED
    reason = big.user_attrs["error"]
    assert "GiB per device" in reason and "largest batch that fits" in reason
    assert [r.params for r in engine.submitted] == [{"hidden": 64}]  # the big one never took a slot
    assert small.state == TrialState.COMPLETE
    assert small.user_attrs["oracle"]["memory_per_device_bytes"] > 0  # prediction stored with the trial
    data["oracle"] = {"enabled": False}
    off = optimize(data, tmp_path / "run2", engine=ThreadEngine(lambda p, r: 0.9, slots=1))
    assert off.summary.n_complete == 2


def test_the_driver_process_imports_neither_torch_nor_pycompss(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    code = (
        "import json, sys\n"
        "from hpoflow.api import optimize\n"
        "from hpoflow.engines.threads import ThreadEngine\n"
        f"data = json.loads({json.dumps(json.dumps(BASE))})\n"
        "data['search']['n_trials'] = 3\n"
        f"optimize(data, {str(tmp_path / 'run')!r}, engine=ThreadEngine(lambda p, r: p['x'], 2))\n"
        "print(json.dumps(['torch' in sys.modules, any(m.startswith('pycompss') for m in sys.modules)]))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.strip().splitlines()[-1]) == [False, False]


def test_fail_fast_stops_when_the_first_trials_fail_alike(tmp_path: Path) -> None:
    spec = make(n_trials=50, max_concurrent=1, fail_fast=3)

    def objective(p: dict[str, Any], r: Reporter) -> float:
        raise FileNotFoundError("data.csv")

    driver, _, study = run_driver(spec, objective, 1, tmp_path)
    assert len(study.trials) == 3  # no trial started after the stop
    s = driver.summary
    assert s.stopped_by == "fail_fast" and s.n_failed == 3 and s.exit_code == 3
    assert len(s.errors) == 1 and "data.csv" in s.errors[0]
    assert "the first 3 trials all failed with the same error" in s.outcome_message()


def test_a_timeout_that_allows_no_trial_says_so_without_an_empty_error_list(tmp_path: Path) -> None:
    """Issue 38, item 12: ``search.timeout`` ran out before the first trial, and ``hpoflow run`` printed
    "first distinct errors ...:" with nothing after it."""
    import subprocess
    import sys

    import yaml

    from tests.conftest import ROOT, RUN_ENV

    data = copy.deepcopy(BASE)
    data["search"].update(n_trials=3, timeout=1e-6)
    data["training"] = {"function": "trainfns_light:environment"}
    data["oracle"] = {"enabled": False}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    r = subprocess.run([sys.executable, "-m", "hpoflow", "run", str(tmp_path / "spec.yaml"), "--run-dir",
                        str(tmp_path / "run")], env=RUN_ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stderr  # no trial completed
    lines = [line for line in r.stderr.splitlines() if line.startswith("hpoflow: ")]
    assert lines == ["hpoflow: no trial ran: search.timeout (1e-06 s) ran out before the first one started. "
                     "Fix: raise search.timeout (it counts from the start of the run), then rerun the same command "
                     "to resume"], r.stderr
    assert "errors" not in r.stderr and "Traceback" not in r.stderr


def test_no_trial_completed_lists_errors_only_when_there_are_some(tmp_path: Path) -> None:
    """Every trial pruned: no error to list, so no "first distinct errors:" heading either."""
    spec = make(n_trials=2, max_concurrent=1,
                pruner={"type": "optuna.pruners.ThresholdPruner", "options": {"lower": 2.0}})

    def objective(p: dict[str, Any], r: Reporter) -> dict[str, float]:
        r.report(1, score=p["x"])  # below the threshold (x < 1): pruned
        return {"score": p["x"]}

    driver, _, _ = run_driver(spec, objective, 1, tmp_path)
    s = driver.summary
    assert (s.n_pruned, s.n_complete, s.errors) == (2, 0, []) and s.exit_code == 3
    assert s.outcome_message() == "no trial completed (0 failed, 2 pruned)"


def test_fail_fast_lets_different_errors_and_any_success_go_on(tmp_path: Path) -> None:
    calls = {"n": 0}

    def objective(p: dict[str, Any], r: Reporter) -> float:
        calls["n"] += 1
        if calls["n"] <= 4:
            raise ValueError(f"error number {calls['n']}")  # distinct errors: not a systematic failure
        return 1.0

    driver, _, _ = run_driver(make(n_trials=8, max_concurrent=1, fail_fast=3), objective, 1, tmp_path)
    s = driver.summary
    assert s.stopped_by == "budget" and s.n_failed == 4 and s.n_complete == 4 and s.exit_code == 0
    assert len(s.errors) == 4


def test_known_configurations_run_first_and_once(tmp_path: Path) -> None:
    from hpoflow.api import optimize

    data = copy.deepcopy(BASE)
    data["search"].update(n_trials=5, enqueue=[{"x": 0.25, "k": 2}, {"x": 0.75}])
    first = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 1), n_trials=3)
    trials = sorted(first.study.trials, key=lambda t: t.number)
    assert trials[0].params == {"x": 0.25, "k": 2} and trials[1].params["x"] == 0.75
    again = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 1))
    xs = [t.params["x"] for t in again.study.trials]
    assert xs.count(0.25) == 1 and xs.count(0.75) == 1 and len(xs) == 5  # not enqueued again on resume


@pytest.mark.parametrize(("point", "words"), [
    ({"x": 2.0}, "it must lie in [0.0, 1.0]"),
    ({"k": 4}, "choose one of [1, 2, 3]"),
    ({"y": 1}, "unknown parameter 'y'"),
])
def test_known_configurations_are_checked_against_the_space(point: dict[str, Any], words: str) -> None:
    data = copy.deepcopy(BASE)
    data["search"]["enqueue"] = [point]
    with pytest.raises(SpecError) as info:
        spec_from_mapping(data)
    issue = info.value.issues[0]
    assert issue.path.startswith("search.enqueue.0.") and words in issue.message, str(issue)


def test_a_warm_started_study_learns_from_the_earlier_one(tmp_path: Path) -> None:
    from hpoflow.api import optimize

    def peaked(p: dict[str, Any], r: Reporter) -> float:
        return -abs(p["x"] - 0.8)

    prior = copy.deepcopy(BASE)
    prior["search"].update(algorithm="random", n_trials=30, max_concurrent=1)
    optimize(prior, tmp_path / "prior", engine=ThreadEngine(peaked, 1))

    def first_suggestion(warm: bool, name: str) -> tuple[float, Any]:
        data = copy.deepcopy(BASE)
        data["search"] = {"algorithm": "tpe", "n_trials": 1, "max_concurrent": 1, "seed": 11,
                          "sampler_options": {"n_startup_trials": 5},
                          **({"warm_start": str(tmp_path / "prior")} if warm else {})}
        result = optimize(data, tmp_path / name, engine=ThreadEngine(peaked, 1))
        own = [t for t in result.study.trials if "hpoflow_warm_start" not in t.user_attrs]
        return own[0].params["x"], result

    cold, _ = first_suggestion(False, "cold")
    warm, result = first_suggestion(True, "warm")
    assert warm != cold  # the prior changed TPE's first suggestion (same seed)
    assert abs(warm - 0.8) < 0.2  # towards the earlier study's optimum
    assert result.summary.n_complete == 1 and result.summary.n_trials == 1  # imports do not count
    assert len(result.study.trials) == 31 and result.best_params is not None


def test_a_warm_start_needs_the_same_metric_and_direction(tmp_path: Path) -> None:
    from hpoflow.api import optimize
    from hpoflow.errors import RunDirError

    prior = copy.deepcopy(BASE)
    prior["search"].update(n_trials=2)
    optimize(prior, tmp_path / "prior", engine=ThreadEngine(lambda p, r: p["x"], 1))
    data = copy.deepcopy(BASE)
    data["study"]["direction"] = "minimize"
    data["search"]["warm_start"] = str(tmp_path / "prior")
    with pytest.raises(RunDirError, match="only a study of the same metric and direction"):
        optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 1))


class _SlowSampler(optuna.samplers.RandomSampler):
    """A random sampler whose every ask takes ``delay`` seconds (a stand-in for GP on a big study)."""

    def __init__(self, delay: float, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.delay = delay

    def before_trial(self, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        time.sleep(self.delay)
        super().before_trial(study, trial)


def test_ask_ahead_asks_while_every_slot_is_busy_and_keeps_the_budget_exact(tmp_path: Path) -> None:
    spec = make(n_trials=10, max_concurrent=2, ask_ahead=True)
    study = optuna.create_study(direction="maximize", sampler=_SlowSampler(0.03))
    driver, engine, study = run_driver(spec, lambda p, r: _sleep_then(0.05, p["x"]), 2, tmp_path, study)
    assert driver.asked_ahead >= 5  # after the first two, trials were asked while both slots ran
    assert count_finished(study) == 10 and len(study.trials) == 10  # none asked beyond the budget
    assert engine.max_in_flight == 2
    assert all(t.state == TrialState.COMPLETE for t in study.trials)


def test_a_trial_asked_ahead_is_submitted_before_the_finished_trial_is_recorded(tmp_path: Path) -> None:
    """A result frees a slot: the trial asked ahead goes to it first, and the finished trial's storage
    writes (one of them fsynced) come after, so the slot does not idle through them."""
    from hpoflow.trial import TrialResult

    spec = make(n_trials=10, max_concurrent=2, ask_ahead=True)
    study = optuna.create_study(direction="maximize", sampler=_SlowSampler(0.01))

    class Recording(ThreadEngine):
        def __init__(self) -> None:
            super().__init__(lambda p, r: _sleep_then(0.05, p["x"]), slots=2)
            self.results: set[int] = set()  # trials whose result the driver has polled
            self.pending_at_submit: list[set[int]] = []  # polled, not yet told, at each submit

        def poll(self, timeout: float | None) -> list[Any]:
            events = super().poll(timeout)
            self.results.update(ev.number for ev in events if isinstance(ev, TrialResult))
            return events

        def submit(self, request: Any) -> None:
            told = {t.number for t in study.get_trials(deepcopy=False) if t.state.is_finished()}
            self.pending_at_submit.append(self.results - told)
            super().submit(request)

    engine = Recording()
    driver = Driver(spec, study, engine, tmp_path)
    driver.run()
    engine.close()
    assert count_finished(study) == 10 and len(study.trials) == 10 and engine.max_in_flight == 2
    early = [p for p in engine.pending_at_submit[2:] if p]
    # every submit after the first two that took a trial asked ahead happened while the result that
    # freed its slot was not yet in the study (the sampler is slow, so that is every one or nearly)
    assert driver.asked_ahead >= 5 and len(early) >= driver.asked_ahead - 1


def test_a_trial_asked_ahead_is_prepared_by_the_engine_before_it_is_submitted(tmp_path: Path) -> None:
    """The engine may make a trial asked ahead ready (its directory, its logs) while every slot is busy:
    ``prepare`` comes for each trial asked ahead, before its submit, and never for one started at once."""
    spec = make(n_trials=10, max_concurrent=2, ask_ahead=True)
    study = optuna.create_study(direction="maximize", sampler=_SlowSampler(0.01))

    class Preparing(ThreadEngine):
        def __init__(self) -> None:
            super().__init__(lambda p, r: _sleep_then(0.05, p["x"]), slots=2)
            self.prepared: list[int] = []
            self.prepared_at_submit: list[bool] = []

        def prepare(self, request: Any) -> None:
            assert request.number not in {r.number for r in self.submitted}
            self.prepared.append(request.number)

        def submit(self, request: Any) -> None:
            self.prepared_at_submit.append(request.number in self.prepared)
            super().submit(request)

    engine = Preparing()
    driver = Driver(spec, study, engine, tmp_path)
    driver.run()
    engine.close()
    assert count_finished(study) == 10 and driver.asked_ahead >= 5
    assert len(engine.prepared) == driver.asked_ahead == sum(engine.prepared_at_submit)
    assert engine.prepared_at_submit[:2] == [False, False]  # the first two started at once, unprepared


class _Lockstep(Engine):
    """Two slots whose trials end together: each poll returns every running trial's result, and one more
    result (a trial started meanwhile) ends during the next poll of nothing-to-wait (``poll(0)``)."""

    name = "lockstep"

    def __init__(self, study: optuna.Study) -> None:
        self.study = study
        self.running_: dict[int, Any] = {}
        self.polled: set[int] = set()
        self.pending_at_submit: list[set[int]] = []  # results polled and not yet told, at each submit

    def capacity(self, request: Any) -> int:
        return 2

    def submit(self, request: Any) -> None:
        told = {t.number for t in self.study.get_trials(deepcopy=False) if t.state.is_finished()}
        self.pending_at_submit.append(self.polled - told)
        self.running_[request.number] = request

    def poll(self, timeout: float | None) -> list[Any]:
        from hpoflow.trial import TrialResult

        out = [TrialResult(n, "complete", value=r.params["x"], metrics={"score": r.params["x"]},
                           timings={"duration_s": 0.05}) for n, r in self.running_.items()]
        self.running_.clear()
        self.polled.update(r.number for r in out)
        return out

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        pass

    def cancel(self, number: int, reason: str) -> None:
        self.running_.pop(number, None)

    def running(self) -> list[int]:
        return list(self.running_)

    def close(self) -> None:
        pass


@pytest.mark.parametrize("sampler", ["random", "tpe"])
def test_a_blind_sampler_refills_every_freed_slot_before_the_finished_trials_are_recorded(
        tmp_path: Path, sampler: str) -> None:
    """With Optuna's random sampler (its asks read no result), every slot that a batch of results frees is
    refilled before those results are recorded, and results that come while they are recorded are seen
    (``poll(0)``) and refilled before anything else; a sampler that reads results (TPE) waits for them."""
    spec = make(n_trials=12, max_concurrent=2, algorithm=sampler, ask_ahead="auto" if sampler == "random" else False)
    study = optuna.create_study(direction="maximize", sampler=make_sampler(spec.search))
    engine = _Lockstep(study)
    Driver(spec, study, engine, tmp_path).run()
    assert count_finished(study) == 12 and len(study.trials) == 12
    refills = engine.pending_at_submit[2:]  # after the first two
    if sampler == "random":  # both slots of each batch, each submitted with the batch's results untold
        assert all(len(p) >= 1 for p in refills) and sum(len(p) == 2 for p in refills) >= len(refills) // 2, refills
    else:  # told first (and nothing asked ahead): TPE sees each result before it proposes the next trial
        assert all(not p for p in refills), refills


def test_a_retried_attempt_reporting_its_steps_again_raises_no_optuna_warning(tmp_path: Path) -> None:
    """A rank lost mid-trial (a killed worker) is retried in the same trial from its start: its
    reports repeat steps the study has. Optuna keeps a step's first value and warns at a second; the
    driver tells each step once, so the user sees no warning."""
    import warnings

    from hpoflow.trial import TrialResult

    class LosesFirstAttempt(ThreadEngine):
        def _run(self, request: Any, reporter: Reporter) -> None:
            if request.attempt == 0:
                reporter.report(1, score=0.1)
                reporter.report(2, score=0.2)
                self._events.put(TrialResult(request.number, "failed", error="worker lost", retryable=True))
                return
            super()._run(request, reporter)

    def objective(p: dict[str, Any], r: Reporter) -> float:
        for step in (1, 2, 3):
            r.report(step, score=0.5 * step)
        return 0.9

    spec = make({"resources": {"max_retries": 1}}, n_trials=1, max_concurrent=1)
    study = optuna.create_study(direction="maximize")
    engine = LosesFirstAttempt(objective, slots=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an Optuna UserWarning would fail the trial's bookkeeping here
        Driver(spec, study, engine, tmp_path).run()
    engine.close()
    (t,) = study.trials
    assert t.state == TrialState.COMPLETE and t.user_attrs["attempts"] == 2
    assert t.intermediate_values == {1: 0.1, 2: 0.2, 3: 1.5}  # each step's first report kept


def test_ask_ahead_auto_turns_on_for_a_slow_sampler_and_stays_off_for_one_slot(tmp_path: Path) -> None:
    slow = make(n_trials=8, max_concurrent=2)  # ask_ahead: auto
    driver, _, _ = run_driver(slow, lambda p, r: _sleep_then(0.02, p["x"]), 2, tmp_path / "a",
                              optuna.create_study(direction="maximize", sampler=_SlowSampler(0.02)))
    assert driver.asked_ahead > 0
    one = make(n_trials=5, max_concurrent=1)
    driver, _, _ = run_driver(one, lambda p, r: _sleep_then(0.02, p["x"]), 1, tmp_path / "b",
                              optuna.create_study(direction="maximize", sampler=_SlowSampler(0.02)))
    assert driver.asked_ahead == 0
    # a fast sampler and 1 s trials: nothing to hide. An ask takes ~1 ms of CPU here, but its wall time
    # grows with the machine's load: beside the suite and two busy processes (load ~8) the median ask
    # crossed the 2 ms that 1 % of a 0.2 s trial is; 1 % of 1 s leaves it ten times that
    fast = make(n_trials=6, max_concurrent=2)
    driver, _, _ = run_driver(fast, lambda p, r: _sleep_then(1.0, p["x"]), 2, tmp_path / "c")
    assert driver.asked_ahead == 0


def test_a_trial_asked_ahead_when_the_study_ends_goes_back_to_the_queue(tmp_path: Path) -> None:
    # Trials longer than the timeout: both slots are busy from the first round to past the deadline, so
    # the trial asked ahead in that round is still waiting when the timeout ends the study. (With trials
    # shorter than it, a result arriving as the deadline passed could take the trial asked ahead into a
    # slot first, leaving none to go back: that happened at load ~8.) 1.5 s leaves the driver's start-up
    # time to reach its first round on a loaded machine.
    spec = make(n_trials=50, max_concurrent=2, ask_ahead=True, timeout=1.5)
    driver, engine, study = run_driver(spec, lambda p, r: _sleep_then(2.0, p["x"]), 2, tmp_path)
    assert driver.summary.stopped_by == "timeout"
    waiting = study.get_trials(states=(TrialState.WAITING,))
    assert len(waiting) == 1  # asked ahead, never run: back in the queue, with the parameters it was given
    left = waiting[0]
    assert left.number not in {r.number for r in engine.submitted} and "metrics" not in left.user_attrs
    assert set(left.params) == {"x", "k"} and not left.user_attrs.get("hpoflow_driver")
    assert not study.get_trials(states=(TrialState.FAIL, TrialState.RUNNING))  # no failure that never ran
    assert count_finished(study) == len(study.trials) - 1 == driver.summary.n_finished
    # The next run (a resume, or another driver) runs it first, as it is:
    spec = make(n_trials=driver.summary.n_finished + 1, max_concurrent=1)
    again, engine2, study = run_driver(spec, lambda p, r: p["x"], 1, tmp_path, study)
    assert [r.number for r in engine2.submitted] == [left.number]
    assert engine2.submitted[0].params == left.params
    assert study.trials[left.number].state == TrialState.COMPLETE and again.summary.n_finished == spec.search.n_trials
