"""`python workflows/hpo.py SPEC --run-dir DIR` without the COMPSs runtime: the sequential fallback."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpoflow.engines.compss.launch.command import encode_app_value
from tests.engines._fakes import ROOT

# The trial is the engine contract's torch-free one (its value is its parameter): what is checked is the
# workflow script's sequential fallback (arguments, run directory, results, resume), not the trainer,
# which the local engine's tests train; a rank that imports no torch saves about 5 CPU-s a trial.
SPEC = """\
study: {name: wf-tiny, metric: value, direction: maximize}
space:
  value: {type: float, low: 0.1, high: 0.9}
search: {algorithm: random, n_trials: 2, seed: 3}
training: {function: "tests.trainfns_light:behave"}
resources: {processes: 1, cpus_per_process: 1}
engine: compss
"""

pytestmark = pytest.mark.slow  # runs workflows/hpo.py studies


def test_workflow_runs_a_two_trial_study_sequentially(tmp_path: Path) -> None:
    spec = tmp_path / "tiny spec $(x).yaml"
    spec.write_text(SPEC)
    run_dir = tmp_path / "my run; caf\u00e9"  # passed encoded, as `hpoflow launch` does
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPSS_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # tests.trainfns_light
    proc = subprocess.run([sys.executable, "-O", str(ROOT / "workflows" / "hpo.py"), encode_app_value(str(spec)),
                           "--run-dir", encode_app_value(str(run_dir))], capture_output=True, text=True,
                          timeout=180, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "sequential mode" in proc.stderr
    assert "2 complete, 0 pruned, 0 failed" in proc.stdout
    for n in ("0", "1"):
        result = json.loads((run_dir / "trials" / n / "result.json").read_text())
        assert result["status"] == "complete" and 0.0 < result["value"] <= 1.0
        task_result = json.loads((run_dir / "trials" / n / "attempt-0" / "result.json").read_text())
        assert task_result["value"] == result["value"]
        assert (run_dir / "trials" / n / "rank0.log").exists()
    rows = list(csv.DictReader((run_dir / "trials.csv").open()))
    assert len(rows) == 2
    assert (run_dir / "best.yaml").exists() and (run_dir / "spec.yaml").exists()
    # rerunning the same command resumes: the budget is spent, nothing new runs
    again = subprocess.run([sys.executable, str(ROOT / "workflows" / "hpo.py"), str(spec), "--run-dir",
                            str(run_dir)], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert again.returncode == 0, again.stderr[-3000:]
    assert sorted(p.name for p in (run_dir / "trials").iterdir()) == ["0", "1"]
