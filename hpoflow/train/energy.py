"""Energy a trial used, read from the machine's own counters, and the part of it the trial is given.

A rank's figures are of three kinds (docs/energy.md lists them key by key):

- **raw** (``*_raw``): what a counter measured over the rank's span, whole. ``cpu_energy_j_raw``: the
  node's CPU packages; ``dram_energy_j_raw``: its DRAM (where it has a DRAM counter; in no total);
  ``gpu_energy_j_raw``: the rank's GPUs. These are measurements.
- **attributed** (``cpu_energy_j``, ``gpu_energy_j``, their sum ``energy_j``): the part of the raw
  figure the trial is given by a rule, because a counter measures a whole package or device that the
  trial may share. An allocation of measured energy, not a measurement of the trial alone:
  - CPU: the packages' energy times the trial's share of the machine's cores (``cpu_energy_share`` = the
    trial's cores on this node / the machine's cores), idle and other programs' energy included;
  - GPU: at each sample, the device's energy since the last one divided by the number of processes NVML
    lists on it (its MPS clients under an MPS daemon, else its compute processes; at least 1).
    ``gpu_energy_share`` = attributed / raw (1.0: the devices were the rank's alone).
- **above idle** (``cpu_idle_w``, ``gpu_idle_w``; ``cpu_energy_above_idle_j``, ``gpu_energy_above_idle_j``,
  their sum ``energy_above_idle_j``): the attributed figure less the idle power measured just before the
  trial times the rank's span, where an idle power could be measured (``EnergyMeter.start``): the CPU
  packages' mean power over ``HPOFLOW_ENERGY_BASELINE_S`` (0.1 s) before the trial, only where the trial
  holds every core of the machine (else other trials' load would be in it); the GPUs' power as NVML reports
  it (``nvmlDeviceGetPowerUsage``) when the rank starts, only where the rank has its GPUs whole and NVML
  lists no other process on them. Elsewhere these figures are absent, never guessed.

Sources, each read where it is readable, else left out (its figures stay empty):

- **GPU**: NVML's energy counter, ``nvmlDeviceGetTotalEnergyConsumption`` (mJ since the driver loaded;
  Volta and newer), through ``pynvml`` (the ``nvidia-ml-py`` package, the ``nvml`` extra) of each GPU
  the rank was given (``CUDA_VISIBLE_DEVICES``: indices, in PCI bus order as NVML numbers them, since
  ``hpoflow.train.runner`` sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; or ``GPU-`` UUIDs). A MIG instance
  (``MIG-``), and a GPU in MIG mode named by index or ``GPU-`` UUID (``nvmlDeviceGetMigMode``), has no
  counter of its own: the GPU's counts every instance, so the GPU figures stay empty.
- **CPU**: RAPL (``/sys/class/powercap/intel-rapl:<n>``, ``energy_uj`` in µJ, wrapping at
  ``max_energy_range_uj``), zones chosen by their ``name`` file (``Rapl.zones``): the top-level zones named
  ``package-<n>`` are the packages; zones named ``dram`` are the DRAM, outside the packages' counters and
  reported apart; ``psys`` (the whole platform, packages included, on Intel client parts), ``core``,
  ``uncore`` (parts of a package) and ``intel-rapl-mmio`` (the same package again) are left out. Only one
  rank per node reads them (the node's local rank 0), so a node is counted once per trial. Linux >= 5.10
  makes ``energy_uj`` readable by root only (CVE-2020-8694): unprivileged, the CPU figures are empty.

Counters are sampled by the usage sampler's ticks (``hpoflow.train.usage``), so a RAPL counter that wraps
between two samples (minutes apart at the least) is counted right, and each NVML interval gets the number
of processes sharing the device then.

``energy_j`` is the sum of the rank's attributed sources, present only when every source the rank has is
readable (a rank with no source of its own, a non-zero local rank of a CPU trial, reports 0.0): a partial
sum is never passed off as the total; ``energy_above_idle_j`` likewise, where every source also had an idle
power. ``hpoflow.trial.aggregate_usage`` keeps a trial's totals only where every rank reported them.

Test hooks (documented in docs/energy.md): ``HPOFLOW_POWERCAP_ROOT`` replaces ``/sys/class/powercap`` (a
directory tree of the same shape), ``HPOFLOW_NVML_FIXTURE`` replaces pynvml with ``FixtureNvml``, which
replays a JSON recording of a device's answers (``hpoflow.train.nvml_fixture``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpoflow.train.nvml_fixture import FixtureNvml, NvmlUnreadable
from hpoflow.train.rapl import Rapl
from hpoflow.trial import GPU_SHARE_ENV

__all__ = ["BASELINE_ENV", "EnergyMeter", "FixtureNvml", "NvmlUnreadable", "Rapl", "device_handle", "load_nvml",
           "meter_for_rank", "mig_mode", "probe", "visible_gpus"]

BASELINE_ENV = "HPOFLOW_ENERGY_BASELINE_S"  # the CPU idle window before a trial, s (0: none)
_BASELINE_S = 0.1
_MJ_PER_J = 1000.0
_MIG_ENABLED = 1  # NVML_DEVICE_MIG_ENABLE


# -- GPU: NVML --------------------------------------------------------------------------------------------
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


def mig_mode(nvml: Any, handle: Any) -> bool:
    """Whether the device is a GPU in MIG mode (``nvmlDeviceGetMigMode``: its current mode enabled); False
    where NVML cannot say (a GPU without MIG answers NOT_SUPPORTED)."""
    try:
        current = nvml.nvmlDeviceGetMigMode(handle)[0]
    except Exception:  # NVMLError (not supported), the fixture's, or an NVML without the call
        return False
    return int(current) == _MIG_ENABLED


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
        """None when any of ``devices`` has no readable counter of its own (the GPU figure is then empty):
        a MIG instance, a GPU in MIG mode, a GPU without the counter, no such device."""
        if nvml is None or not devices:
            return None
        if any(isinstance(d, str) and d.startswith("MIG-") for d in devices):
            return None  # a MIG instance has no energy counter of its own (the GPU's is every instance's)
        out = cls(nvml)
        for dev in devices:
            try:
                handle = device_handle(nvml, dev)
                if mig_mode(nvml, handle):
                    return None  # a GPU in MIG mode given whole: its counter is every instance's
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
            sharing = max(1, len(self._listed(g.handle)))
            delta = max(0.0, now - g.last)  # (a driver reload resets it: that interval is lost, not negative)
            g.total_mj += delta
            g.mine_mj += delta / sharing
            g.last = now

    def _listed(self, handle: Any) -> list[Any]:
        """The processes using the device now: MPS clients where an MPS daemon runs (NVML then lists the
        MPS server alone among the compute processes), else the compute processes (those with a CUDA
        context); none where NVML cannot say."""
        for call in ("nvmlDeviceGetMPSComputeRunningProcesses", "nvmlDeviceGetComputeRunningProcesses"):
            fn = getattr(self.nvml, call, None)
            try:
                listed = list(fn(handle)) if fn is not None else []
            except Exception:  # not supported by this driver or device
                listed = []
            if listed:
                return listed
        return []

    def idle_w(self) -> float | None:
        """The devices' power now (W, ``nvmlDeviceGetPowerUsage``), where none of them lists a process but
        this one; None where another process is on one of them or NVML cannot say."""
        me = os.getpid()
        watts = 0.0
        for g in self.gpus:
            if any(getattr(p, "pid", None) != me for p in self._listed(g.handle)):
                return None  # another process uses the device: its power now is not this device's idle
            try:
                watts += float(self.nvml.nvmlDeviceGetPowerUsage(g.handle)) / _MJ_PER_J
            except Exception:  # not supported
                return None
        return watts

    def joules(self) -> float:
        return sum(g.mine_mj for g in self.gpus) / _MJ_PER_J

    def raw_joules(self) -> float:
        return sum(g.total_mj for g in self.gpus) / _MJ_PER_J

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
def _baseline_s() -> float:
    """``HPOFLOW_ENERGY_BASELINE_S``: the CPU idle window (s) before a trial that holds the whole machine
    (default 0.1; 0 or anything unreadable: no window, no CPU idle figure)."""
    text = os.environ.get(BASELINE_ENV)
    if text is None:
        return _BASELINE_S
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) and value > 0 else 0.0


class EnergyMeter:
    """One rank's energy over its trial. ``gpus``: the rank's devices (NVML indices or UUIDs);
    ``cpu_share``: the trial's share of this machine's cores where this rank reads the node's RAPL
    counter (the node's local rank 0), None elsewhere; ``gpus_whole``: the rank was given its GPUs whole
    (not a share ``1/k``: ``HPOFLOW_GPU_SHARE`` unset), a condition of the GPU idle power;
    ``baseline_s``: the CPU idle window (default ``HPOFLOW_ENERGY_BASELINE_S``, 0.1 s). ``powercap_root``
    and ``nvml`` are injectable (tests: a fixture tree, ``FixtureNvml``); by default
    ``/sys/class/powercap`` (or ``HPOFLOW_POWERCAP_ROOT``) and ``load_nvml()``."""

    def __init__(self, gpus: Sequence[int | str] = (), cpu_share: float | None = None,
                 powercap_root: Path | str | None = None, nvml: Any = None, *, gpus_whole: bool = True,
                 baseline_s: float | None = None) -> None:
        self.gpus = list(gpus)
        self.cpu_share = cpu_share
        self.gpus_whole = gpus_whole
        self.baseline_s = _baseline_s() if baseline_s is None else baseline_s
        self._rapl = Rapl(powercap_root) if cpu_share is not None else None
        self._nvml_src = nvml
        self._nvml: _Nvml | None = None
        self.cpu_idle_w: float | None = None
        self.gpu_idle_w: float | None = None
        self._t0 = time.monotonic()

    def start(self) -> EnergyMeter:
        """Read the counters' starting values, and the idle powers where they can be measured: the CPU
        packages' over ``baseline_s`` (only where the trial holds every core of the machine, so that no
        other trial of this machine runs then; the rank waits that long), the GPUs' now (only where the
        rank has them whole and NVML lists no other process on them). The span starts after them."""
        if self._rapl is not None:
            self._rapl.start()
            if self._rapl.readable and (self.cpu_share or 0.0) >= 1.0 and self.baseline_s > 0:
                self.cpu_idle_w = self._rapl.idle_w(self.baseline_s)
        if self.gpus:
            self._nvml = _Nvml.open(self._nvml_src if self._nvml_src is not None else load_nvml(), self.gpus)
            if self._nvml is not None and self.gpus_whole:
                self.gpu_idle_w = self._nvml.idle_w()
        self._t0 = time.monotonic()
        return self

    def sample(self) -> None:
        if self._rapl is not None:
            self._rapl.sample()
        if self._nvml is not None:
            self._nvml.sample()

    def stop(self) -> dict[str, float]:
        """The last sample, then the figures (J and W, rounded to mJ and mW; see the module docstring):
        ``cpu_energy_j`` / ``cpu_energy_share`` / ``cpu_energy_j_raw``, ``dram_energy_j_raw``,
        ``gpu_energy_j`` / ``gpu_energy_share`` / ``gpu_energy_j_raw`` where readable, ``energy_j`` where
        every source is; ``cpu_idle_w`` / ``cpu_energy_above_idle_j``, ``gpu_idle_w`` /
        ``gpu_energy_above_idle_j`` where an idle power was measured, ``energy_above_idle_j`` where every
        source had one."""
        self.sample()
        span = max(0.0, time.monotonic() - self._t0)
        out: dict[str, float] = {}
        complete = above_idle = True
        above = 0.0
        if self._rapl is not None:
            if self._rapl.readable and self.cpu_share is not None:
                raw = self._rapl.joules()
                out["cpu_energy_j"] = round(raw * self.cpu_share, 3)
                out["cpu_energy_share"] = round(self.cpu_share, 4)
                out["cpu_energy_j_raw"] = round(raw, 3)
                if self.cpu_idle_w is not None:
                    cpu_above = max(0.0, raw - self.cpu_idle_w * span) * self.cpu_share
                    out["cpu_idle_w"] = round(self.cpu_idle_w, 3)
                    out["cpu_energy_above_idle_j"] = round(cpu_above, 3)
                    above += cpu_above
                else:
                    above_idle = False
                if self._rapl.dram_readable:  # (reported with the packages' figures, in no total)
                    out["dram_energy_j_raw"] = round(self._rapl.dram_joules(), 3)
            else:
                complete = False
        if self.gpus:
            if self._nvml is not None:
                raw = self._nvml.raw_joules()
                out["gpu_energy_j"] = round(self._nvml.joules(), 3)
                out["gpu_energy_share"] = round(self._nvml.share(), 4)
                out["gpu_energy_j_raw"] = round(raw, 3)
                if self.gpu_idle_w is not None:
                    gpu_above = max(0.0, raw - self.gpu_idle_w * span) * self._nvml.share()
                    out["gpu_idle_w"] = round(self.gpu_idle_w, 3)
                    out["gpu_energy_above_idle_j"] = round(gpu_above, 3)
                    above += gpu_above
                else:
                    above_idle = False
            else:
                complete = False
        if complete:
            out["energy_j"] = round(out.get("cpu_energy_j", 0.0) + out.get("gpu_energy_j", 0.0), 3)
            if above_idle:
                out["energy_above_idle_j"] = round(above, 3)
        return out


def meter_for_rank(local_rank: int, ranks_here: int, cpus_per_process: int, gpus_per_process: float) -> EnergyMeter:
    """A rank's meter: its own GPUs (where it has any; whole unless its engine gave it a share,
    ``HPOFLOW_GPU_SHARE``), and the node's CPU counter at local rank 0 with the trial's share of the
    machine's cores (``ranks_here`` x ``cpus_per_process`` / all cores)."""
    share = None
    if local_rank == 0:
        share = min(1.0, ranks_here * cpus_per_process / max(1, os.cpu_count() or 1))
    return EnergyMeter(visible_gpus(gpus_per_process) if gpus_per_process > 0 else (), share,
                       gpus_whole=not os.environ.get(GPU_SHARE_ENV))


def probe(gpus: bool) -> dict[str, bool]:
    """Which counters this machine lets hpoflow read now: ``{"cpu": ..., "gpu": ...}`` (``gpu`` only
    asked where the study's trials have GPUs: those ``CUDA_VISIBLE_DEVICES`` names, else device 0)."""
    out = {"cpu": Rapl().start().readable}
    if gpus:
        out["gpu"] = _Nvml.open(load_nvml(), visible_gpus(1)[:1] or [0]) is not None
    return out
