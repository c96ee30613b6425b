"""Energy per trial in real local-engine studies (docs/energy.md): ``system_energy_j`` filled from a
/sys/class/powercap fixture tree whose counters advance as the kernel's do (written by a thread here,
read by the trials' own processes through HPOFLOW_POWERCAP_ROOT), energy as an objective and a
constraint (infeasible trials off the front), and ``search.energy_budget_kwh`` stopping the study."""

from __future__ import annotations

import csv
import itertools
import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from hpoflow.api.preflight import check_energy
from hpoflow.errors import SpecError
from hpoflow.report.tables import pareto_front
from hpoflow.run.storage import open_storage
from hpoflow.spec import spec_from_mapping
from tests.conftest import ROOT, RUN_ENV

FIXTURE = ROOT / "tests" / "train" / "energy_fixtures" / "powercap"
WATTS = {"intel-rapl:0": 60.0, "intel-rapl:1": 40.0}  # the packages' power while the study runs
MACHINE_W = sum(WATTS.values())
SHARE = 1 / (os.cpu_count() or 1)  # a 1-core trial's share of this machine's package energy


class _Rapl:
    """A copy of the fixture tree whose package counters advance at ``WATTS`` (and wrap at
    ``max_energy_range_uj``: package 1 1.5 s after the start), every 10 ms, written atomically."""

    def __init__(self, root: Path) -> None:
        shutil.copytree(FIXTURE, root)
        self.root = root
        self.top = {z: int((root / z / "max_energy_range_uj").read_text()) for z in WATTS}
        self.start = {z: int((root / z / "energy_uj").read_text()) for z in WATTS}
        self.start["intel-rapl:1"] = self.top["intel-rapl:1"] - 60_000_000  # wraps 1.5 s in, as trials run
        self.done = threading.Event()
        self.t0 = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.wait(0.01):
            dt = time.monotonic() - self.t0
            for zone, watts in WATTS.items():
                value = (self.start[zone] + int(watts * 1e6 * dt)) % (self.top[zone] + 1)
                tmp = self.root / zone / ".energy_uj"
                tmp.write_text(f"{value}\n")
                os.replace(tmp, self.root / zone / "energy_uj")


@pytest.fixture
def rapl(tmp_path: Path) -> Iterator[_Rapl]:
    counters = _Rapl(tmp_path / "powercap")
    counters.thread.start()
    try:
        yield counters
    finally:
        counters.done.set()
        counters.thread.join(timeout=10)


def _spec(**changes: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "study": {"name": "energy", "metric": "value", "direction": "minimize"},
        "space": {"x": {"type": "categorical", "choices": [0.0, 0.25, 0.5, 0.75, 1.0]}},
        "search": {"algorithm": "grid", "max_concurrent": 1, "fail_fast": 0},
        "training": {"function": "tests.trainfns_light:energy_nap"},
        "resources": {"processes": 1, "cpus_per_process": 1},
        "oracle": {"enabled": False}}
    for key, value in changes.items():
        spec[key] = {**spec[key], **value}
    return spec


def _run(tmp_path: Path, spec: dict[str, Any], rapl: _Rapl,
         more_env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], Path]:
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(spec))
    run_dir = tmp_path / "run"
    env = {**RUN_ENV, "HPOFLOW_POWERCAP_ROOT": str(rapl.root)}
    for key in ("HPOFLOW_NVML_FIXTURE", "CUDA_VISIBLE_DEVICES"):
        env.pop(key, None)
    env.update(more_env or {})
    r = subprocess.run([sys.executable, "-m", "hpoflow", "run", str(f), "--run-dir", str(run_dir), "--json"],
                       env=env, cwd=ROOT, capture_output=True, text=True, timeout=240)
    return r, run_dir


def _rows(run_dir: Path) -> list[dict[str, str]]:
    with (run_dir / "trials.csv").open() as fh:
        return sorted(csv.DictReader(fh), key=lambda row: int(row["number"]))


def _study(run_dir: Path) -> optuna.Study:
    return optuna.load_study(study_name="energy", storage=open_storage(None, run_dir))


def test_energy_is_measured_and_infeasible_trials_are_off_the_front(tmp_path: Path, rapl: _Rapl) -> None:
    """Two objectives, ``value`` and ``system_energy_j`` (a real trade-off: a lower value sleeps longer),
    and an energy constraint that the longest trials break."""
    bound = MACHINE_W * SHARE * 0.45  # J: about a trial that slept 0.45 s
    spec = _spec(study={"metrics": [{"name": "value", "direction": "minimize"},
                                    {"name": "system_energy_j", "direction": "minimize"}],
                        "constraints": [f"system_energy_j <= {bound:.6f}"]})
    r, run_dir = _run(tmp_path, spec, rapl)
    assert r.returncode == 0, r.stderr
    rows = _rows(run_dir)
    assert len(rows) == 5 and all(row["state"] == "COMPLETE" for row in rows)
    for row in rows:  # read from the counters: the trial's share of what the packages used while it ran
        joules = float(row["system_energy_j"])
        assert joules == float(row["system_cpu_energy_j"]) and float(row["system_cpu_energy_share"]) == \
            pytest.approx(SHARE, abs=1e-4)
        slept = 0.1 + 0.6 * float(row["param_x"])
        measured_s = joules / (MACHINE_W * SHARE)
        assert row["energy_split"] == f"cpu: core_share {float(row['system_cpu_energy_share']):.4g}"
        assert slept - 0.05 <= measured_s <= float(row["timing_engine_duration_s"]) + 0.05
    study = _study(run_dir)
    front = {f["number"] for f in pareto_front(study)}
    energy = {int(row["number"]): float(row["system_energy_j"]) for row in rows}
    value = {int(row["number"]): 1.0 - float(row["param_x"]) for row in rows}
    infeasible = {n for n, e in energy.items() if e > bound}
    assert infeasible and len(infeasible) < len(rows)  # x = 0.75 and 1 slept longer than the bound allows
    feasible = set(energy) - infeasible
    expected = {n for n in feasible if not any(value[m] <= value[n] and energy[m] <= energy[n]
                                               and (value[m], energy[m]) != (value[n], energy[n]) for m in feasible)}
    assert front == expected and not front & infeasible


