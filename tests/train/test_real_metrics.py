"""A trial's metrics may be any real number: NumPy scalars, Fraction, Decimal and 0-d (or one-element)
tensors are accepted as results, in ``ctx.report`` and from a simulated cost function, in real studies
on the local and simulated engines; a bool is a yes/no, not a metric, and says so."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

import hpoflow

ROOT = Path(__file__).resolve().parents[2]


def _study(tmp_path: Path, function: str, kinds: list[str]) -> hpoflow.StudyResult:
    spec = {"study": {"name": "real", "metric": "score", "direction": "maximize"},
            "space": {"kind": {"type": "categorical", "choices": kinds}},
            "search": {"algorithm": "grid", "max_concurrent": 2, "fail_fast": 0},
            "training": {"function": function}, "oracle": {"enabled": False}}
    return hpoflow.optimize(spec, tmp_path / "run")


def _by_kind(result: hpoflow.StudyResult) -> dict[str, Any]:
    return {t.params["kind"]: t for t in result.study.trials}


def test_numpy_fraction_and_decimal_results_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    kinds = ["float32", "int64", "float16", "uint8", "ndarray0", "fraction", "decimal", "dict_float32",
             "dict_decimal", "bool", "dict_bool", "numpy_bool"]
    trials = _by_kind(_study(tmp_path, "tests.trainfns_light:real_types", kinds))
    for kind in kinds:
        t = trials[kind]
        if kind.endswith("bool"):
            assert t.state == TrialState.FAIL, kind
            assert "returned no 'score'" in t.user_attrs["error"] and "a bool is not a metric" in \
                t.user_attrs["error"], t.user_attrs["error"]
            continue
        assert t.state == TrialState.COMPLETE, (kind, t.user_attrs.get("error"))
        expected = 3.0 if kind in ("int64", "uint8") else 0.25
        assert t.value == pytest.approx(expected), kind
        assert t.intermediate_values == {1: pytest.approx(expected)}, kind  # ctx.report took it too
        assert t.user_attrs["metrics"]["score"] == pytest.approx(expected)
        assert "note" not in t.user_attrs["metrics"]  # a string in the result is not a metric


@pytest.mark.slow
def test_tensor_results_complete(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    kinds = ["tensor0", "tensor1", "dict_tensor0", "int_tensor", "bool_tensor"]
    trials = _by_kind(_study(tmp_path, "tests.trainfns:tensor_result", kinds))
    for kind in kinds:
        t = trials[kind]
        if kind == "bool_tensor":
            assert t.state == TrialState.FAIL and "a bool is not a metric" in t.user_attrs["error"]
            continue
        expected = 3.0 if kind == "int_tensor" else 0.25
        assert t.state == TrialState.COMPLETE, (kind, t.user_attrs.get("error"))
        assert t.value == pytest.approx(expected) and t.intermediate_values == {1: pytest.approx(expected)}


def test_report_refuses_what_is_not_a_real_number() -> None:
    from hpoflow.spec import TrainConfig
    from hpoflow.train.context import TrialContext

    ctx = TrialContext(params={}, config=TrainConfig(), trial_number=0, trial_dir=Path("."), metric="score")
    with pytest.raises(TypeError, match=r"ctx.report\(step=1\): metric 'score' is True: a bool is not a metric"):
        ctx.report(1, score=True)
    with pytest.raises(TypeError, match=r"metric 'score' is '0.5': it must be a real number"):
        ctx.report(1, score="0.5")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"metric name 'a\\x1b\[2J' holds the control character U\+001B"):
        ctx.report(1, **{"a\x1b[2J": 1.0})
    ctx.report(2, score=10**400)
    assert ctx.reports == [(2, {"score": float("inf")})]  # beyond a float: the runner calls it non-finite


def test_a_simulated_cost_function_may_answer_in_numpy_and_fraction(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    spec = {"study": {"name": "sim", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 4, "max_concurrent": 2, "seed": 0},
            "training": {"function": "tests.trainfns_light:real_types"}, "engine": "simulated",
            "engine_options": {"slots": 2, "function": "tests.trainfns_light:sim_cost_real_types"}}
    result = hpoflow.optimize(spec, tmp_path / "run")
    assert result.summary.n_complete == 4, result.summary.errors
    for t in result.study.trials:
        x = t.params["x"]
        assert t.value == pytest.approx(0.5 + x / 4, rel=1e-6)
        assert t.user_attrs["timings"]["duration_s"] == pytest.approx(10.0 + 100.0 * x, rel=1e-6)
        assert t.user_attrs["metrics"]["steps"] == 7.0
        assert sorted(t.intermediate_values) == [1, 2, 3]


def test_a_returned_metric_name_with_a_control_character_fails_the_trial(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    spec = {"study": {"name": "odd", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 1},
            "training": {"function": "tests.trainfns_light:odd_metric_name"}, "oracle": {"enabled": False}}
    result = hpoflow.optimize(spec, tmp_path / "run")
    t = result.study.trials[0]
    assert t.state == TrialState.FAIL
    assert "metric name 'x\\x1b[2J' holds the control character U+001B" in t.user_attrs["error"]
    header = (tmp_path / "run" / "trials.csv").read_text().splitlines()[0]
    assert "\x1b" not in header
