"""Energy a trial used, from the machine's own counters: never an estimate.

Two sources, each read where it is readable, else left out (its figure stays empty):

- **GPU**: NVML's energy counter, ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded;
  Volta and newer), through ``pynvml`` (the ``nvidia-ml-py`` package, the ``nvml`` extra) of each GPU
  the rank was given (``CUDA_VISIBLE_DEVICES``: indices or ``GPU-`` UUIDs; a MIG instance has no counter
  of its own). A GPU shared with other processes (fractional GPUs) is split by time share: at each sample
  the energy since the last one is divided by the number of processes NVML lists on the device (its MPS
  clients under an MPS daemon, else its compute processes; at least 1). ``gpu_energy_share`` is the part
  of the devices' energy this rank was given (1.0: whole devices; below 1: the time-share split).
- **CPU**: the package counters of RAPL (``/sys/class/powercap/intel-rapl:<n>/energy_uj``, µJ, wrapping at
  ``max_energy_range_uj``; subzones such as ``intel-rapl:0:0`` are parts of a package, not added). The
  counter is the whole machine's, shared by every trial running on it: the trial is given its share of the
  machine's cores (``cpu_energy_share`` = the trial's cores on this node / the machine's cores). Only one
  rank per node reads it (the node's local rank 0), so a node is counted once per trial. Linux >= 5.10
  makes ``energy_uj`` readable by root only (CVE-2020-8694): unprivileged, the CPU figure is empty.

Counters are sampled by the usage sampler's ticks (``hpoflow.train.usage``), so a RAPL counter that wraps
between two samples (minutes apart at the least) is counted right, and each NVML interval gets the number
of processes sharing the device then.

``energy_j`` is the sum of the rank's sources, present only when every source the rank has is readable
(a rank with no source of its own, a non-zero local rank of a CPU trial, reports 0.0): a partial sum is
never passed off as the total. ``hpoflow.trial.aggregate_usage`` keeps a trial's ``energy_j`` only where
every rank reported one.

Test hooks (documented in docs/energy.md): ``HPOFLOW_POWERCAP_ROOT`` replaces ``/sys/class/powercap`` (a
directory tree of the same shape), ``HPOFLOW_NVML_FIXTURE`` replaces pynvml with ``FixtureNvml``, which
replays a JSON recording of a device's answers.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["EnergyMeter", "FixtureNvml", "NvmlUnreadable", "Rapl", "device_handle", "load_nvml", "meter_for_rank",
           "probe", "visible_gpus"]

POWERCAP_ROOT = Path("/sys/class/powercap")
_MJ_PER_J = 1000.0
_UJ_PER_J = 1_000_000.0


class NvmlUnreadable(Exception):
    """The fixture's stand-in for NVML's errors (``NVMLError_NotSupported``, no such device)."""


# -- CPU: RAPL -------------------------------------------------------------------------------------------
@dataclass
class _Zone:
    path: Path
    max_uj: int | None
    last: int
    total_uj: int = 0


class Rapl:
    """The CPU package counters under ``root`` (``/sys/class/powercap``): ``start`` reads them,
    ``sample`` adds what each advanced since (once around the counter where it wrapped), ``joules`` is
    the sum so far. ``readable`` is False where no package counter could be read (none, or root only)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else _powercap_root()
        self._zones: list[_Zone] = []

    @staticmethod
    def packages(root: Path) -> list[Path]:
        """The package zones (``intel-rapl:<n>``, not their subzones ``intel-rapl:<n>:<m>``)."""
        try:
            entries = sorted(root.iterdir())
        except OSError:
            return []
        return [p for p in entries if p.name.startswith("intel-rapl:") and p.name.count(":") == 1]

    def start(self) -> Rapl:
        self._zones = []
        for zone in self.packages(self.root):
            value = _read_int(zone / "energy_uj")
            if value is not None:
                self._zones.append(_Zone(zone, _read_int(zone / "max_energy_range_uj"), value))
        return self

    @property
    def readable(self) -> bool:
        return bool(self._zones)

    def sample(self) -> None:
        for z in self._zones:
            value = _read_int(z.path / "energy_uj")
            if value is None:
                continue
            if value >= z.last:
                z.total_uj += value - z.last
            elif z.max_uj:  # wrapped around once since the last sample
                z.total_uj += z.max_uj - z.last + value
            z.last = value

    def joules(self) -> float:
        return sum(z.total_uj for z in self._zones) / _UJ_PER_J


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, root only (kernels >= 5.10), or not a number
        return None


