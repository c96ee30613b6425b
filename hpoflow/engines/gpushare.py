"""Ranks that share a GPU (``resources.gpus_per_process: 1/k``): the cap each one gets.

A rank given a share ``1/k`` of a GPU is capped to it in one of two ways, chosen where the rank starts:

- An MPS control daemon runs (its ``control`` socket is in ``CUDA_MPS_PIPE_DIRECTORY``, by default
  ``/tmp/nvidia-mps``): the rank's environment gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (100/k of the
  GPU's streaming multiprocessors) and, when the GPU's memory is known, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (``0=<MiB>M``: the rank sees its one GPU as device 0). The GPU's memory comes from NVML
  (``nvidia-smi --query-gpu=memory.total``: the driver's own figure, in MiB); without ``nvidia-smi`` there
  is no figure to take a share of, so no memory limit is set by MPS and the rank caps itself (below).
- Otherwise (or when MPS sets no memory limit) the rank calls
  ``torch.cuda.set_per_process_memory_fraction(1/k)`` before the training starts
  (``hpoflow.train.runner``), from ``HPOFLOW_GPU_SHARE`` (``hpoflow.trial.GPU_SHARE_ENV``): its caching
  allocator then refuses to take more than its share, and the rank fails with an out-of-memory error
  instead of its neighbours. Compute is not capped this way (CUDA time-slices the processes).

Standard library only: the local engine calls it for each rank it starts.
"""

from __future__ import annotations

import functools
import shutil
import stat
import subprocess
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path

from hpoflow.engines.machine import GpuId
from hpoflow.trial import GPU_SHARE_ENV

__all__ = ["gpu_memory_mib", "is_mig", "mps_running", "share_env"]

_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"


def is_mig(gpu: GpuId) -> bool:
    """A MIG instance (``MIG-...``): a partition of a GPU already, never shared further."""
    return isinstance(gpu, str) and gpu.startswith("MIG-")


def mps_running(environ: Mapping[str, str]) -> bool:
    """An MPS control daemon listens where CUDA clients of ``environ`` would look for it: a socket named
    ``control`` in ``CUDA_MPS_PIPE_DIRECTORY`` (``/tmp/nvidia-mps`` unset)."""
    control = Path(environ.get("CUDA_MPS_PIPE_DIRECTORY") or _DEFAULT_PIPE_DIR) / "control"
    try:
        return stat.S_ISSOCK(control.stat().st_mode)
    except OSError:
        return False


@functools.lru_cache(maxsize=64)
def gpu_memory_mib(gpu: GpuId) -> int | None:
    """The GPU's memory in MiB as NVML reports it (``nvidia-smi``), or None where it cannot be read; asked
    once per GPU (a driver's GPUs do not change their memory)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", str(gpu)],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return int(first) if first.isdigit() else None


def share_env(gpu: GpuId, share: Fraction, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that cap a rank to ``share`` of ``gpu`` (see the module docstring)."""
    env = {GPU_SHARE_ENV: f"{float(share):.6g}"}
    if mps_running(environ):
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{float(share) * 100:.6g}"
        total = gpu_memory_mib(gpu)
        if total is not None:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={int(total * share)}M"
    return env
