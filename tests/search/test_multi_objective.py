"""Several objectives: Optuna's multi-objective samplers, constraints, and the Pareto front everywhere."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

import hpoflow
from hpoflow.engines.threads import ThreadEngine
from hpoflow.errors import SpecError
from hpoflow.report.tables import pareto_front, status_dict
from hpoflow.spec import spec_from_mapping
from tests.conftest import ROOT


def _spec(**study: Any) -> dict[str, Any]:
    return {"study": {"name": "mo", **study},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}, "y": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "nsga2", "n_trials": 40, "max_concurrent": 2, "seed": 0},
            "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False}}


TWO = [{"name": "f1", "direction": "minimize"}, {"name": "f2", "direction": "minimize"}]


def _objective(params: dict[str, Any], reporter: Any) -> dict[str, float]:
    x, y = params["x"], params["y"]
    return {"f1": x, "f2": (1 + y) * (1 - x) ** 2, "mem": 1000 * y}


def _dominated(a: list[float], b: list[float]) -> bool:
    return all(q <= p for p, q in zip(a, b, strict=True)) and any(q < p for p, q in zip(a, b, strict=True))


def test_the_pareto_front_is_the_non_dominated_trials(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    res = hpoflow.optimize(_spec(metrics=TWO), tmp_path / "run", engine=ThreadEngine(_objective, 2))
    assert res.summary.n_complete == 40 and res.summary.exit_code == 0
    values = {t.number: t.values for t in res.study.trials}
    front = pareto_front(res.study)
    expected = {n for n, v in values.items() if not any(_dominated(v, w) for w in values.values())}
    assert {f["number"] for f in front} == expected
    assert all(set(f["values"]) == {"f1", "f2"} and set(f["params"]) == {"x", "y"} for f in front)
    status = status_dict(res.study, "label", budget=40)
    assert status["pareto"] == front and status["objectives"] == ["f1", "f2"] and status["best_value"] is None
    best = yaml.safe_load((tmp_path / "run" / "best.yaml").read_text())
    assert best["objectives"] == ["f1", "f2"] and len(best["pareto"]) == len(front)


def test_constraints_keep_infeasible_trials_off_the_front(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    res = hpoflow.optimize(_spec(metrics=TWO, constraints=["mem <= 300"]), tmp_path / "run",
                           engine=ThreadEngine(_objective, 2))
    front = pareto_front(res.study)
    assert front and all(res.study.trials[f["number"]].user_attrs["metrics"]["mem"] <= 300 for f in front)


def test_a_missing_objective_fails_the_trial_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    spec = _spec(metrics=TWO)
    spec["search"] = {**spec["search"], "n_trials": 2, "fail_fast": 0}
    res = hpoflow.optimize(spec, tmp_path / "run", engine=ThreadEngine(lambda p, r: {"f1": 1.0}, 1))
    assert res.summary.n_failed == 2
    assert "objective 'f2'" in res.study.trials[0].user_attrs["error"]


@pytest.mark.parametrize(("change", "message"), [
    ({"search": {"algorithm": "tpe", "n_trials": 4, "pruner": {"type": "median"}}}, "does not prune"),
    ({"search": {"algorithm": "cmaes", "n_trials": 4}}, "optimises one objective"),
    ({"study": {"name": "mo", "metrics": TWO, "constraints": ["mem < 3"]}}, "NAME <= NUMBER"),
    ({"study": {"name": "mo", "metric": "f2", "metrics": TWO}}, "not the first of metrics"),
])
def test_bad_multi_objective_specs_are_refused(change: dict[str, Any], message: str) -> None:
    spec = {**_spec(metrics=TWO), **change}
    with pytest.raises(SpecError, match=message):
        spec_from_mapping(spec)


@pytest.mark.slow
def test_a_two_objective_digits_study_end_to_end(tmp_path: Path) -> None:
    spec = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    spec["study"] = {"name": "digits-mo", "metrics": [{"name": "val_accuracy", "direction": "maximize"},
                                                      {"name": "samples_per_s", "direction": "maximize"}],
                     "constraints": ["system_rss_peak_mb <= 100000"]}
    spec["search"] = {"algorithm": "tpe", "n_trials": 4, "max_concurrent": 2, "seed": 0}
    spec["training"]["epochs"] = 2
    path = tmp_path / "mo.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    hp = [sys.executable, "-m", "hpoflow"]
    run = subprocess.run([*hp, "run", str(path), "--run-dir", str(tmp_path / "run"), "--quiet"], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    status = json.loads(subprocess.run([*hp, "status", str(tmp_path / "run"), "--json"], cwd=tmp_path, env=env,
                                       capture_output=True, text=True, timeout=120, check=True).stdout)
    assert status["pareto"] and {"params", "values", "number"} <= set(status["pareto"][0])
    assert set(status["pareto"][0]["values"]) == {"val_accuracy", "samples_per_s"}
    best = yaml.safe_load((tmp_path / "run" / "best.yaml").read_text())
    assert best["pareto"] == status["pareto"]
    rep = subprocess.run([*hp, "report", str(tmp_path / "run")], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=300)
    assert rep.returncode == 0, rep.stderr
    assert "Pareto front" in (tmp_path / "run" / "report.html").read_text()