def test_the_energy_budget_stops_new_trials_once_spent(tmp_path: Path, rapl: _Rapl) -> None:
    budget_j = MACHINE_W * SHARE * 1.0  # about two or three trials' energy
    spec = _spec(space={"x": {"type": "float", "low": 0.0, "high": 1.0}},
                 search={"algorithm": "random", "n_trials": 30, "seed": 3,
                         "energy_budget_kwh": budget_j / 3.6e6})
    r, run_dir = _run(tmp_path, spec, rapl)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["stopped_by"] == "energy_budget"
    assert "search.energy_budget_kwh" in r.stderr and "is spent" in r.stderr
    rows = _rows(run_dir)
    energies = [float(row["system_energy_j"]) for row in rows]  # one slot: each started after the last ended
    assert 0 < len(rows) < 30 and all(row["state"] == "COMPLETE" for row in rows)
    assert sum(energies[:-1]) < budget_j <= sum(energies)  # the last trial started under it, and spent it
    status = json.loads(subprocess.run([sys.executable, "-m", "hpoflow", "status", str(run_dir), "--json"],
                                       env=RUN_ENV, cwd=ROOT, capture_output=True, text=True,
                                       timeout=60).stdout)
    assert status["energy_kwh"] == pytest.approx(sum(energies) / 3.6e6, rel=1e-6)


@pytest.mark.slow  # (a GPU trial imports torch in its worker: 5-9 s on 2 cores)
def test_gpu_energy_from_the_nvml_fixture_on_a_stand_in_gpu(tmp_path: Path, rapl: _Rapl) -> None:
    """A GPU trial on a stand-in GPU (CUDA_VISIBLE_DEVICES=0; it trains on CPU): its GPU figure is the
    replayed NVML counter of device 0 over its run, whole (no other process on the device), and its total
    adds the CPU share."""
    recording = json.loads((FIXTURE.parent / "nvml_h100.json").read_text())
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps({**recording, "t0": time.time()}))  # the recording plays from now on
    points = recording["devices"][0]["energy_mj"]
    watts = [(b[1] - a[1]) / 1000 / (b[0] - a[0]) for a, b in itertools.pairwise(points)]
    spec = _spec(search={"algorithm": "grid", "n_trials": 1}, resources={"gpus_per_process": 1},
                 space={"x": {"type": "categorical", "choices": [0.5]}})
    r, run_dir = _run(tmp_path, spec, rapl, {"HPOFLOW_NVML_FIXTURE": str(path), "CUDA_VISIBLE_DEVICES": "0"})
    assert r.returncode == 0, r.stderr
    (row,) = _rows(run_dir)
    gpu = float(row["system_gpu_energy_j"])
    assert min(watts) * 0.35 <= gpu <= max(watts) * (float(row["timing_engine_duration_s"]) + 0.05)
    assert float(row["system_gpu_energy_share"]) == 1.0 and row["energy_split"].endswith("; gpu: whole_device")
    assert float(row["system_energy_j"]) == pytest.approx(gpu + float(row["system_cpu_energy_j"]), abs=2e-3)


def _mapping(**study: Any) -> dict[str, Any]:
    return _spec(study={"metrics": [{"name": "value", "direction": "minimize"},
                                    {"name": "system_energy_j", "direction": "minimize"}], **study})


def test_energy_needed_but_unreadable_is_refused_or_warned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("HPOFLOW_POWERCAP_ROOT", str(tmp_path / "none"))  # a machine without RAPL
    with pytest.raises(SpecError, match=r"study.metrics\[1\].name: objective 'system_energy_j' needs energy"):
        check_energy(spec_from_mapping(_mapping()))
    only_budget = _spec(search={"energy_budget_kwh": 0.5}, study={"constraints": ["system_cpu_energy_j <= 9"]})
    with caplog.at_level(logging.WARNING, logger="hpoflow"):
        check_energy(spec_from_mapping(only_budget))  # runs, but says the budget and constraint cannot work
    assert "every trial counts as infeasible" in caplog.text and "the budget is never spent" in caplog.text
    monkeypatch.setenv("HPOFLOW_POWERCAP_ROOT", str(FIXTURE))
    caplog.clear()
    check_energy(spec_from_mapping(_mapping()))  # counters readable: nothing to say
    assert not caplog.text


def test_a_system_figure_cannot_be_the_first_objective() -> None:
    with pytest.raises(SpecError, match="system_energy_j' is a system_ figure"):
        spec_from_mapping(_spec(study={"metric": "system_energy_j"}))
