"""examples/scripts/train_ddp.py, a plain torchrun script, runs unchanged under ``torchrun
--nproc-per-node 2`` and under ``hpoflow run examples/scripts/ddp.yaml`` (2-rank trials on the local
engine), and promotion ASHA and PBT run studies of it that resume from what it saved in
``HPOFLOW_CHECKPOINT_DIR`` without training an epoch twice."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.run.ledger import ATTR_LINEAGE, ATTR_SEGMENTS
from tests.conftest import ROOT, RUN_ENV

pytestmark = pytest.mark.slow  # real torch programs: an interpreter and a torch import per rank and run

SCRIPT = ROOT / "examples" / "scripts" / "train_ddp.py"
SPEC = yaml.safe_load((ROOT / "examples" / "scripts" / "ddp.yaml").read_text())


def test_the_script_runs_as_it_is_under_torchrun(tmp_path: Path) -> None:
    torchrun = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    # TMPDIR: torchrun's log directories (torchelastic_*, which torch leaves behind) go in the test's directory
    r = subprocess.run([torchrun, "--nproc-per-node", "2", str(SCRIPT), "--epochs", "2"],
                       env={**RUN_ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.findall(r"^epoch=(\d) val_loss=\S+ val_accuracy=\S+$", r.stdout, re.M) == ["1", "2"], r.stdout


def test_hpoflow_runs_the_example_spec_with_two_rank_trials(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "hpoflow", "run", "examples/scripts/ddp.yaml", "--run-dir",
                        str(tmp_path / "run"), "--json"], env={**RUN_ENV, "HPOFLOW_N_TRIALS": "2"},
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["n_complete"] == 2
    for rank in (0, 1):
        log = (tmp_path / "run" / "trials" / "0" / f"rank{rank}.log").read_text()
        assert f"command: rank {rank} runs" in log and "the program exited with code 0" in log
    assert len(re.findall(r"^epoch=\d ", (tmp_path / "run" / "trials" / "0" / "rank0.log").read_text(), re.M)) == 8


def _trained(run_dir: Path, number: int) -> list[int]:
    """The epochs trial ``number`` trained, over all its runs: its rank 0 log's reports."""
    log = (run_dir / "trials" / str(number) / "rank0.log").read_text()
    return [int(e) for e in re.findall(r"^epoch=(\d+) ", log, re.M)]


def _scheduled(name: str, scheduler: dict[str, Any], n_trials: int, enqueue: list[dict[str, Any]]) -> dict[str, Any]:
    data = copy.deepcopy(SPEC)
    data["study"]["name"] = name
    data["search"].update({"n_trials": n_trials, "scheduler": scheduler, "enqueue": enqueue, "algorithm": "random"})
    del data["search"]["pruner"]
    data["training"]["command"][-1] = "2"  # --epochs
    data["training"]["epochs"] = 2
    data["resources"]["processes"] = 1
    return data


def test_promotion_asha_and_pbt_resume_the_script_from_its_checkpoints(tmp_path: Path) -> None:
    os.chdir(ROOT)  # the command's paths are relative to where hpoflow runs
    good, bad = {"lr": 0.3, "hidden": 32}, {"lr": 0.01, "hidden": 16}
    # one slot, the good configuration first: it pauses at the rung (epoch 1) alone, the bad one joins it,
    # and the good one is promoted and resumes from its checkpoint
    asha = optimize(_scheduled("asha", {"type": "asha", "min_resource": 1, "reduction_factor": 2}, 2,
                               [good, bad]), tmp_path / "asha").study
    first = asha.trials[0]
    assert first.state == TrialState.COMPLETE, [(t.number, t.state, t.value) for t in asha.trials]
    assert [s["step"] for s in first.user_attrs[ATTR_SEGMENTS]] == [1]
    assert _trained(tmp_path / "asha", 0) == [1, 2]  # no epoch trained again
    assert "resumed from" in (tmp_path / "asha" / "trials" / "0" / "rank0.log").read_text()
    pbt = optimize(_scheduled("pbt", {"type": "pbt", "population": 2, "interval": 1, "quantile": 0.5,
                                      "hyperparams": ["lr"]}, 4, [good, bad]), tmp_path / "pbt").study
    assert [t.state for t in pbt.trials] == [TrialState.COMPLETE] * 4
    for t in pbt.trials:
        lineage = t.user_attrs[ATTR_LINEAGE]
        assert _trained(tmp_path / "pbt", t.number) == list(range(lineage["start"] + 1, lineage["end"] + 1))
    assert any(t.user_attrs[ATTR_LINEAGE]["donor"] is not None for t in pbt.trials)  # an exploit copied a checkpoint