def _powercap_root() -> Path:
    return Path(os.environ.get("HPOFLOW_POWERCAP_ROOT") or POWERCAP_ROOT)


# -- GPU: NVML --------------------------------------------------------------------------------------------
class FixtureNvml:
    """pynvml's calls that ``EnergyMeter`` and the usage sampler (``hpoflow.train.usage``) make, answered
    from a recording (``HPOFLOW_NVML_FIXTURE``)::

        {"t0": 1764200000.0,                       # wall clock of the recording's time 0 (default: load time)
         "devices": [{"index": 0, "uuid": "GPU-...", "name": "...",
                      "energy_mj": [[0.0, 81234567], [0.5, 81234712], ...],   # (s, counter) pairs, or null
                      "processes": 1,                                          # compute processes listed
                      "mps_processes": 0,                                      # MPS clients listed
                      "utilization_gpu": 37}]}                                 # % busy (optional)

    The counter at wall time ``t`` is the recording's, linearly between its samples, and past its end
    advancing at the recording's mean rate (a device's counter never stops). ``energy_mj: null`` is a
    device without the counter (pre-Volta: ``NVMLError_NotSupported``). Every process reading the same
    file with the same ``t0`` sees the same counter at the same time, as with one real device."""

    def __init__(self, path: Path | str, clock: Callable[[], float] = time.time) -> None:
        data = json.loads(Path(path).read_text())
        self.clock = clock  # wall clock (tests: a clock they step)
        self.t0 = float(data.get("t0", clock()))
        self.devices: list[dict[str, Any]] = list(data.get("devices", []))

    def nvmlInit(self) -> None:
        pass

    def nvmlDeviceGetHandleByIndex(self, index: int) -> dict[str, Any]:
        for d in self.devices:
            if int(d.get("index", -1)) == index:
                return d
        raise NvmlUnreadable(f"no device {index}")

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> dict[str, Any]:
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        for d in self.devices:
            if d.get("uuid") == text:
                return d
        raise NvmlUnreadable(f"no device {text}")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: dict[str, Any]) -> int:
        points = handle.get("energy_mj")
        if not points:
            raise NvmlUnreadable("NVML_ERROR_NOT_SUPPORTED")
        return round(_replay([(float(t), float(v)) for t, v in points], self.clock() - self.t0))

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> SimpleNamespace:
        """``.gpu``: the device's ``utilization_gpu`` (%); not supported where the recording has none."""
        util = handle.get("utilization_gpu")
        if util is None:
            raise NvmlUnreadable("NVML_ERROR_NOT_SUPPORTED")
        return SimpleNamespace(gpu=int(util), memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> list[int]:
        return list(range(int(handle.get("processes", 1))))

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: dict[str, Any]) -> list[int]:
        return list(range(int(handle.get("mps_processes", 0))))


def _replay(points: list[tuple[float, float]], t: float) -> float:
    """The recorded counter at ``t`` seconds: interpolated, then extrapolated at the mean rate."""
    if len(points) == 1 or t <= points[0][0]:
        return points[0][1]
    for (ta, va), (tb, vb) in itertools.pairwise(points):
        if t <= tb:
            return va + (vb - va) * (t - ta) / max(1e-9, tb - ta)
    (ta, va), (tb, vb) = points[0], points[-1]
    return vb + (vb - va) / max(1e-9, tb - ta) * (t - tb)


