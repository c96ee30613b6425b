"""What this machine offers a trial: its usable CPU cores and GPUs, and whether a trial shape fits.

Standard library only (no torch import; ``hpoflow.spec``, for what a GPU share is, only once a trial's
shape is checked): the driver, ``hpoflow validate``, the local engine and the
COMPSs node launcher all detect the machine through this one module.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest

__all__ = ["GpuId", "check_fits", "detect_gpus", "gpu_lock_dir", "gpus_needed", "machine_cores",
           "parse_visible_devices"]

GpuId = int | str
"""A GPU as ``CUDA_VISIBLE_DEVICES`` names it: an index (``0``), or a GPU or MIG instance UUID (``GPU-...``,
``MIG-...``). A rank is given its GPUs by these names, so a UUID is passed on as the UUID."""

_UUID_PREFIXES = ("GPU-", "MIG-")


def parse_visible_devices(text: str) -> list[GpuId]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value makes visible, as CUDA reads it: comma-separated
    indices (``0,2``) or UUIDs of GPUs and MIG instances (``GPU-8932f937-...``, ``MIG-1f5b8a2c-...``,
    the older ``MIG-GPU-<uuid>/<gi>/<ci>``), as SLURM and MIG partitions set it; CUDA stops at the
    first entry that is neither (``-1``, a typo), so this does too. An empty value: no GPU."""
    out: list[GpuId] = []
    for raw in text.split(","):
        part = raw.strip()
        if part.isascii() and part.isdigit():
            device: GpuId = int(part)
        elif part.startswith(_UUID_PREFIXES) and len(part) > 4 and part.isascii() and part.isprintable():
            device = part
        else:
            break
        if device not in out:
            out.append(device)
    return out


def detect_gpus() -> list[GpuId]:
    """GPUs usable here, without importing torch: those ``CUDA_VISIBLE_DEVICES`` names (indices or
    UUIDs, ``parse_visible_devices``), else one index per GPU the NVIDIA driver lists."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return parse_visible_devices(visible)
    proc = Path("/proc/driver/nvidia/gpus")
    return list(range(len(list(proc.iterdir())))) if proc.is_dir() else []


def gpu_lock_dir(base: str | os.PathLike[str] | None = None) -> Path:
    """This user's directory of GPU lock files on this node (a rank holds a lock on each GPU it was
    given): ``hpoflow-gpus-<uid>`` in ``base``, by default ``/dev/shm`` where it is writable (node-local;
    a site's TMPDIR may be per job), else the temp dir; made mode 0700. Per user: one directory for all
    users would be made by the first with what its umask leaves (1755 under 022), and the next user's
    ranks on a shared node could not make their locks in it. ``PermissionError`` where the name is
    another user's or not a directory (a link, a file): its locks could be read or swapped."""
    if base is None:
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    path = Path(base) / f"hpoflow-gpus-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise PermissionError(f"{path} is not a directory of this user (uid {os.getuid()}): it is owned by uid "
                              f"{st.st_uid}{'' if stat.S_ISDIR(st.st_mode) else ' and not a directory'}. Fix: remove "
                              "it (a node's administrator)")
    return path


def machine_cores() -> list[int]:
    """The CPU cores this process may use (its affinity mask)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def gpus_needed(request: TrialRequest) -> int:
    """Distinct GPUs a trial takes: ``processes x gpus_per_process``; with a share ``1/k`` of a GPU per rank,
    one GPU per rank (the ranks of one trial never share a GPU: NCCL refuses two ranks on one device)."""
    from hpoflow.spec import shares_per_gpu

    return request.processes if shares_per_gpu(request.gpus_per_process) else \
        request.processes * int(request.gpus_per_process)


def check_fits(request: TrialRequest, n_cores: int, n_gpus: int, n_mig: int = 0) -> None:
    """Raise ``EngineError`` naming the numbers if a trial of this shape can never run here (``n_mig``: how
    many of the ``n_gpus`` are MIG instances, which a share of a GPU cannot use)."""
    from hpoflow.spec import share_error, shares_per_gpu

    why = share_error(request.gpus_per_process)
    if why:  # a request built in code, not from a spec (the spec refuses it first, at its key)
        raise EngineError(f"resources.gpus_per_process {why}, but got {request.gpus_per_process}. Fix: use 0, a "
                          "whole number, or a share 0.5, 0.25, 0.125, ...")
    need_c = request.processes * request.cpus_per_process
    need_g = gpus_needed(request)
    if need_c > n_cores:
        raise EngineError(
            f"resources: a trial needs processes x cpus_per_process = {request.processes} x "
            f"{request.cpus_per_process} = {need_c} cores, but this machine gives {n_cores}. "
            "Fix: lower resources.processes or resources.cpus_per_process"
        )
    if not shares_per_gpu(request.gpus_per_process):
        if need_g > n_gpus:
            raise EngineError(
                f"resources: a trial needs processes x gpus_per_process = {request.processes} x "
                f"{request.gpus_per_process} = {need_g} GPUs, but {n_gpus} are visible here. Fix: lower "
                "resources.gpus_per_process, or set it to 0 to train on CPUs"
            )
        return
    if n_mig:
        raise EngineError(
            f"resources.gpus_per_process: {request.gpus_per_process} shares a GPU, but {n_mig} of the GPUs here are "
            "MIG instances, which stay whole (a MIG instance is a partition of a GPU already). Fix: set "
            "gpus_per_process: 1 to give each rank one MIG instance, or share GPUs that are not partitioned"
        )
    if need_g > n_gpus:
        raise EngineError(
            f"resources: a trial of {request.processes} ranks with a share ({request.gpus_per_process}) of a GPU "
            f"each needs {need_g} different GPUs (ranks of one trial never share a GPU), but {n_gpus} are visible "
            "here. Fix: lower resources.processes, or set gpus_per_process to 0 to train on CPUs"
        )
