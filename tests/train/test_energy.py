"""The energy readers (hpoflow.train.energy) against recorded fixtures, on CPU: a /sys/class/powercap tree
whose counters advance (one package wraps around, a root-only energy_uj as on Linux >= 5.10, none at
all), and NVML's answers replayed from a JSON recording (counters in mJ; a device without the counter)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hpoflow.report.tables import energy_split
from hpoflow.train.energy import EnergyMeter, FixtureNvml, Rapl, load_nvml, visible_gpus
from hpoflow.train.usage import UsageSampler
from hpoflow.trial import aggregate_usage

FIXTURES = Path(__file__).resolve().parent / "energy_fixtures"
PACKAGES = ("intel-rapl:0", "intel-rapl:1")


def _tree(tmp_path: Path) -> Path:
    root = tmp_path / "powercap"
    shutil.copytree(FIXTURES / "powercap", root)
    return root


def _uj(root: Path, zone: str, name: str = "energy_uj") -> int:
    return int((root / zone / name).read_text())


def _advance(root: Path, zone: str, uj: int) -> None:
    """What the kernel does: the counter grows, and wraps to 0 past max_energy_range_uj."""
    top = _uj(root, zone, "max_energy_range_uj")
    value = _uj(root, zone) + uj
    (root / zone / "energy_uj").write_text(f"{value - top if value > top else value}\n")


class _Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _recording(t0: float) -> dict[str, object]:
    data = json.loads((FIXTURES / "nvml_h100.json").read_text())
    return {**data, "t0": t0}


def _nvml(tmp_path: Path, clock: _Clock) -> FixtureNvml:
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(_recording(clock.t)))
    return FixtureNvml(path, clock=clock)


def _counter(nvml: FixtureNvml, t: float, path: Path) -> int:
    """The recording's device-0 counter ``t`` seconds after ``nvml``'s time 0, in mJ (read by another
    replay of the same file, whose clock stands there)."""
    at = FixtureNvml(path, clock=lambda: nvml.t0 + t)
    return at.nvmlDeviceGetTotalEnergyConsumption(at.nvmlDeviceGetHandleByIndex(0))


def test_rapl_adds_what_each_package_counter_advanced_and_leaves_subzones_out(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    rapl = Rapl(root).start()
    assert rapl.readable
    _advance(root, "intel-rapl:0", 12_500_000)
    _advance(root, "intel-rapl:0:0", 9_000_000)  # a part of package 0: never added
    rapl.sample()
    _advance(root, "intel-rapl:0", 7_500_000)
    _advance(root, "intel-rapl:1", 3_000_000)
    rapl.sample()
    assert rapl.joules() == pytest.approx((12_500_000 + 7_500_000 + 3_000_000) / 1e6)


def test_rapl_counts_a_counter_that_wrapped_around_since_the_last_sample(tmp_path: Path) -> None:
    root = _tree(tmp_path)
    before = _uj(root, "intel-rapl:1")
    top = _uj(root, "intel-rapl:1", "max_energy_range_uj")
    rapl = Rapl(root).start()
    step = top - before + 40_000_000  # past the top: the counter restarts near 0
    _advance(root, "intel-rapl:1", step)
    assert _uj(root, "intel-rapl:1") < before  # it did wrap
    rapl.sample()
    assert rapl.joules() == pytest.approx(step / 1e6)


def test_rapl_absent_is_unreadable_and_gives_no_figure(tmp_path: Path) -> None:
    assert not Rapl(tmp_path / "no-powercap").start().readable
    (tmp_path / "empty").mkdir()
    meter = EnergyMeter(cpu_share=0.5, powercap_root=tmp_path / "empty").start()
    assert meter.stop() == {}  # no counter: the columns stay empty, never an estimate


_UNPRIVILEGED = """
import json, os, sys
from hpoflow.train.energy import EnergyMeter, Rapl  # (imported as root: the interpreter lives under /root)
os.setgid(65534); os.setuid(65534)  # then read as an unprivileged user
root = sys.argv[1]
from pathlib import Path
print(json.dumps({"zones": len(Rapl.packages(Path(root))), "readable": Rapl(root).start().readable,
                  "figures": EnergyMeter(cpu_share=0.5, powercap_root=root).start().stop()}))
