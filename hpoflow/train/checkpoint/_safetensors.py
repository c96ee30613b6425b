"""The ``safetensors`` format: the ``replica`` layout, each file a safetensors file.

``ckpt-<step:08d>-r<rank>.safetensors`` holds every tensor of the rank's state under its path
(``state.user.model.conv1.weight``, ``state.user.optimizer.state.0.exp_avg``, ``state.rng.torch``):
the model's weights load with any safetensors reader (``safetensors.torch.load_file``, keys under
``state.user.model.``), beside them the optimizer's moments and the RNG states. What is not a tensor
(numbers, strings, the structure: ``hpoflow.train.checkpoint._tree``) is JSON in the file's
``__metadata__`` (``skeleton``). Nothing is pickled, on save or load.

Checksum: ``__metadata__["sha256"]`` is the SHA-256 of the skeleton and of every tensor in name order
(name, dtype, shape, bytes): what the file holds, whatever safetensors' layout. A file whose length
disagrees with its header is refused as truncated, one whose checksum fails as damaged. safetensors
writes the file from the tensors' memory (no serialised copy); it goes to a temporary name, is
``fsync``ed and renamed. Pruning and resuming are the ``replica`` format's.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from hpoflow.fileio import fsync_dir, umask
from hpoflow.train.checkpoint._base import CorruptCheckpoint
from hpoflow.train.checkpoint._replica import Checkpointer
from hpoflow.train.checkpoint._tree import flatten, unflatten

__all__ = ["SafetensorsCheckpointer", "read_safetensors", "write_safetensors"]

_KIND = "hpoflow-checkpoint"
_VERSION = "1"


def _digest(skeleton: str, tensors: Mapping[str, torch.Tensor]) -> str:
    h = hashlib.sha256(skeleton.encode())
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def write_safetensors(path: Path, payload: Any) -> int:
    """Write ``payload`` atomically to ``path`` as a checked safetensors file; returns its size."""
    from safetensors.torch import save_file

    tensors, skeleton = flatten(payload, "")
    tensors = {k: t.detach().contiguous() for k, t in tensors.items()}
    text = json.dumps(skeleton, separators=(",", ":"))
    metadata = {"format": _KIND, "version": _VERSION, "skeleton": text, "sha256": _digest(text, tensors)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        os.close(fd)
        save_file(tensors, tmp, metadata=metadata)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        size = os.path.getsize(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return size


def read_safetensors(path: Path) -> Any:
    """Read, verify and rebuild the payload of a file ``write_safetensors`` wrote."""
    from safetensors.torch import load

    data = path.read_bytes()
    if len(data) < 8:
        raise CorruptCheckpoint(f"{path}: {len(data)} bytes is shorter than a safetensors header (truncated)")
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(data[8 : 8 + n])
        meta = header.pop("__metadata__", None) or {}
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{path}: not a safetensors file, or its header is damaged ({exc})") from exc
    if meta.get("format") != _KIND or meta.get("version") != _VERSION:
        raise CorruptCheckpoint(f"{path}: not an hpoflow safetensors checkpoint (metadata format "
                                f"{meta.get('format')!r}, version {meta.get('version')!r})")
    if len(data) != 8 + n + end:
        raise CorruptCheckpoint(f"{path}: {len(data)} bytes, its header says {8 + n + end} (truncated or extended)")
    try:
        tensors = load(data)
        skeleton = json.loads(meta["skeleton"])
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CorruptCheckpoint(f"{path}: safetensors could not read it ({exc})") from exc
    if _digest(meta["skeleton"], tensors) != meta.get("sha256"):
        raise CorruptCheckpoint(f"{path}: SHA-256 of its tensors and skeleton does not match its metadata (damaged)")
    return unflatten(skeleton, tensors)


class SafetensorsCheckpointer(Checkpointer):
    """The ``safetensors`` format; see the module docstring."""

    name = "safetensors"
    suffix = ".safetensors"

    def _write_file(self, path: Path, payload: dict[str, Any]) -> int:
        return write_safetensors(path, payload)

    def _read_file(self, path: Path) -> Any:
        return read_safetensors(path)
