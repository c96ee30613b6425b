"""What each energy figure is (hpoflow.train.energy, docs/energy.md), on CPU with fakes: RAPL zones picked
by their name file (a client platform's psys zone is the whole platform, package included; DRAM is outside
the package's counter), the raw counters reported beside the attributed share, an idle power measured
before the trial (only where nothing else of the machine's trials can be running), and a GPU in MIG mode
named by its index or GPU- UUID, whose counter is every instance's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from hpoflow.train import energy as energy_mod
from hpoflow.train import rapl as rapl_mod
from hpoflow.train.energy import EnergyMeter, FixtureNvml, Rapl, meter_for_rank
from hpoflow.trial import aggregate_usage

TOP = 262_143_328_850


def _zone(root: Path, zone: str, name: str | None, uj: int = 1_000_000_000) -> None:
    d = root / zone
    d.mkdir(parents=True)
    (d / "energy_uj").write_text(f"{uj}\n")
    (d / "max_energy_range_uj").write_text(f"{TOP}\n")
    if name is not None:
        (d / "name").write_text(f"{name}\n")


def _advance(root: Path, zone: str, joules: float) -> None:
    f = root / zone / "energy_uj"
    f.write_text(f"{int(f.read_text()) + round(joules * 1e6)}\n")


def _client_platform(tmp_path: Path) -> Path:
    """An Intel client part as Linux shows it: package 0 with its core/uncore/dram subzones, psys (the
    platform, which includes package 0) as intel-rapl:1, and package 0 again through MMIO."""
    root = tmp_path / "powercap"
    _zone(root, "intel-rapl:0", "package-0")
    _zone(root, "intel-rapl:0:0", "core")
    _zone(root, "intel-rapl:0:1", "uncore")
    _zone(root, "intel-rapl:0:2", "dram")
    _zone(root, "intel-rapl:1", "psys")
    _zone(root, "intel-rapl-mmio:0", "package-0")
    _zone(root, "intel-rapl:2", None)  # a zone whose name cannot be read: left out, not guessed
    return root


def test_zones_are_picked_by_name_and_psys_is_not_counted_twice(tmp_path: Path) -> None:
    root = _client_platform(tmp_path)
    assert Rapl.zones(root) == {"package": [root / "intel-rapl:0"], "dram": [root / "intel-rapl:0:2"]}
    rapl = Rapl(root).start()
    _advance(root, "intel-rapl:0", 30.0)
    _advance(root, "intel-rapl:0:0", 20.0)
    _advance(root, "intel-rapl:0:1", 4.0)
    _advance(root, "intel-rapl:0:2", 6.0)
    _advance(root, "intel-rapl:1", 45.0)  # the platform: package 0's 30 J and the rest of the board
    _advance(root, "intel-rapl-mmio:0", 30.0)
    _advance(root, "intel-rapl:2", 99.0)
    rapl.sample()
    assert rapl.joules() == pytest.approx(30.0)  # package 0 once: not psys, not MMIO, not the unnamed zone
    assert rapl.dram_joules() == pytest.approx(6.0)


def test_dram_is_its_own_raw_figure_outside_the_cpu_share_and_the_total(tmp_path: Path) -> None:
    root = tmp_path / "powercap"  # a two-socket server: DRAM is a subzone of each package
    for n in (0, 1):
        _zone(root, f"intel-rapl:{n}", f"package-{n}")
        _zone(root, f"intel-rapl:{n}:0", "dram")
    meter = EnergyMeter(cpu_share=0.25, powercap_root=root).start()
    _advance(root, "intel-rapl:0", 80.0)
    _advance(root, "intel-rapl:1", 40.0)
    _advance(root, "intel-rapl:0:0", 9.0)
    _advance(root, "intel-rapl:1:0", 3.0)
    out = meter.stop()
    assert out["cpu_energy_j_raw"] == pytest.approx(120.0)  # both packages, whole: measured
    assert out["cpu_energy_j"] == pytest.approx(30.0) and out["cpu_energy_share"] == 0.25  # attributed
    assert out["dram_energy_j_raw"] == pytest.approx(12.0)
    assert out["energy_j"] == out["cpu_energy_j"]  # DRAM is in no total
    assert "cpu_idle_w" not in out and "energy_above_idle_j" not in out  # a quarter of the machine: no idle


class _Clock:
    """``time`` for the meter and the RAPL reader: ``sleep`` advances the clock (and the packages at
    ``watts``, as the kernel would)."""

    def __init__(self, root: Path | None = None, watts: float = 0.0) -> None:
        self.t = 1000.0
        self.root, self.watts = root, watts
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return 1_764_000_000.0 + self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds
        if self.root is not None:
            _advance(self.root, "intel-rapl:0", self.watts * seconds)


def test_an_idle_power_measured_before_a_whole_machine_trial_is_subtracted_beside_the_attribution(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "powercap"
    _zone(root, "intel-rapl:0", "package-0")
    clock = _Clock(root, watts=20.0)  # the machine idles at 20 W before the trial
    monkeypatch.setattr(rapl_mod, "time", clock)
    monkeypatch.setattr(energy_mod, "time", clock)
    meter = EnergyMeter(cpu_share=1.0, powercap_root=root, baseline_s=0.25).start()
    assert clock.slept == [0.25]  # the rank waited that long for the window
    clock.t += 10.0
    _advance(root, "intel-rapl:0", 500.0)  # 50 W over the trial's 10 s
    out = meter.stop()
    assert out["cpu_energy_j_raw"] == pytest.approx(500.0)  # the window is not in the trial's span
    assert out["cpu_energy_j"] == pytest.approx(500.0) and out["cpu_energy_share"] == 1.0
    assert out["cpu_idle_w"] == pytest.approx(20.0)
    assert out["cpu_energy_above_idle_j"] == pytest.approx(500.0 - 20.0 * 10.0)
    assert out["energy_j"] == pytest.approx(500.0)  # the total keeps its meaning: idle included
    assert out["energy_above_idle_j"] == pytest.approx(300.0)


def test_no_idle_window_where_other_trials_may_run_on_the_machine(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "powercap"
    _zone(root, "intel-rapl:0", "package-0")
    clock = _Clock(root, watts=20.0)
    monkeypatch.setattr(rapl_mod, "time", clock)
    monkeypatch.setattr(energy_mod, "time", clock)
    meter = EnergyMeter(cpu_share=0.5, powercap_root=root, baseline_s=0.25).start()
    assert clock.slept == []  # half the machine: its other half's trials would be in the window
    _advance(root, "intel-rapl:0", 100.0)
    out = meter.stop()
    assert out["cpu_energy_j"] == pytest.approx(50.0) and out["cpu_energy_j_raw"] == pytest.approx(100.0)
    assert not {"cpu_idle_w", "cpu_energy_above_idle_j", "energy_above_idle_j"} & set(out)
    monkeypatch.setenv(energy_mod.BASELINE_ENV, "0")  # the window can be turned off
    EnergyMeter(cpu_share=1.0, powercap_root=root).start().stop()
    assert clock.slept == []


def _nvml(tmp_path: Path, clock: _Clock, **device: Any) -> FixtureNvml:
    rec = {"t0": clock.time(), "devices": [
        {"index": 0, "uuid": "GPU-5c1e7e2a-3f0d-4b7e-9a51-8d0c2f6b1a93", "name": "NVIDIA H100 80GB HBM3",
         "energy_mj": [[0.0, 1_000_000], [10.0, 4_000_000]], "processes": 0, **device}]}  # 300 W
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(rec))
    return FixtureNvml(path, clock=clock.time)


def test_gpu_raw_figure_beside_the_time_share_and_an_idle_power_read_before_the_rank_uses_the_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    monkeypatch.setattr(energy_mod, "time", clock)
    nvml = _nvml(tmp_path, clock, power_mw=70_000)  # nothing on the device yet: 70 W
    meter = EnergyMeter(gpus=[0], nvml=nvml).start()
    nvml.devices[0].update(pids=[os.getpid()], power_mw=300_000)  # the rank's own context
    clock.t += 4.0
    meter.sample()
    nvml.devices[0]["pids"] = [os.getpid(), 4242]  # another trial's process joins: split by 2
    clock.t += 4.0
    out = meter.stop()
    assert out["gpu_energy_j_raw"] == pytest.approx(2400.0)  # the device's counter over 8 s at 300 W
    assert out["gpu_energy_j"] == pytest.approx(1200.0 + 600.0)  # alone for 4 s, then half of it
    assert out["gpu_energy_share"] == pytest.approx(0.75)
    assert out["gpu_idle_w"] == pytest.approx(70.0)
    assert out["gpu_energy_above_idle_j"] == pytest.approx((2400.0 - 70.0 * 8.0) * 0.75)
    assert out["energy_above_idle_j"] == out["gpu_energy_above_idle_j"]


@pytest.mark.parametrize(("device", "whole"), [({"pids": [1]}, True), ({}, False)],
                         ids=["another-process-on-it", "a-share-of-it"])
def test_no_gpu_idle_power_where_the_device_is_not_the_rank_s_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, device: dict[str, Any], whole: bool) -> None:
    clock = _Clock()
    monkeypatch.setattr(energy_mod, "time", clock)
    meter = EnergyMeter(gpus=[0], nvml=_nvml(tmp_path, clock, power_mw=70_000, **device), gpus_whole=whole).start()
    clock.t += 2.0
    out = meter.stop()
    assert out["gpu_energy_j_raw"] > 0 and "energy_j" in out
    assert not {"gpu_idle_w", "gpu_energy_above_idle_j", "energy_above_idle_j"} & set(out)


def test_meter_for_rank_treats_a_gpu_share_as_not_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.delenv("HPOFLOW_GPU_SHARE", raising=False)
    assert meter_for_rank(1, 1, 1, 1).gpus_whole
    monkeypatch.setenv("HPOFLOW_GPU_SHARE", "0.25")
    assert not meter_for_rank(1, 1, 1, 0.25).gpus_whole


@pytest.mark.parametrize("name", ["0", "GPU-5c1e7e2a-3f0d-4b7e-9a51-8d0c2f6b1a93"], ids=["by-index", "by-uuid"])
def test_a_gpu_in_mig_mode_named_as_the_gpu_has_no_counter_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    clock = _Clock()
    monkeypatch.setattr(energy_mod, "time", clock)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", name)
    nvml = _nvml(tmp_path, clock, mig=True)
    meter = EnergyMeter(gpus=energy_mod.visible_gpus(1), nvml=nvml).start()
    clock.t += 2.0
    assert meter.stop() == {}  # the GPU's counter counts every instance: not this rank's to claim
    nvml.devices[0]["mig"] = False
    meter = EnergyMeter(gpus=energy_mod.visible_gpus(1), nvml=nvml).start()
    clock.t += 2.0
    assert meter.stop()["gpu_energy_j"] > 0


def test_a_trial_keeps_its_above_idle_total_only_where_every_rank_had_one() -> None:
    ranks = [{"energy_j": 10.0, "energy_above_idle_j": 4.0, "gpu_idle_w": 70.0},
             {"energy_j": 12.0, "energy_above_idle_j": 5.0, "gpu_idle_w": 65.0}]
    merged = aggregate_usage(ranks)
    assert merged["energy_above_idle_j"] == 9.0 and merged["gpu_idle_w"] == 135.0 and merged["energy_j"] == 22.0
    partial = aggregate_usage([ranks[0], {"energy_j": 12.0}])  # rank 1's GPU had another process on it
    assert "energy_above_idle_j" not in partial and partial["energy_j"] == 22.0
