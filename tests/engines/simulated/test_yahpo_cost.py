"""The ``yahpo`` cost model (YAHPO Gym's LCBench surrogate, read from the shared benchmark data) and the
search benchmark built on it (``bench/search_benchmark.py``, a reduced run: the full protocol is the
script's). Skipped where the surrogate or onnxruntime is absent."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

import hpoflow
from hpoflow.engines.simulated.engine import SimulatedEngine
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.engines.simulated.yahpo import benchmarks_dir, surrogate, yahpo_spec
from hpoflow.errors import EngineError, SpecError

pytest.importorskip("onnxruntime")
if not (benchmarks_dir() / "yahpo-lcbench" / "model.onnx").is_file():
    pytest.skip(f"no YAHPO LCBench surrogate under {benchmarks_dir()} (set HPOFLOW_BENCHMARKS)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[3]
CONFIG = {"batch_size": 64, "learning_rate": 0.003, "momentum": 0.9, "weight_decay": 0.001, "num_layers": 2,
          "max_units": 256, "max_dropout": 0.1}


class _Seen:
    def __init__(self) -> None:
        self.epochs: list[tuple[int, int, float, float]] = []
        self.ends: list[tuple[int, str, int]] = []

    def epoch_ended(self, number: int, epoch: int, clock: float, metrics: dict[str, float]) -> None:
        self.epochs.append((number, epoch, clock, metrics["val_accuracy"]))

    def run_ended(self, number: int, status: str, clock: float, epoch: int) -> None:
        self.ends.append((number, status, epoch))


def test_a_trial_reports_the_surrogates_curve_at_its_cumulative_training_times(tmp_path: Path) -> None:
    """One trial of a known configuration on one slot: every epoch ends at the surrogate's cumulative
    ``time`` and reports its ``val_accuracy``; the trial's value is the last epoch's."""
    spec = yahpo_spec("167168", epochs=12, search={"algorithm": "random", "n_trials": 1,
                                                    "enqueue": [CONFIG]})
    engine = SimulatedEngine(SimulatedOptions.model_validate(spec["engine_options"]))
    seen = _Seen()
    engine.observer = seen
    result = hpoflow.optimize(spec, tmp_path / "run", engine=engine, handle_signals=False)
    curve = surrogate().curves("167168", [CONFIG], 12)[0]
    assert [(e, round(t, 6), v) for _, e, t, v in seen.epochs] == \
        [(k, round(row["time"], 6), row["val_accuracy"]) for k, row in enumerate(curve, 1)]
    assert seen.ends == [(0, "complete", 12)] and engine.epochs_trained == 12
    trial = result.study.trials[0]
    assert trial.value == curve[-1]["val_accuracy"]
    assert trial.intermediate_values[5] == curve[4]["val_accuracy"]
    assert trial.user_attrs["timings"]["duration_s"] == pytest.approx(curve[-1]["time"], rel=1e-6)
    assert curve[-1]["val_accuracy"] > curve[0]["val_accuracy"]  # it learns: the encoding is not noise


def test_fidelities_evaluate_a_trial_from_scratch_at_each_of_them(tmp_path: Path) -> None:
    """``fidelities: [2, 6, 17, 52]`` (the YAHPO paper's Optuna arm): the trial's k-th report is the
    surrogate at the k-th fidelity, and it ends after every fidelity trained one after another (2 + 6 +
    17 + 52 epochs' time); a fidelity list that does not increase is refused."""
    spec = yahpo_spec("167168", fidelities=[2, 6, 17, 52],
                      search={"algorithm": "random", "n_trials": 1, "enqueue": [CONFIG]})
    assert spec["training"]["epochs"] == 4
    engine = SimulatedEngine(SimulatedOptions.model_validate(spec["engine_options"]))
    seen = _Seen()
    engine.observer = seen
    result = hpoflow.optimize(spec, tmp_path / "run", engine=engine, handle_signals=False)
    curve = surrogate().curves("167168", [CONFIG], 52)[0]
    at = [curve[f - 1] for f in (2, 6, 17, 52)]
    ends = [sum(r["time"] for r in at[:k + 1]) for k in range(4)]
    assert [(e, round(t, 6), v) for _, e, t, v in seen.epochs] == \
        [(k, round(end, 6), row["val_accuracy"]) for k, (end, row) in enumerate(zip(ends, at, strict=True), 1)]
    assert result.study.trials[0].value == curve[51]["val_accuracy"]
    with pytest.raises(ValueError, match="increasing"):
        SimulatedOptions.model_validate({**spec["engine_options"],
                                         "cost": {**spec["engine_options"]["cost"], "fidelities": [6, 2]}})


def test_an_unknown_instance_or_metric_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match=r"not an instance of this surrogate; use one of: .*167168"):
        yahpo_spec("12345")
    spec = yahpo_spec("167168", search={"algorithm": "random", "n_trials": 2})
    spec["engine_options"]["cost"]["instance"] = "12345"
    with pytest.raises((EngineError, SpecError), match="12345"):
        hpoflow.optimize(spec, tmp_path / "run", handle_signals=False)
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_the_benchmark_accounts_for_every_epoch_once_and_its_json_recomputes(tmp_path: Path) -> None:
    """A reduced run of the paper's protocol (1,000 epochs, 2 reps, 3 arms): the run stops at the budget;
    a promoted trial trains each epoch once (a resume does not retrain); every value in the JSON is the
    surrogate's for that configuration and epoch; ``--recompute`` prints the same regrets, also from the
    runs split over two files (one table: the arms normalized together)."""
    out = tmp_path / "b.json"
    cmd = [sys.executable, str(ROOT / "bench" / "search_benchmark.py"), "--instance", "167168", "--reps", "2",
           "--arms", "random,tpe+median,bohb+promo", "--budget-epochs", "1000", "--reference", "2000",
           "--out", str(out)]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    doc = json.loads(out.read_text())
    block = doc["instances"]["167168"]
    summary = block["summary"]
    sur = surrogate()
    paused_then_resumed = 0
    for r in block["runs"]:
        assert len(r["epochs"]) == 1000  # the budget, exactly: the driver stopped what ran past it
        per_trial: dict[str, list[int]] = {}
        for n, e, _t, _v in r["epochs"]:
            per_trial.setdefault(str(n), []).append(int(e))
        for n, epochs in per_trial.items():
            assert epochs == list(range(1, len(epochs) + 1)), (r["arm"], n, epochs)  # each epoch once, in order
        paused_then_resumed += sum(1 for n in per_trial if [s for m, s, _, _ in r["ends"] if str(m) == n][:1] ==
                                   ["paused"] and len(per_trial[n]) > 2)
        some = r["epochs"][:: max(1, len(r["epochs"]) // 25)]
        curves = sur.curves("167168", [r["trials"][str(n)] for n, *_ in some], 52)
        assert [v for *_, v in some] == [c[int(e) - 1]["val_accuracy"] for (_, e, _, _), c in zip(some, curves,
                                                                                                     strict=True)]
    assert paused_then_resumed > 0  # promotion ASHA resumed paused trials
    # when the soonest of the 2,000 reference configurations, trained alone, reaches Random's final regret
    soonest = summary["earliest_random_final_s"]
    assert soonest is None or soonest > 0
    assert "the soonest any of 2,000 random configurations gets there" in run.stdout
    for arm, row in summary["arms"].items():
        assert 0.0 <= row["paper"]["final"] <= row["paper"]["at25"] <= row["paper"]["at10"] <= 1.0, arm
    halves = []
    for i, arms in enumerate([("random", "tpe+median"), ("bohb+promo",)]):
        part = {**doc, "instances": {"167168": {**block, "runs": [r for r in block["runs"] if r["arm"] in arms]}}}
        halves.append(tmp_path / f"part{i}.json")
        halves[-1].write_text(json.dumps(part))

    def rows(stdout: str) -> dict[str, list[str]]:
        return {ln.split()[0]: ln.split()[1:7] for ln in stdout.splitlines() if ln.split()[:1] and
                ln.split()[0] in summary["arms"]}

    for files in (str(out), ",".join(map(str, halves))):
        again = subprocess.run([sys.executable, str(ROOT / "bench" / "search_benchmark.py"), "--recompute", files,
                                "--reach", "50"], capture_output=True, text=True, timeout=120, check=False)
        assert again.returncode == 0, again.stderr[-2000:]
        assert rows(again.stdout) == rows(run.stdout) and len(rows(run.stdout)) == 3, files
        # --reach: every arm's repetitions that reach 50 % (each run's best is far above it on 167168)
        reach = next(ln for ln in again.stdout.splitlines() if ln.startswith("reached accuracy 50 "))
        for arm in summary["arms"]:
            assert f"{arm} 2/2 at " in reach, reach




def test_the_soonest_search_finds_a_configuration_that_reaches_the_target_when_it_says(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``soonest_search`` (the benchmark's check of how soon any configuration reaches Random's final regret):
    its local search never ends later than its random sample, and the configuration it names reaches the
    target, by the surrogate, at the time it gives and not an epoch sooner."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # (the script imports bench/_common.py)
    search_benchmark = importlib.import_module("search_benchmark")

    target = 75.0
    found = search_benchmark.soonest_search("167168", None, target, n=400, rounds=3, keep=10, children=5)
    assert found["searched_soonest_s"] <= found["random_soonest_s"] < float("inf")
    curve = surrogate().curves("167168", [found["config"]], 52)[0]
    first = next(row for row in curve if row["val_accuracy"] >= target)
    assert first["time"] == pytest.approx(found["searched_soonest_s"])
