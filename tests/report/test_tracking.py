"""Tracking: MLflow and TensorBoard logs of a study, read back with those tools' own readers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

import hpoflow
from hpoflow.engines.threads import ThreadEngine
from hpoflow.errors import SpecError
from hpoflow.spec import spec_from_mapping
from tests.conftest import ROOT


def _objective(params: dict[str, Any], reporter: Any) -> dict[str, float]:
    x = params["x"]
    for epoch in range(1, 4):
        reporter.report(epoch, score=x * epoch)
    return {"score": 3 * x, "aux": 1.0}


def _spec(tracking: dict[str, Any]) -> dict[str, Any]:
    return {"study": {"name": "tracked", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 3, "seed": 0},
            "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False}, "tracking": tracking}


def test_mlflow_gets_one_run_per_trial_with_params_curves_and_finals(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.chdir(ROOT)
    res = hpoflow.optimize(_spec({"mlflow": True, "experiment": "exp"}), tmp_path / "run",
                           engine=ThreadEngine(_objective, 1))
    uri = f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}"  # the run's local store
    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("exp")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 3 and all(r.info.status == "FINISHED" for r in runs)
    by_trial = {int(r.data.tags["hpoflow.trial"]): r for r in runs}
    for t in res.study.trials:
        run = by_trial[t.number]
        assert float(run.data.params["x"]) == pytest.approx(t.params["x"])
        history = client.get_metric_history(run.info.run_id, "score")
        steps = sorted((m.step, m.timestamp, m.value) for m in history)
        assert [s for s, _, _ in steps] == [1, 2, 3, 3]  # three reports, then the final value at the last step
        assert [v for _, _, v in steps[:3]] == pytest.approx([t.params["x"] * e for e in (1, 2, 3)])
        assert run.data.metrics["score"] == pytest.approx(3 * t.params["x"])  # the run's summary: the final
        assert run.data.tags["hpoflow.state"] == "complete" and "timing/duration_s" in run.data.metrics


def test_tensorboard_gets_one_event_directory_per_trial(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("tensorboardX")
    ea = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    monkeypatch.chdir(ROOT)
    res = hpoflow.optimize(_spec({"tensorboard": True}), tmp_path / "run", engine=ThreadEngine(_objective, 1))
    for t in res.study.trials:
        acc = ea.EventAccumulator(str(tmp_path / "run" / "tensorboard" / f"trial-{t.number}"))
        acc.Reload()
        curve = [(e.step, e.value) for e in acc.Scalars("score")]
        assert [s for s, _ in curve] == [1, 2, 3]
        assert curve[-1][1] == pytest.approx(3 * t.params["x"], rel=1e-5)
        assert acc.Scalars("final/score")[0].value == pytest.approx(3 * t.params["x"], rel=1e-5)


def test_tracking_options_are_checked() -> None:
    with pytest.raises(SpecError, match="tracking"):
        spec_from_mapping(_spec({"mlfow": "file:x"}))
