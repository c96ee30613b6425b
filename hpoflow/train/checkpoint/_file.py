"""One checkpoint file of the ``replica`` and ``rank0`` formats: a 52-byte header, then the payload.

The header is ``MAGIC`` (8 bytes), the format version (uint32), the payload length (uint64) and the
SHA-256 of the payload (32 bytes); the payload is ``torch.save`` of plain tensors, numbers, strings and
containers, read back with ``torch.load(weights_only=True)``: a checkpoint never unpickles an arbitrary
object. A truncated or damaged file fails the length or checksum test (``CorruptCheckpoint``).
``snapshot`` is the copy a save takes on the training thread (and the check of what a state may hold).
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import struct
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any, cast

import numpy as np
import torch

from hpoflow.fileio import fsync_dir, umask
from hpoflow.train.checkpoint._base import CorruptCheckpoint, UnsafeCheckpoint

__all__ = ["FORMAT_VERSION", "MAGIC", "checkpoint_name", "decode", "encode", "parse_name", "read_checkpoint",
           "snapshot", "write_checkpoint"]

MAGIC = b"HPOFCKPT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256(payload)
_NAME = re.compile(r"^ckpt-(\d{8})-r(\d+)\.pt$")
_ATOMS = (bool, int, float, str, type(None))


# -- names ------------------------------------------------------------------------------------------
def checkpoint_name(step: int, rank: int) -> str:
    if step < 0 or rank < 0:
        raise ValueError(f"checkpoint step and rank must be >= 0, but got step={step}, rank={rank}")
    return f"ckpt-{step:08d}-r{rank}.pt"


def parse_name(name: str) -> tuple[int, int] | None:
    """``(step, rank)`` of a checkpoint file name, or ``None`` for any other file."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


# -- one file -----------------------------------------------------------------------------------------
def encode(obj: Any) -> tuple[bytes, memoryview]:
    """``(header, payload)`` of ``obj``: ``torch.save`` bytes and their checked header."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
    return header, payload


def decode(data: bytes | memoryview, source: str = "<bytes>") -> Any:
    """The object in checkpoint bytes; ``CorruptCheckpoint`` or ``UnsafeCheckpoint`` if unusable."""
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise CorruptCheckpoint(f"{source}: {len(view)} bytes is shorter than the {_HEADER.size}-byte header "
                                "(truncated)")
    magic, version, length, digest = _HEADER.unpack(view[: _HEADER.size])
    if magic != MAGIC:
        raise CorruptCheckpoint(f"{source}: not an hpoflow checkpoint (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CorruptCheckpoint(f"{source}: format version {version}, this hpoflow reads {FORMAT_VERSION}")
    payload = view[_HEADER.size :]
    if len(payload) != length:
        raise CorruptCheckpoint(f"{source}: payload is {len(payload)} bytes, the header says {length} (truncated "
                                "or extended)")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{source}: SHA-256 of the payload does not match the header (damaged)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError (and others) for disallowed globals
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported" in ln or "WeightsUnpickler" in ln), lines[0] if lines else "")
        raise UnsafeCheckpoint(f"{source}: refused by torch.load(weights_only=True) (it would run pickled "
                               f"code): {why[:300]}") from exc


class _Hashing:
    """A file's ``write`` that also counts and hashes what goes through it."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.length = 0

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.length += view.nbytes
        self.f.write(view)
        return view.nbytes

    def flush(self) -> None:
        self.f.flush()


def write_checkpoint(path: Path, obj: Any) -> int:
    """Encode ``obj`` and write it atomically to ``path``; returns the file's size in bytes.

    The payload is streamed to a temporary file beside ``path`` (hashed on the way: no copy of the
    serialised state is held in memory), its header written over the placeholder at the start, the file
    ``fsync``ed and renamed over ``path``, the directory ``fsync``ed (``hpoflow.fileio.write_atomic``'s
    steps and temporary names)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~umask())
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * _HEADER.size)
            stream = _Hashing(f)
            torch.save(obj, cast(IO[bytes], stream))  # it only writes
            f.seek(0)
            f.write(_HEADER.pack(MAGIC, FORMAT_VERSION, stream.length, stream.sha.digest()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return _HEADER.size + stream.length


def read_checkpoint(path: Path) -> Any:
    """Read and verify one checkpoint file (raises ``CheckpointError`` subclasses, or ``OSError``)."""
    return decode(path.read_bytes(), str(path))


# -- state ------------------------------------------------------------------------------------------
def plain_atom(obj: Any) -> Any:
    """``obj`` as a plain atom (bool, int, float, str, None; a subclass or a NumPy scalar as the plain
    type), or ``NotImplemented``."""
    if type(obj) in _ATOMS:
        return obj
    for atom in (bool, int, float, str):  # subclasses (enums, torch's version string) as the plain type
        if isinstance(obj, atom):
            return atom(obj)
    if isinstance(obj, np.generic) and not isinstance(obj, np.ndarray):
        return obj.item()  # numpy scalar -> the Python number it holds
    return NotImplemented


def snapshot(obj: Any, where: str = "state") -> Any:
    """A deep copy of ``obj`` that shares nothing with training: tensors are detached CPU copies,
    containers are new. Only what ``weights_only`` loads is accepted (else ``TypeError``)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
    atom = plain_atom(obj)
    if atom is not NotImplemented:
        return atom
    if isinstance(obj, Mapping):
        return {k: snapshot(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(snapshot(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(
        f"checkpoint {where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds only "
        "tensors, numbers, strings, None and dicts/lists/tuples of them (it is loaded with "
        "torch.load(weights_only=True), which runs no pickled code). Fix: convert it, e.g. "
        "torch.as_tensor(x) for a numpy array, or save its state_dict() instead of the object")


