"""End to end through the CLI: a real study, its run directory, status, signals and resume."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from hpoflow.spec import spec_from_mapping
from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def hpoflow(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpoflow", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV, cwd=ROOT)


def write(tmp_path: Path, spec: dict[str, Any]) -> Path:
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    return f


@pytest.mark.slow
def test_run_writes_a_complete_run_directory(tmp_path: Path, tiny_spec: dict[str, Any]) -> None:
    spec_file = write(tmp_path, tiny_spec)
    run_dir = tmp_path / "run"
    p = hpoflow("run", str(spec_file), "--run-dir", str(run_dir))
    assert p.returncode == 0, p.stderr
    assert "best trials of tiny" in p.stdout
    assert (run_dir / "spec.yaml").read_text() == spec_file.read_text()  # the spec as given
    rows = (run_dir / "trials.csv").read_text().strip().split("\n")
    assert len(rows) == 4 and rows[0].startswith("number,state,value,param_hidden,param_lr")
    best = yaml.safe_load((run_dir / "best.yaml").read_text())
    assert best["best_value"] > 0.5 and set(best["best_params"]) == {"lr", "hidden"}
    # the final line: the best value with 4 significant digits, as the table (it printed 0.9888888888888889)
    final = re.search(r"; best (\S+) \(trial \d+\) with (\S+=\S+) (\S+=\S+)$", " ".join(p.stdout.split()))
    assert final is not None, p.stdout
    assert final.group(1) == f"{best['best_value']:.4g}", p.stdout
    assert dict(kv.split("=") for kv in final.groups()[1:]) == {"hidden": str(best["best_params"]["hidden"]),
                                                                  "lr": f"{best['best_params']['lr']:.4g}"}, p.stdout
    rerun = spec_from_mapping(best["rerun_spec"])  # a spec that reruns the best configuration
    assert rerun.search.algorithm == "grid" and rerun.search.n_trials == 1
    for n in range(3):
        assert (run_dir / "trials" / str(n) / "rank0.log").exists()
        assert json.loads((run_dir / "trials" / str(n) / "result.json").read_text())["status"] == "complete"

    status = hpoflow("status", str(run_dir), "--json")
    assert status.returncode == 0, status.stderr
    s = json.loads(status.stdout)
    for key in ("study_name", "storage", "n_complete", "n_running", "n_failed", "n_pruned", "best_value",
                "best_params"):
        assert key in s
    assert s["n_complete"] == 3 and s["study_name"] == "tiny" and s["best_value"] == best["best_value"]

    # Plain Optuna, in another process, sees every trial with its params and value.
    code = (
        "import optuna, json, sys\n"
        "from optuna.storages import JournalStorage\n"
        "from optuna.storages.journal import JournalFileBackend\n"
        f"st = optuna.load_study(study_name='tiny', storage=JournalStorage(JournalFileBackend({s['storage']!r})))\n"
        "print(json.dumps([[t.number, t.state.name, t.value, t.params] for t in st.trials]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    trials = json.loads(out.stdout)
    assert len(trials) == 3
    assert all(state == "COMPLETE" and value is not None and set(params) == {"lr", "hidden"}
               for _, state, value, params in trials)


@pytest.mark.slow
def test_sqlite_storage_url(tmp_path: Path, tiny_spec: dict[str, Any]) -> None:
    """A study in an SQLite database that plain Optuna then reads. In-process (``hpoflow.api.optimize``,
    the driver the CLI runs): what is checked is the storage, not the process; the CLI's --json
    summary of a run on an SQLite URL is checked in tests/run/test_rundir.py (its fixed storage)."""
    from hpoflow.api import optimize

    tiny_spec["storage"] = f"sqlite:///{tmp_path / 'study.db'}"
    tiny_spec["search"]["n_trials"] = 2
    assert optimize(write(tmp_path, tiny_spec), tmp_path / "run").summary.n_complete == 2
    import optuna

    assert len(optuna.load_study(study_name="tiny", storage=tiny_spec["storage"]).trials) == 2


@pytest.mark.slow
def test_sigterm_midway_then_rerun_finishes_exactly_n_trials(tmp_path: Path, tiny_spec: dict[str, Any]) -> None:
    tiny_spec["search"]["n_trials"] = 6
    tiny_spec["training"]["epochs"] = 6
    spec_file = write(tmp_path, tiny_spec)
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hpoflow", "run", str(spec_file), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    seen: set[int] = set()
    t0 = time.monotonic()
    # Wait until a trial has finished and others are running, remembering every process it started.
    while time.monotonic() - t0 < 120:
        seen |= {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}
        if list(run_dir.glob("trials/*/result.json")) and len(seen) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "rerun the same command to resume" in err
    time.sleep(0.5)
    alive = [pid for pid in seen if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert alive == [], f"orphans: {alive}"

    again = subprocess.run([*args, "--json"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr
    status = json.loads(again.stdout)
    assert status["n_complete"] == 6 and status["n_failed"] == 0  # exactly n_trials, none lost or doubled
    assert status["n_running"] == 0 and status["n_waiting"] == 0


@pytest.mark.slow
def test_status_lists_the_interrupted_trials_and_the_trial_that_reran_each(tmp_path: Path) -> None:
    """After a Ctrl-C, trials/0 and trials/1 stay on disk with "cancelled" results and the study reruns
    them under new numbers: ``status`` names them and their reruns, before the resume and after it."""
    spec = {"study": {"name": "chain", "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 3, "max_concurrent": 2, "seed": 3},
            "training": {"function": "trainfns_light:slow", "options": {"sleep": 1.5, "steps": 5}},
            "oracle": {"enabled": False}}
    spec_file = write(tmp_path, spec)
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hpoflow", "run", str(spec_file), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
    t0 = time.monotonic()
    while not all((run_dir / "trials" / n / "rank0.log").exists() for n in ("0", "1")):
        assert proc.poll() is None and time.monotonic() - t0 < 120, proc.stderr.read() if proc.stderr else ""
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    for n in (0, 1):
        assert json.loads((run_dir / "trials" / str(n) / "result.json").read_text())["status"] == "cancelled"

    def chain() -> tuple[dict[int, int], str]:
        js = hpoflow("status", str(run_dir), "--json")
        assert js.returncode == 0, js.stderr
        status = json.loads(js.stdout)
        links = {x["trial"]: x["rerun_as"] for x in status["interrupted"]}
        assert status["n_interrupted"] == len(links)
        text = hpoflow("status", str(run_dir))
        assert text.returncode == 0, text.stderr
        return links, text.stdout

    links, text = chain()
    assert set(links) == {0, 1} and len(set(links.values())) == 2 and not set(links.values()) & {0, 1}, links
    assert f"0 -> {links[0]}" in text and f"1 -> {links[1]}" in text, text

    again = subprocess.run([*args, "--json"], capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["n_complete"] == 3
    after, text = chain()  # (from the finished run's status snapshot)
    assert after == links and f"0 -> {links[0]}" in text, text