_LOADED: dict[tuple[int, str], Any] = {}  # (pid, fixture) -> the NVML loaded: once per process, not per trial


def load_nvml() -> Any:
    """The NVML to read: ``FixtureNvml`` where ``HPOFLOW_NVML_FIXTURE`` names a recording, else pynvml
    initialised (once per process); None without pynvml or a driver."""
    fixture = os.environ.get("HPOFLOW_NVML_FIXTURE", "")
    key = (os.getpid(), fixture)
    if key in _LOADED:
        return _LOADED[key]
    nvml: Any = None
    if fixture:
        try:
            nvml = FixtureNvml(fixture)
        except (OSError, ValueError):
            nvml = None
    else:
        try:
            import pynvml

            pynvml.nvmlInit()
            nvml = pynvml
        except Exception:  # not installed, no driver, no device: the GPU figure stays empty
            nvml = None
    _LOADED[key] = nvml
    return nvml


def device_handle(nvml: Any, device: int | str) -> Any:
    """NVML's handle of one of ``visible_gpus``' devices: by index, else by UUID (raises NVML's error,
    or the fixture's ``NvmlUnreadable``, where there is no such device)."""
    if isinstance(device, int):
        return nvml.nvmlDeviceGetHandleByIndex(device)
    return nvml.nvmlDeviceGetHandleByUUID(device)


@dataclass
class _Gpu:
    handle: Any
    last: float  # mJ
    total_mj: float = 0.0  # the devices' energy over the interval
    mine_mj: float = 0.0  # this rank's time share of it


@dataclass
class _Nvml:
    """NVML counters of a rank's GPUs, split by time share (see the module docstring)."""

    nvml: Any
    gpus: list[_Gpu] = field(default_factory=list)

    @classmethod
    def open(cls, nvml: Any, devices: Sequence[int | str]) -> _Nvml | None:
        """None when any of ``devices`` has no readable counter (the GPU figure is then empty)."""
        if nvml is None or not devices:
            return None
        if any(isinstance(d, str) and d.startswith("MIG-") for d in devices):
            return None  # a MIG instance has no energy counter of its own (the GPU's is every instance's)
        out = cls(nvml)
        for dev in devices:
            try:
                handle = device_handle(nvml, dev)
                out.gpus.append(_Gpu(handle, float(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))))
            except Exception:  # NVMLError (not supported, no such device) or the fixture's
                return None
        return out

    def sample(self) -> None:
        for g in self.gpus:
            try:
                now = float(self.nvml.nvmlDeviceGetTotalEnergyConsumption(g.handle))
            except Exception:
                continue
            sharing = self._processes(g.handle)
            delta = max(0.0, now - g.last)  # (a driver reload resets it: that interval is lost, not negative)
            g.total_mj += delta
            g.mine_mj += delta / max(1, sharing)
            g.last = now

    def _processes(self, handle: Any) -> int:
        """The processes using the device now: MPS clients where an MPS daemon runs (NVML then lists the
        MPS server alone among the compute processes), else the compute processes (those with a CUDA
        context); 1 where NVML cannot say."""
        listed = 0
        for call in ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses"):
            fn = getattr(self.nvml, call, None)
            try:
                listed = len(fn(handle)) if fn is not None else 0
            except Exception:  # not supported by this driver or device
                listed = 0
            if listed:
                break
        return max(1, listed)

    def joules(self) -> float:
        return sum(g.mine_mj for g in self.gpus) / _MJ_PER_J

    def share(self) -> float:
        total = sum(g.total_mj for g in self.gpus)
        return sum(g.mine_mj for g in self.gpus) / total if total > 0 else 1.0


