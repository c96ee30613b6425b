"""``FixtureNvml``: pynvml's calls that hpoflow makes, answered from a JSON recording (``HPOFLOW_NVML_FIXTURE``).

A test hook (docs/energy.md): the energy reader (``hpoflow.train.energy``) and the usage sampler
(``hpoflow.train.usage``) read it in place of pynvml, in every process that inherits the variable.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

__all__ = ["FixtureNvml", "NvmlUnreadable"]


class NvmlUnreadable(Exception):
    """The fixture's stand-in for NVML's errors (``NVMLError_NotSupported``, no such device)."""


class FixtureNvml:
    """pynvml's calls, answered from a recording::

        {"t0": 1764200000.0,                       # wall clock of the recording's time 0 (default: load time)
         "devices": [{"index": 0, "uuid": "GPU-...", "name": "...",
                      "energy_mj": [[0.0, 81234567], [0.5, 81234712], ...],   # (s, counter) pairs, or null
                      "processes": 1,                                          # compute processes listed
                      "pids": [4242],                                          # their pids (optional)
                      "mps_processes": 0,                                      # MPS clients listed
                      "power_mw": 70500,                                       # power now (optional)
                      "mig": false,                                            # MIG mode on (optional)
                      "utilization_gpu": 37}]}                                 # % busy (optional)

    The counter at wall time ``t`` is the recording's, linearly between its samples, and past its end
    advancing at the recording's mean rate (a device's counter never stops). ``energy_mj: null`` is a
    device without the counter (pre-Volta: ``NVMLError_NotSupported``). Every process reading the same
    file with the same ``t0`` sees the same counter at the same time, as with one real device.
    ``nvmlDeviceGetPowerUsage`` answers ``power_mw`` where given, else the counter's slope at ``t``;
    the compute processes have the ``pids`` given (else ``processes`` of them, with no pid);
    ``nvmlDeviceGetMigMode`` answers ``[1, 1]`` where ``mig`` is true, else ``[0, 0]``."""

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
        return round(_replay(self._points(handle), self.clock() - self.t0))

    def nvmlDeviceGetPowerUsage(self, handle: dict[str, Any]) -> int:
        """mW: the device's ``power_mw``, else the recorded counter's slope now (J/s = W)."""
        if handle.get("power_mw") is not None:
            return int(handle["power_mw"])
        points = self._points(handle)
        t = self.clock() - self.t0
        return round((_replay(points, t + 0.05) - _replay(points, t - 0.05)) / 0.1 * 1000.0)

    def nvmlDeviceGetMigMode(self, handle: dict[str, Any]) -> list[int]:
        on = 1 if handle.get("mig") else 0
        return [on, on]

    def nvmlDeviceGetUtilizationRates(self, handle: dict[str, Any]) -> SimpleNamespace:
        """``.gpu``: the device's ``utilization_gpu`` (%); not supported where the recording has none."""
        util = handle.get("utilization_gpu")
        if util is None:
            raise NvmlUnreadable("NVML_ERROR_NOT_SUPPORTED")
        return SimpleNamespace(gpu=int(util), memory=0)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        pids = handle.get("pids")
        if pids is None:
            pids = [None] * int(handle.get("processes", 1))
        return [SimpleNamespace(pid=p, usedGpuMemory=None) for p in pids]

    def nvmlDeviceGetMPSComputeRunningProcesses(self, handle: dict[str, Any]) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=None, usedGpuMemory=None) for _ in range(int(handle.get("mps_processes", 0)))]

    @staticmethod
    def _points(handle: dict[str, Any]) -> list[tuple[float, float]]:
        points = handle.get("energy_mj")
        if not points:
            raise NvmlUnreadable("NVML_ERROR_NOT_SUPPORTED")
        return [(float(t), float(v)) for t, v in points]


def _replay(points: list[tuple[float, float]], t: float) -> float:
    """The recorded counter at ``t`` seconds: interpolated, then extrapolated at the mean rate."""
    if len(points) == 1 or t <= points[0][0]:
        return points[0][1]
    for (ta, va), (tb, vb) in itertools.pairwise(points):
        if t <= tb:
            return va + (vb - va) * (t - ta) / max(1e-9, tb - ta)
    (ta, va), (tb, vb) = points[0], points[-1]
    return vb + (vb - va) / max(1e-9, tb - ta) * (t - tb)