"""


def test_a_root_only_energy_uj_is_unreadable_as_on_linux_5_10(tmp_path: Path) -> None:
    """Since Linux 5.10 (CVE-2020-8694) energy_uj is mode 0400, root's: an unprivileged rank reads
    nothing, and its CPU figure and total stay empty."""
    base = Path(os.environ.get("TMPDIR", "/tmp")) / f"hpoflow-rapl-{os.getpid()}"
    root = _tree(base) if os.geteuid() == 0 else _tree(tmp_path)
    try:
        for zone in PACKAGES:
            (root / zone / "energy_uj").chmod(0o400 if os.geteuid() == 0 else 0o000)
        if os.geteuid() != 0:
            assert not Rapl(root).start().readable
            assert EnergyMeter(cpu_share=0.5, powercap_root=root).start().stop() == {}
            return
        for d in (base, root, *(root / z for z in PACKAGES)):  # the tree may be walked, its counters not read
            d.chmod(0o755)
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
        out = subprocess.run([sys.executable, "-c", _UNPRIVILEGED, str(root)], capture_output=True, text=True,
                             env=env, cwd="/", timeout=60)
        assert out.returncode == 0, out.stderr
        # the package zones are there to see, their counters not to read
        assert json.loads(out.stdout) == {"zones": 2, "readable": False, "figures": {}}
        assert Rapl(root).start().readable  # root itself still reads it
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_nvml_counters_in_mj_become_joules_of_the_rank_and_a_total_with_the_cpu_share(tmp_path: Path) -> None:
    clock = _Clock(1_764_000_000.0)
    nvml = _nvml(tmp_path, clock)
    root = _tree(tmp_path)
    meter = EnergyMeter(gpus=[0], cpu_share=0.25, powercap_root=root, nvml=nvml).start()
    clock.t += 2.0
    meter.sample()
    _advance(root, "intel-rapl:0", 40_000_000)
    clock.t += 1.75  # between two recorded samples: the counter is interpolated
    out = meter.stop()
    gpu_j = (_counter(nvml, 3.75, tmp_path / "nvml.json") - _counter(nvml, 0.0, tmp_path / "nvml.json")) / 1000
    assert gpu_j > 0
    assert out["gpu_energy_j"] == pytest.approx(gpu_j, abs=1e-3) and out["gpu_energy_share"] == 1.0
    assert out["cpu_energy_j"] == pytest.approx(40.0 * 0.25) and out["cpu_energy_share"] == 0.25
    assert out["energy_j"] == pytest.approx(out["gpu_energy_j"] + out["cpu_energy_j"], abs=1e-3)


def test_a_shared_gpu_is_split_by_time_share(tmp_path: Path) -> None:
    """Alone on the device for the first interval, sharing it with another process for the second, with
    three more MPS clients for the third: the rank is given the first interval's energy, half the
    second's and a quarter of the third's, and says which part it had."""
    clock = _Clock(1_764_000_000.0)
    nvml = _nvml(tmp_path, clock)
    meter = EnergyMeter(gpus=["GPU-5c1e7e2a-3f0d-4b7e-9a51-8d0c2f6b1a93"], nvml=nvml).start()
    clock.t += 1.5
    meter.sample()
    nvml.devices[0]["processes"] = 2  # another trial's rank started on the same GPU
    clock.t += 2.5
    meter.sample()
    nvml.devices[0].update(processes=1, mps_processes=4)  # under MPS: NVML lists the server, and 4 clients
    clock.t += 1.0
    out = meter.stop()
    rec = tmp_path / "nvml.json"
    alone = _counter(nvml, 1.5, rec) - _counter(nvml, 0.0, rec)
    shared = _counter(nvml, 4.0, rec) - _counter(nvml, 1.5, rec)
    mps = _counter(nvml, 5.0, rec) - _counter(nvml, 4.0, rec)
    mine = alone + shared / 2 + mps / 4
    assert out["gpu_energy_j"] == pytest.approx(mine / 1000, abs=1e-3)
    assert out["gpu_energy_share"] == pytest.approx(mine / (alone + shared + mps), abs=1e-4)
    assert out["gpu_energy_share"] < 1.0  # the label: this figure is a time-share split
    assert energy_split(out) == f"gpu: time_share {out['gpu_energy_share']:.4g}"  # (trials.csv's energy_split)
    assert out["energy_j"] == out["gpu_energy_j"]  # (no CPU counter read by this rank: not its node's rank 0)


def test_a_gpu_without_the_counter_leaves_gpu_and_total_empty(tmp_path: Path) -> None:
    clock = _Clock(1_764_000_000.0)
    root = _tree(tmp_path)
    meter = EnergyMeter(gpus=[1], cpu_share=1.0, powercap_root=root, nvml=_nvml(tmp_path, clock)).start()
    _advance(root, "intel-rapl:0", 5_000_000)
    out = meter.stop()
    # the CPU part alone is no total (the DRAM zone, intel-rapl:0:1, did not advance)
    assert out == {"cpu_energy_j": 5.0, "cpu_energy_share": 1.0, "cpu_energy_j_raw": 5.0, "dram_energy_j_raw": 0.0}


def test_a_trial_total_needs_every_rank_to_have_one() -> None:
    whole = [{"energy_j": 10.0, "cpu_energy_j": 4.0, "gpu_energy_j": 6.0, "gpu_energy_share": 1.0},
             {"energy_j": 5.0, "gpu_energy_j": 5.0, "gpu_energy_share": 0.5}]
    merged = aggregate_usage(whole)
    assert merged["energy_j"] == 15.0 and merged["gpu_energy_j"] == 11.0 and merged["gpu_energy_share"] == 0.75
    partial = aggregate_usage([whole[0], {"cpu_percent": 90.0}])  # rank 1's GPU had no readable counter
    assert "energy_j" not in partial and partial["gpu_energy_j"] == 6.0


def test_the_test_hooks_pick_the_fixtures(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HPOFLOW_NVML_FIXTURE", str(FIXTURES / "nvml_h100.json"))
    assert isinstance(load_nvml(), FixtureNvml)
    root = _tree(tmp_path)
    monkeypatch.setenv("HPOFLOW_POWERCAP_ROOT", str(root))
    assert Rapl().start().readable
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,GPU-5c1e7e2a-3f0d-4b7e-9a51-8d0c2f6b1a93")
    assert visible_gpus(2) == [1, "GPU-5c1e7e2a-3f0d-4b7e-9a51-8d0c2f6b1a93"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1f5b8a2c-0c1d-5e2b-9a3f-1c2d3e4f5a6b")
    assert EnergyMeter(gpus=visible_gpus(1), nvml=load_nvml()).start().stop() == {}  # a MIG instance: no counter


@pytest.mark.parametrize(("visible", "cuda_device", "device"), [
    ("1", 0, 1), ("1,0", 1, 0), ("GPU-0b7f1d44-9e2a-4c1b-8f3e-6a5d2c1b0e77", 0, 1), (None, 0, 0)],
    ids=["an-index", "the-second-of-two", "a-uuid", "none-set"])
def test_gpu_utilisation_is_the_device_cuda_visible_devices_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, cuda_device: int, device: int) -> None:
    """The usage sampler's ``gpu_util_percent`` of ``cuda:K`` is NVML's device that ``CUDA_VISIBLE_DEVICES``
    names K-th (as the energy reader resolves it), not NVML's device K."""
    rec = _recording(0.0)
    busy = {0: 11, 1: 83}
    for d in rec["devices"]:  # type: ignore[attr-defined]
        d["utilization_gpu"] = busy[d["index"]]
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(rec))
    monkeypatch.setenv("HPOFLOW_NVML_FIXTURE", str(path))
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    summary = UsageSampler(cuda_device=cuda_device).start().stop()
    assert summary["gpu_util_percent"] == busy[device]


def test_a_mig_instance_has_no_gpu_utilisation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NVML finds a MIG instance by its UUID but answers NOT_SUPPORTED for its utilisation: no figure,
    not the parent GPU's (nor device 0's)."""
    rec = _recording(0.0)
    for d in rec["devices"]:  # type: ignore[attr-defined]
        d["utilization_gpu"] = 50
    mig = {"uuid": "MIG-1f5b8a2c-0c1d-5e2b-9a3f-1c2d3e4f5a6b", "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb",
           "energy_mj": None, "processes": 1}
    rec["devices"] = [*rec["devices"], mig]  # type: ignore[misc]
    path = tmp_path / "nvml.json"
    path.write_text(json.dumps(rec))
    monkeypatch.setenv("HPOFLOW_NVML_FIXTURE", str(path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1f5b8a2c-0c1d-5e2b-9a3f-1c2d3e4f5a6b")
    summary = UsageSampler(cuda_device=0).start().stop()
    assert "gpu_util_percent" not in summary and "cpu_percent" in summary