def visible_gpus(count: float) -> list[int | str]:
    """The GPUs a rank was given: ``CUDA_VISIBLE_DEVICES`` (indices, ``GPU-`` and ``MIG-`` UUIDs, up to
    the first other entry, as CUDA reads it), else the first ``ceil(count)`` devices."""
    text = os.environ.get("CUDA_VISIBLE_DEVICES")
    if text is None:
        return list(range(math.ceil(count)))
    out: list[int | str] = []
    for raw in text.split(","):
        part = raw.strip()
        if part.isascii() and part.isdigit():
            out.append(int(part))
        elif part.startswith("GPU-"):
            out.append(part)
        elif part.startswith("MIG-"):
            out.append(part)  # kept, so that the rank's GPU figure is empty, not left out of its total
        else:
            break
    return out


# -- the meter ----------------------------------------------------------------------------------------------
class EnergyMeter:
    """One rank's energy over its trial. ``gpus``: the rank's devices (NVML indices or UUIDs);
    ``cpu_share``: the trial's share of this machine's cores where this rank reads the node's RAPL
    counter (the node's local rank 0), None elsewhere. ``powercap_root`` and ``nvml`` are injectable
    (tests: a fixture tree, ``FixtureNvml``); by default ``/sys/class/powercap`` (or
    ``HPOFLOW_POWERCAP_ROOT``) and ``load_nvml()``."""

    def __init__(self, gpus: Sequence[int | str] = (), cpu_share: float | None = None,
                 powercap_root: Path | str | None = None, nvml: Any = None) -> None:
        self.gpus = list(gpus)
        self.cpu_share = cpu_share
        self._rapl = Rapl(powercap_root) if cpu_share is not None else None
        self._nvml_src = nvml
        self._nvml: _Nvml | None = None

    def start(self) -> EnergyMeter:
        if self._rapl is not None:
            self._rapl.start()
        if self.gpus:
            self._nvml = _Nvml.open(self._nvml_src if self._nvml_src is not None else load_nvml(), self.gpus)
        return self

    def sample(self) -> None:
        if self._rapl is not None:
            self._rapl.sample()
        if self._nvml is not None:
            self._nvml.sample()

    def stop(self) -> dict[str, float]:
        """The last sample, then the figures (J, rounded to mJ): ``cpu_energy_j`` / ``cpu_energy_share``,
        ``gpu_energy_j`` / ``gpu_energy_share`` where readable, and ``energy_j`` where every source is."""
        self.sample()
        out: dict[str, float] = {}
        complete = True
        if self._rapl is not None:
            if self._rapl.readable and self.cpu_share is not None:
                out["cpu_energy_j"] = round(self._rapl.joules() * self.cpu_share, 3)
                out["cpu_energy_share"] = round(self.cpu_share, 4)
            else:
                complete = False
        if self.gpus:
            if self._nvml is not None:
                out["gpu_energy_j"] = round(self._nvml.joules(), 3)
                out["gpu_energy_share"] = round(self._nvml.share(), 4)
            else:
                complete = False
        if complete:
            out["energy_j"] = round(out.get("cpu_energy_j", 0.0) + out.get("gpu_energy_j", 0.0), 3)
        return out


def meter_for_rank(local_rank: int, ranks_here: int, cpus_per_process: int, gpus_per_process: float) -> EnergyMeter:
    """A rank's meter: its own GPUs (where it has any), and the node's CPU counter at local rank 0 with
    the trial's share of the machine's cores (``ranks_here`` x ``cpus_per_process`` / all cores)."""
    share = None
    if local_rank == 0:
        share = min(1.0, ranks_here * cpus_per_process / max(1, os.cpu_count() or 1))
    return EnergyMeter(visible_gpus(gpus_per_process) if gpus_per_process > 0 else (), share)


def probe(gpus: bool) -> dict[str, bool]:
    """Which counters this machine lets hpoflow read now: ``{"cpu": ..., "gpu": ...}`` (``gpu`` only
    asked where the study's trials have GPUs: those ``CUDA_VISIBLE_DEVICES`` names, else device 0)."""
    out = {"cpu": Rapl().start().readable}
    if gpus:
        out["gpu"] = _Nvml.open(load_nvml(), visible_gpus(1)[:1] or [0]) is not None
    return out
