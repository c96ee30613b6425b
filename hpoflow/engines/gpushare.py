"""Ranks that share a GPU (``resources.gpus_per_process: 1/k``): the cap each one gets.

A cap counts only some of a process's device memory, and the k shares add up to the whole GPU, so each
sharer leaves a reserve outside its cap: ``HPOFLOW_GPU_SHARE_RESERVE_MIB`` (default 512 MiB; read from the
driver's environment, passed to the rank), for its CUDA context and what else no cap counts. A rank given
a share ``1/k`` of a GPU is capped in one of two ways, chosen where the rank starts:

- An MPS control daemon runs (its ``control`` socket is in ``CUDA_MPS_PIPE_DIRECTORY``, by default
  ``/tmp/nvidia-mps``): the rank's environment gets ``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`` (100/k of the
  GPU's streaming multiprocessors) and, when the GPU's memory is known, ``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``
  (``0=<MiB>M``: its share of the GPU's memory less the reserve; the rank sees its one GPU as device 0),
  which MPS enforces on every allocation of the client. The GPU's memory comes from NVML
  (``nvidia-smi --query-gpu=memory.total``: the driver's own figure, in MiB); without ``nvidia-smi`` there
  is no figure to take a share of, so no memory limit is set by MPS and the rank caps itself (below).
- Otherwise (or when MPS sets no memory limit) a function trial's rank calls
  ``torch.cuda.set_per_process_memory_fraction(1/k - reserve/memory)`` before the training starts
  (``hpoflow.train.runner``), from ``HPOFLOW_GPU_SHARE`` (``hpoflow.trial.GPU_SHARE_ENV``): its caching
  allocator then refuses to take more, and the rank fails with an out-of-memory error instead of its
  neighbours, as long as what the allocator does not count (its CUDA context, NCCL's buffers, a library's
  own ``cudaMalloc``) fits the reserve. Compute is not capped this way (CUDA time-slices the processes).
  A ``command:`` trial's program gets no cap (hpoflow runs no torch in it): the engine warns once
  (``LocalEngine``), and the program may cap itself from ``HPOFLOW_GPU_MEMORY_FRACTION``, set where the
  GPU's memory is known.

GPU indices are handed to ``nvidia-smi -i``, which numbers GPUs in PCI bus order, as CUDA does in the
ranks (``hpoflow.train.runner`` sets ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` unless the user set it). A GPU in MIG
mode counts as MIG (``is_mig``) whether given as a ``MIG-`` instance or as the GPU itself (``nvidia-smi
--query-gpu=mig.mode.current``): it is never shared.

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
from hpoflow.trial import GPU_RESERVE_ENV, GPU_SHARE_ENV, memory_fraction

__all__ = ["MEMORY_FRACTION_ENV", "gpu_memory_mib", "is_mig", "mig_enabled", "mps_running", "share_env"]

_DEFAULT_PIPE_DIR = "/tmp/nvidia-mps"
MEMORY_FRACTION_ENV = "HPOFLOW_GPU_MEMORY_FRACTION"  # the fraction a rank's allocator may take (see share_env)


def is_mig(gpu: GpuId) -> bool:
    """A MIG instance (``MIG-...``), or a GPU in MIG mode given by index or ``GPU-`` UUID (``mig_enabled``):
    partitioned already, never shared further."""
    return (isinstance(gpu, str) and gpu.startswith("MIG-")) or mig_enabled(gpu)


@functools.lru_cache(maxsize=64)
def mig_enabled(gpu: GpuId) -> bool:
    """Whether NVML reports the GPU in MIG mode (``nvidia-smi --query-gpu=mig.mode.current``: ``Enabled``);
    False where it cannot be asked (no ``nvidia-smi``) or the GPU has no MIG (``[N/A]``). Asked once per GPU."""
    if isinstance(gpu, str) and gpu.startswith("MIG-"):
        return False
    return _smi_query(gpu, "mig.mode.current").lower() == "enabled"


def _smi_query(gpu: GpuId, field: str) -> str:
    """``nvidia-smi --query-gpu=FIELD`` of one GPU (no header, no units): its first line, or "" where it
    cannot be asked."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return ""
    try:
        out = subprocess.run([smi, f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", str(gpu)],
                             capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""


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
    first = _smi_query(gpu, "memory.total")
    return int(first) if first.isdigit() else None


def share_env(gpu: GpuId, share: Fraction, environ: Mapping[str, str],
              reserve_mib: int | None = None) -> dict[str, str]:
    """The variables that cap a rank to ``share`` of ``gpu`` less ``reserve_mib`` (see the module docstring;
    the engine passes ``HPOFLOW_GPU_SHARE_RESERVE_MIB``; None: no reserve, nothing said of it):
    ``HPOFLOW_GPU_SHARE``; with a reserve, ``HPOFLOW_GPU_SHARE_RESERVE_MIB`` and, where the GPU's memory is
    known, ``HPOFLOW_GPU_MEMORY_FRACTION`` (the fraction of the GPU the rank's allocator may take); under
    MPS the thread percentage and the memory limit. No memory limit where the share does not hold the
    reserve: the rank then refuses to start, naming both."""
    env = {GPU_SHARE_ENV: f"{float(share):.6g}"}
    reserve = reserve_mib or 0
    if reserve_mib is not None:
        env[GPU_RESERVE_ENV] = str(reserve_mib)
        total = gpu_memory_mib(gpu)
        if total is not None and (fraction := memory_fraction(float(share), total, reserve)) > 0:
            env[MEMORY_FRACTION_ENV] = f"{fraction:.6g}"
    if mps_running(environ):
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = f"{float(share) * 100:.6g}"
        total = gpu_memory_mib(gpu)
        if total is not None and int(total * share) - reserve > 0:
            env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = f"0={int(total * share) - reserve}M"
    return env
