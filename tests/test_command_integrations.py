"""The Lightning and Hugging Face example scripts (examples/scripts/train_lightning.py, train_hf.py), with
the real packages: each runs unchanged (Lightning's progress bar on, ``DataLoader`` worker processes, the
Trainer evaluating every few steps) under ``torchrun --nproc-per-node 2`` and as a study's 2-rank trials
(``hpoflow.api.optimize``, the driver ``hpoflow run`` runs), where the framework's own DDP starts from
torchrun's environment; its hpoflow callback (``hpoflow.integrations``) reports the framework's metrics at
each validation (step: the validation count), and stops the trainer of a trial the median pruner prunes
(the program ends by itself: no SIGTERM). Pause and resume under promotion ASHA:
tests/test_integrations_asha.py."""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, RUN_ENV

pytestmark = pytest.mark.slow  # real frameworks: a torch, Lightning or transformers import per rank

# script, spec, the module to skip without, a good and a bad configuration (the bad one is worse after
# its first validation), the metric its callback reports beside the study's, the validations of 1 and of 3
# epochs on 2 ranks (Lightning: one an epoch; the Trainer: every 8 of its 16 steps an epoch)
CASES = {
    "lightning": ("train_lightning.py", "lightning.yaml", "lightning", {"lr": 0.3, "hidden": 64},
                  {"lr": 0.001, "hidden": 16}, "val_accuracy", 1, 3),
    "hf": ("train_hf.py", "hf.yaml", "transformers", {"lr": 0.006, "hidden": 32}, {"lr": 1.0, "hidden": 16},
           "eval_runtime", 2, 6),
}
# the line either script prints after each validation (for people; hpoflow does not read it)
VALIDATED = re.compile(r"^(?:validation|evaluation): step (\d+), epoch ", re.M)


def _torchrun() -> str:
    return shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_script_runs_as_it_is_under_torchrun(tmp_path: Path, case: str) -> None:
    """Its temporary files (``TMPDIR``: the test's directory) go with it; torch's own (torchrun's log
    directories ``torchelastic_*``, inductor's cache ``torchinductor_USER``, which torch leaves behind) stay
    in the test's directory, not the machine's."""
    script, _spec, module, _good, _bad, _extra, one, _three = CASES[case]
    pytest.importorskip(module)
    r = subprocess.run([_torchrun(), "--nproc-per-node", "2", f"examples/scripts/{script}", "--epochs", "1"],
                       env={**RUN_ENV, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=600,
                       cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(VALIDATED.findall(r.stdout)) == one, r.stdout[-2000:]
    left = sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(("torchelastic_", "torchinductor_")))
    assert left == [], left


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_script_runs_unchanged_as_2_rank_hpoflow_trials_and_its_callback_stops_a_pruned_one(
        tmp_path: Path, case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The study runs in-process (``hpoflow.api.optimize``, the driver ``hpoflow run`` runs, on this
    process's preloaded forkserver): what is checked is the trials' programs, not the driver's process.
    The command's paths are relative to the repository root, so the study runs from there."""
    from hpoflow.api import optimize

    _script, spec_name, module, good, bad, extra, _one, three = CASES[case]
    pytest.importorskip(module)
    data: dict[str, Any] = copy.deepcopy(yaml.safe_load((ROOT / "examples" / "scripts" / spec_name).read_text()))
    data["space"]["lr"] = {"type": "float", "low": 1e-4, "high": 1.0, "log": True}
    data["search"].update(n_trials=2, enqueue=[good, bad], pruner={"type": "median", "startup_trials": 1,
                                                                          "warmup_steps": 0})
    data["training"]["command"][-1] = "3"  # --epochs
    data["training"]["epochs"] = three  # the validations of 3 epochs
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(data))
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("PYTHONPATH", RUN_ENV["PYTHONPATH"])
    res = optimize(spec, tmp_path / "run")
    summary = res.summary
    assert (summary.n_complete, summary.n_pruned) == (1, 1), summary
    trials = tmp_path / "run" / "trials"
    for rank in (0, 1):  # both ranks' programs ran, warm, and ended by themselves
        log = (trials / "1" / f"rank{rank}.log").read_text()
        assert "warm (runpy" in log and "the program exited with code 0" in log, log[-2000:]
        assert "SIGTERM" not in log  # the callback stopped the trainer of the pruned trial
    assert len(VALIDATED.findall((trials / "0" / "rank0.log").read_text())) == three
    assert len(VALIDATED.findall((trials / "1" / "rank0.log").read_text())) == 1  # pruned at its first
    # the steps the callback reported: the validation count, nothing more from the lines the program printed
    assert sorted(res.study.trials[0].intermediate_values) == list(range(1, three + 1))
    assert sorted(res.study.trials[1].intermediate_values) == [1]
    csv_header = (tmp_path / "run" / "trials.csv").read_text().splitlines()[0]
    assert f"metric_{extra}" in csv_header  # reported by the callback, not printed by the script
