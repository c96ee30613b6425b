"""Light commands stay light: `hpoflow --help` (every subcommand's help), `validate`, `status`,
`schema` and `launch --dry-run` never import torch, in a fresh interpreter (torch alone costs seconds to import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import runpy, sys, json\nmodule = sys.argv[2]\n"
         "sys.argv = ['hpoflow', *json.loads(sys.argv[1])]\ncode = 0\ntry:\n"
         "    runpy.run_module('hpoflow', run_name='__main__')\nexcept SystemExit as e:\n"
         "    code = e.code or 0\nprint(json.dumps([module in sys.modules, code]), file=sys.stderr)\n")


def _heavy(args: list[str], cwd: Path, module: str = "torch") -> tuple[bool, int]:
    """(whether ``module`` was imported, exit code) of ``hpoflow ARGS`` in a fresh interpreter."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args), module], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    loaded, code = json.loads(r.stderr.strip().splitlines()[-1])
    return bool(loaded), int(code)


@pytest.mark.parametrize("args", [["--help"], ["oracle", "--help"], ["run", "--help"], ["schema"],
                                  ["validate", str(ROOT / "examples" / "digits.yaml")],
                                  ["launch", str(ROOT / "examples" / "digits.yaml"), "--engine", "compss",
                                   "--dry-run"]])
def test_a_light_command_does_not_import_torch(args: list[str], tmp_path: Path) -> None:
    torch_loaded, code = _heavy(args, tmp_path)
    assert code == 0 and not torch_loaded, args


@pytest.mark.parametrize("command", ["run", "validate"])
def test_a_spec_that_does_not_load_is_refused_without_importing_optuna(command: str, tmp_path: Path) -> None:
    """The spec is read first: a mistake in it costs the command no Optuna import (half of a refusal's
    CPU), whose message is the same as the run's own check would give (tests/spec)."""
    spec = tmp_path / "bad.yaml"
    spec.write_text("study: {name: light, metric: value, direction: sideways}\n")
    optuna_loaded, code = _heavy([command, str(spec), *(["--run-dir", str(tmp_path / "run")] if command == "run"
                                                       else [])], tmp_path, "optuna")
    assert code == 2 and not optuna_loaded, command
    assert not (tmp_path / "run").exists()


def test_help_names_the_engines_truthfully() -> None:
    """It said "(local or PyCOMPSs)"; hpoflow also runs studies on SLURM."""
    from hpoflow.cli.main import build_parser

    text = " ".join(build_parser().format_help().split())
    assert "(engines: local, SLURM, PyCOMPSs)" in text and "local or PyCOMPSs" not in text, text


def test_status_does_not_import_torch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import hpoflow
    from hpoflow.engines.threads import ThreadEngine

    spec = {"study": {"name": "light", "metric": "x", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 2, "seed": 0},
            "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False}}
    monkeypatch.chdir(ROOT)  # the spec's function is importable from here
    hpoflow.optimize(spec, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 1))
    torch_loaded, code = _heavy(["status", str(tmp_path / "run")], tmp_path)
    assert code == 0 and not torch_loaded


def test_status_of_a_finished_run_answers_from_its_snapshot_until_the_journal_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import optuna

    import hpoflow
    from hpoflow.engines.threads import ThreadEngine
    from hpoflow.run.open import load_run

    spec = {"study": {"name": "snap", "metric": "x", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 3, "seed": 0},
            "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False}}
    monkeypatch.chdir(ROOT)
    run = tmp_path / "run"
    hpoflow.optimize(spec, run, engine=ThreadEngine(lambda p, r: p["x"], 1))
    assert (run / "status.json").exists()

    def status() -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-m", "hpoflow", "status", str(run), "--json"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert r.returncode == 0, r.stderr
        return dict(json.loads(r.stdout))

    optuna_loaded, code = _heavy(["status", str(run)], tmp_path, module="optuna")
    assert code == 0 and not optuna_loaded  # answered from the snapshot: the storage is not opened
    fast = status()
    assert fast["n_complete"] == 3 and fast["n_trials"] == 3
    # The same answer as from the storage itself:
    from hpoflow.report.tables import status_dict

    study, label = load_run(run)
    assert fast == json.loads(json.dumps(status_dict(study, label, budget=3)))
    # Another process adds a trial to the study: the snapshot is stale, status reads the storage.
    study.add_trial(optuna.trial.create_trial(params={"x": 0.99}, distributions={
        "x": optuna.distributions.FloatDistribution(0.0, 1.0)}, value=0.99))
    optuna_loaded, code = _heavy(["status", str(run)], tmp_path, module="optuna")
    assert code == 0 and optuna_loaded
    assert status()["n_complete"] == 4
