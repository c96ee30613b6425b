"""``hpoflow scaling``: fixed parameters, the oversubscription rule, and a real 1-vs-2-rank run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hpoflow.cli.main import main
from hpoflow.errors import EngineError, SpecError
from hpoflow.scaling import fixed_params, run_scaling
from hpoflow.spec import spec_from_mapping

SPEC: dict[str, Any] = {
    "study": {"name": "sc", "metric": "val_accuracy", "direction": "maximize"},
    "space": {
        "lr": {"type": "float", "low": 0.05, "high": 0.2},
        "optimizer": {"type": "categorical", "choices": ["sgd", "adam"]},
        "momentum": {"type": "float", "low": 0.5, "high": 0.9, "when": {"optimizer": "adam"}},
    },
    "search": {"algorithm": "random", "n_trials": 2},
    "training": {"model": "mlp", "model_options": {"hidden": 32}, "epochs": 1, "batch_size": 64,
                 "optimizer": "${optimizer}", "lr": "${lr}", "momentum": "${momentum}"},
}


def test_fixed_params_take_first_choice_low_end_and_skip_inactive() -> None:
    spec = spec_from_mapping(SPEC)
    assert fixed_params(spec) == {"lr": 0.05, "optimizer": "sgd"}
    assert fixed_params(spec, {"optimizer": "adam"}) == {"lr": 0.05, "optimizer": "adam",
                                                         "momentum": 0.5}
    with pytest.raises(SpecError, match=r"no search parameter .*did you mean 'lr'"):
        fixed_params(spec, {"lrr": 0.1})


def test_more_ranks_than_cores_is_refused_without_oversubscribe(tmp_path: Path) -> None:
    spec = spec_from_mapping(SPEC)
    with pytest.raises(EngineError, match="--oversubscribe"):
        run_scaling(spec, [1, 3], cores=[0, 1], run_dir=tmp_path)


def test_cli_scaling_json_reports_weak_and_strong_efficiency(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]
                                                            ) -> None:
    import yaml

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC, sort_keys=False))
    code = main(["scaling", str(path), "--world-sizes", "1,2", "--params", "lr=0.1", "--json",
                 "--run-dir", str(tmp_path / "runs")])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, out
    assert out["params"] == {"lr": 0.1, "optimizer": "sgd"}
    assert out["oversubscribed"] is False
    rows = {(p["mode"], p["world_size"]): p for p in out["points"]}
    assert set(rows) == {("weak", 1), ("weak", 2), ("strong", 1), ("strong", 2)}
    assert rows[("strong", 2)]["batch_size"] == 32 and rows[("weak", 2)]["global_batch"] == 128
    for p in out["points"]:
        assert p["status"] == "complete"
        assert p["metrics"]["samples_per_s"] > 0
        assert p["efficiency"] is not None and p["efficiency"] > 0
    assert rows[("weak", 1)]["efficiency"] == pytest.approx(1.0)
    assert 0 < rows[("weak", 2)]["metrics"]["comm_fraction"] < 1
