"""examples/cluster_resnet.yaml, the cluster template: valid for the compss engine as shipped, and its
training function (ResNet-18, synthetic CIFAR-shaped data) trains for real in a CPU-sized variant:
2 gloo ranks, a checkpoint every epoch, ASHA pruning, through the local engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from hpoflow.cli.main import main
from tests.engines._fakes import ROOT

EXAMPLE = ROOT / "examples" / "cluster_resnet.yaml"


def test_the_cluster_template_validates_for_compss(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["validate", str(EXAMPLE)]) == 0
    assert "engine compss" in capsys.readouterr().out
    from hpoflow.engines.compss import CompssOptions
    from hpoflow.spec import load_spec

    spec, _ = load_spec(EXAMPLE)
    shape = CompssOptions.from_mapping(spec.engine_option_values()).task_shape(spec.resources)
    assert shape.registration().constraints == (
        "computing_units:16;memory_size:64;processors:[{processorType: GPU, computingUnits: 2}];")
    assert shape.nodes == 2 and spec.search.pruner.type == "asha"


@pytest.mark.slow
def test_the_training_function_runs_cpu_sized(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpoflow.api import optimize

    data = yaml.safe_load(EXAMPLE.read_text())
    data.update(engine="local", compss={})
    data["resources"] = {"processes": 2, "cpus_per_process": 1, "timeout": 600}
    data["search"].update(n_trials=3, max_concurrent=1, timeout=None)
    data["search"]["pruner"] = {"type": "asha", "min_resource": 1, "reduction_factor": 2}
    data["space"]["batch_size"] = {"type": "categorical", "choices": [16]}
    data["training"].update(epochs=2)
    # one step of 16 per rank and epoch (32 samples over 2 ranks): what is checked is that it trains, reports,
    # checkpoints and prunes over gloo, which one step per epoch does as well as more; with the example's own
    # DataLoader workers (num_workers: 4, persistent), which a local trial's rank may start
    assert data["training"]["options"]["num_workers"] == 4
    data["training"]["options"].update(synthetic_train=32, synthetic_val=16)
    monkeypatch.chdir(ROOT / "examples")  # the function is imported from the current directory
    result = optimize(data, tmp_path / "run")
    trials = result.study.get_trials(deepcopy=False)
    assert len(trials) == 3
    states = [t.state.name for t in trials]
    assert states.count("COMPLETE") >= 1 and set(states) <= {"COMPLETE", "PRUNED"}, [
        t.user_attrs.get("error") for t in trials]
    first = trials[0]
    assert first.value is not None and 0.0 <= first.value <= 1.0 and sorted(first.intermediate_values) == [1, 2]
    ckpts = sorted(p.name for p in (tmp_path / "run" / "trials" / "0" / "checkpoints").rglob("*") if p.is_file())
    assert ckpts, "a checkpoint every epoch"
