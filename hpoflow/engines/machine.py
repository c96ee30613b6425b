"""What this machine offers a trial: its usable CPU cores and GPUs, and whether a trial shape fits.

Standard library only (no torch import): the driver, ``hpoflow validate``, the local engine and the
COMPSs node launcher all detect the machine through this one module.
"""

from __future__ import annotations

import os
from pathlib import Path

from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest

__all__ = ["check_fits", "detect_gpus", "machine_cores"]


def detect_gpus() -> list[int]:
    """GPU ids usable here, without importing torch: ``CUDA_VISIBLE_DEVICES`` or the NVIDIA driver."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [int(v) for v in visible.split(",") if v.strip().isascii() and v.strip().isdigit()]
    proc = Path("/proc/driver/nvidia/gpus")
    return list(range(len(list(proc.iterdir())))) if proc.is_dir() else []


def machine_cores() -> list[int]:
    """The CPU cores this process may use (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def check_fits(request: TrialRequest, n_cores: int, n_gpus: int) -> None:
    """Raise ``EngineError`` naming the numbers if a trial of this shape can never run here."""
    need_c = request.processes * request.cpus_per_process
    need_g = request.processes * request.gpus_per_process
    if need_c > n_cores:
        raise EngineError(
            f"resources: a trial needs processes x cpus_per_process = {request.processes} x "
            f"{request.cpus_per_process} = {need_c} cores, but this machine gives {n_cores}. "
            "Fix: lower resources.processes or resources.cpus_per_process"
        )
    if need_g > n_gpus:
        raise EngineError(
            f"resources: a trial needs processes x gpus_per_process = {request.processes} x "
            f"{request.gpus_per_process} = {need_g} GPUs, but {n_gpus} are visible here. Fix: lower "
            "resources.gpus_per_process, or set it to 0 to train on CPUs"
        )
