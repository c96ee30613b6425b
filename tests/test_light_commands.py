"""Light commands stay light: `hpoflow --help` (every subcommand's help), `validate`, `status`,
`schema` and `launch --dry-run` never import torch, in a fresh interpreter (torch alone costs seconds to import)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = ("import runpy, sys, json\nsys.argv = ['hpoflow', *json.loads(sys.argv[1])]\ncode = 0\ntry:\n"
         "    runpy.run_module('hpoflow', run_name='__main__')\nexcept SystemExit as e:\n"
         "    code = e.code or 0\nprint(json.dumps(['torch' in sys.modules, code]), file=sys.stderr)\n")


def _heavy(args: list[str], cwd: Path) -> tuple[bool, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", PROBE, json.dumps(args)], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=120)
    torch_loaded, code = json.loads(r.stderr.strip().splitlines()[-1])
    return bool(torch_loaded), int(code)


@pytest.mark.parametrize("args", [["--help"], ["oracle", "--help"], ["run", "--help"], ["schema"],
                                  ["validate", str(ROOT / "examples" / "digits.yaml")],
                                  ["launch", str(ROOT / "examples" / "digits.yaml"), "--engine", "compss",
                                   "--dry-run"]])
def test_a_light_command_does_not_import_torch(args: list[str], tmp_path: Path) -> None:
    torch_loaded, code = _heavy(args, tmp_path)
    assert code == 0 and not torch_loaded, args


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
