"""The ``safetensors`` format: the ``replica`` layout, each file a safetensors file.

``ckpt-<step:08d>-r<rank>.safetensors`` holds every tensor of the rank's state under its path
(``state.user.model.conv1.weight``, ``state.user.optimizer.state.0.exp_avg``, ``state.rng.torch``):
the model's weights load with any safetensors reader (``safetensors.torch.load_file``, keys under
``state.user.model.``), beside them the optimizer's moments and the RNG states. What is not a tensor
(numbers, strings, the structure: ``hpoflow.train.checkpoint._tree``) is JSON in the file's
``__metadata__`` (``skeleton``). Nothing is pickled, on save or load.

Checksum: ``__metadata__["sha256"]`` is the SHA-256 of the whole file with that value replaced by a
fixed placeholder of the same length (written in two passes: serialise with the placeholder, hash,
patch it in). A file whose length disagrees with its header is refused as truncated, one whose
checksum fails as damaged. Atomicity, pruning and resuming are the ``replica`` format's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from hpoflow.fileio import write_atomic
from hpoflow.train.checkpoint._base import CorruptCheckpoint
from hpoflow.train.checkpoint._replica import Checkpointer
from hpoflow.train.checkpoint._tree import flatten, unflatten

__all__ = ["SafetensorsCheckpointer", "read_safetensors", "write_safetensors"]

_KIND = "hpoflow-checkpoint"
_VERSION = "1"
_PLACEHOLDER = ("hpoflow-sha256-placeholder-" + "0" * 64)[:64].encode()


def encode_safetensors(payload: Any) -> bytearray:
    """The safetensors bytes of ``payload`` with their checksum in the metadata."""
    from safetensors.torch import save

    tensors, skeleton = flatten(payload, "")
    metadata = {"format": _KIND, "version": _VERSION, "skeleton": json.dumps(skeleton, separators=(",", ":")),
                "sha256": _PLACEHOLDER.decode()}
    data = bytearray(save({k: t.detach().contiguous() for k, t in tensors.items()}, metadata=metadata))
    n = int.from_bytes(data[:8], "little")
    at = data.find(_PLACEHOLDER, 8, 8 + n)
    digest = hashlib.sha256(data).hexdigest().encode()
    data[at : at + len(digest)] = digest
    return data


def write_safetensors(path: Path, payload: Any) -> int:
    """Write ``payload`` atomically to ``path`` as a checked safetensors file; returns its size."""
    data = encode_safetensors(payload)
    write_atomic(path, memoryview(data))
    return len(data)


def read_safetensors(path: Path) -> Any:
    """Read, verify and rebuild the payload of a file ``write_safetensors`` wrote."""
    from safetensors.torch import load

    data = path.read_bytes()
    view = memoryview(data)
    if len(data) < 8:
        raise CorruptCheckpoint(f"{path}: {len(data)} bytes is shorter than a safetensors header (truncated)")
    n = int.from_bytes(data[:8], "little")
    try:
        header = json.loads(bytes(view[8 : 8 + n]))
        meta = header.pop("__metadata__", None) or {}
        end = max((int(t["data_offsets"][1]) for t in header.values()), default=0)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise CorruptCheckpoint(f"{path}: not a safetensors file, or its header is damaged ({exc})") from exc
    if meta.get("format") != _KIND or meta.get("version") != _VERSION:
        raise CorruptCheckpoint(f"{path}: not an hpoflow safetensors checkpoint (metadata format "
                                f"{meta.get('format')!r}, version {meta.get('version')!r})")
    if len(data) != 8 + n + end:
        raise CorruptCheckpoint(f"{path}: {len(data)} bytes, its header says {8 + n + end} (truncated or extended)")
    digest = str(meta.get("sha256", "")).encode()
    at = data.find(digest, 8, 8 + n) if len(digest) == len(_PLACEHOLDER) else -1
    h = hashlib.sha256()
    if at >= 0:
        h.update(view[:at])
        h.update(_PLACEHOLDER)
        h.update(view[at + len(digest) :])
    if at < 0 or h.hexdigest().encode() != digest:
        raise CorruptCheckpoint(f"{path}: SHA-256 of the file does not match its metadata (damaged)")
    try:
        tensors = load(data)
        skeleton = json.loads(meta["skeleton"])
    except Exception as exc:  # safetensors raises its own SafetensorError
        raise CorruptCheckpoint(f"{path}: safetensors could not read it ({exc})") from exc
    return unflatten(skeleton, tensors)


class SafetensorsCheckpointer(Checkpointer):
    """The ``safetensors`` format; see the module docstring."""

    name = "safetensors"
    suffix = ".safetensors"

    def _write_file(self, path: Path, payload: dict[str, Any]) -> int:
        return write_safetensors(path, payload)

    def _read_file(self, path: Path) -> Any:
        return read_safetensors(path)
