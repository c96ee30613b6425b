"""Where checkpoints go: a cluster's file system, for the checkpoint-cost term (``_checkpoint``).

A cluster YAML names one under ``filesystem:`` (a catalogue name below, or a full mapping); units are
bytes/s and seconds. ``measure_filesystem`` measures a directory of this machine (``hpoflow oracle
calibrate`` writes the result into the cluster YAML it makes).
"""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CHECKPOINT_FORMATS", "FILESYSTEMS", "FileSystemSpec", "measure_filesystem"]

_G = 1e9
#: the checkpoint formats the oracle prices (hpoflow.registry.CHECKPOINT_FORMATS' built-ins)
CHECKPOINT_FORMATS = ("replica", "rank0", "dcp", "safetensors")


class FileSystemSpec(BaseModel):
    """The file system checkpoints are written to.

    ``bandwidth``: aggregate write bandwidth the job gets (every node writing at once);
    ``node_bandwidth``: what one node's client reaches; ``stream_bandwidth``: what one process writing
    one file reaches; ``latency``: fixed seconds of one checkpoint (create, ``fsync``, rename, metadata
    server); ``staging_bandwidth``: how fast a rank copies its state aside for an async save (device to
    host over PCIe for a GPU, a memory copy for a CPU). Reads are priced at the same rates.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bandwidth: float = Field(gt=0)
    node_bandwidth: float = Field(gt=0)
    stream_bandwidth: float = Field(gt=0)
    latency: float = Field(default=0.0, ge=0)
    staging_bandwidth: float = Field(default=10 * _G, gt=0)
    source: str = ""


FILESYSTEMS: dict[str, dict[str, Any]] = {
    "local-ssd": {
        "name": "local NVMe SSD", "bandwidth": 2 * _G, "node_bandwidth": 2 * _G, "stream_bandwidth": 1.5 * _G,
        "latency": 2e-3, "staging_bandwidth": 5 * _G,
        "source": "estimate: a datacenter NVMe SSD writes 2-3 GB/s sequentially (one stream ~1.5 GB/s with "
                  "fsync); a few ms for create, fsync and rename; staging: a memory copy on CPU cores",
    },
    "parallel-fs": {
        "name": "parallel file system (Lustre/GPFS), a job's share", "bandwidth": 20 * _G,
        "node_bandwidth": 5 * _G, "stream_bandwidth": 2 * _G, "latency": 20e-3, "staging_bandwidth": 12 * _G,
        "source": "estimate: a 16-node job's share of a shared parallel file system (OLCF's Orion, Lustre, "
                  "is 10 TB/s for 9,408 Frontier nodes: ~1 GB/s per node when all write; a few nodes alone get "
                  "more); one client node ~5 GB/s (its 12.5 GB/s IB EDR link is not the limit); one process "
                  "writing one unstriped file ~2 GB/s; ~20 ms of metadata server and fsync per checkpoint; "
                  "staging: device-to-host over PCIe 3.0 x16 (~12 GB/s achieved)",
    },
    "parallel-fs-fast": {
        "name": "parallel file system, NVMe tier (a job's share)", "bandwidth": 100 * _G,
        "node_bandwidth": 20 * _G, "stream_bandwidth": 4 * _G, "latency": 10e-3, "staging_bandwidth": 25 * _G,
        "source": "estimate: an all-flash tier (e.g. a burst buffer) for a 16-node job: ~100 GB/s together, "
                  "~20 GB/s per node (its HDR/NDR links), ~4 GB/s per writer stream; staging: device-to-host "
                  "over PCIe 4.0 x16 (~25 GB/s achieved)",
    },
}


def measure_filesystem(directory: Path, size: int = 256 << 20, repeats: int = 3) -> dict[str, Any]:
    """Measure ``directory``'s file system: one process writing ``size`` bytes with ``fsync`` (its
    stream, node and aggregate bandwidth on one machine), the fixed cost of a small file (create,
    write, ``fsync``, rename) and a memory copy's rate (staging). A ``filesystem:`` mapping."""
    import numpy as np

    directory.mkdir(parents=True, exist_ok=True)
    block = np.random.default_rng(0).integers(0, 255, size=4 << 20, dtype=np.uint8).tobytes()
    rates, small = [], []
    path = directory / ".hpoflow-fs-probe"
    try:
        for _ in range(repeats):
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                for _ in range(max(1, size // len(block))):
                    f.write(block)
                f.flush()
                os.fsync(f.fileno())
            rates.append(max(1, size // len(block)) * len(block) / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            with open(path.with_suffix(".tmp"), "wb") as f:
                f.write(b"x" * 4096)
                f.flush()
                os.fsync(f.fileno())
            os.replace(path.with_suffix(".tmp"), path.with_suffix(".small"))
            small.append(time.perf_counter() - t0)
    finally:
        for p in (path, path.with_suffix(".tmp"), path.with_suffix(".small")):
            p.unlink(missing_ok=True)
    array = np.frombuffer(block * 16, dtype=np.uint8)
    t0 = time.perf_counter()
    for _ in range(3):
        array.copy()
    staging = 3 * array.nbytes / (time.perf_counter() - t0)
    rate = statistics.median(rates)
    return {"name": f"measured: {directory}", "bandwidth": rate, "node_bandwidth": rate, "stream_bandwidth": rate,
            "latency": statistics.median(small), "staging_bandwidth": staging,
            "source": f"measured by hpoflow: {size >> 20} MiB written with fsync by one process (median of "
                      f"{repeats}), a 4 KiB file written, fsynced and renamed, a 64 MiB memory copy"}
