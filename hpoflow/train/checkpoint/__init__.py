"""Checkpoints a trial resumes from: formats as plug-ins (``training.checkpoint.format``).

``CheckpointFormat`` (``_base``) is the contract; the built-in formats are ``replica`` (``Checkpointer``,
the default: every rank writes its whole state), ``rank0`` (rank 0 writes the state once, every rank
its RNG states), ``dcp`` (``torch.distributed.checkpoint``: the state written once, split over the
ranks, PyTorch's async save, loads on any world size) and ``safetensors`` (the replica layout in
safetensors files). ``make_checkpointer`` builds the one a spec names (``hpoflow.registry.CHECKPOINT_FORMATS``).
docs/checkpointing.md says what each keeps, costs and guarantees.

Importing this package is cheap (the formats, and torch with them, load on first use), so the spec can
import ``hpoflow.train.checkpoint.options`` without torch.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpoflow.train.checkpoint._base import (
        CheckpointError,
        CheckpointFormat,
        CorruptCheckpoint,
        Gather,
        UnsafeCheckpoint,
    )
    from hpoflow.train.checkpoint._dcp import DcpCheckpointer
    from hpoflow.train.checkpoint._file import (
        FORMAT_VERSION,
        MAGIC,
        checkpoint_name,
        decode,
        encode,
        parse_name,
        read_checkpoint,
        snapshot,
        write_checkpoint,
    )
    from hpoflow.train.checkpoint._rank0 import Rank0Checkpointer
    from hpoflow.train.checkpoint._replica import Checkpointer
    from hpoflow.train.checkpoint._rng import capture_rng, restore_rng, seed_joining_rank
    from hpoflow.train.checkpoint._safetensors import SafetensorsCheckpointer

__all__ = [
    "FORMAT_VERSION",
    "MAGIC",
    "CheckpointError",
    "CheckpointFormat",
    "Checkpointer",
    "CorruptCheckpoint",
    "DcpCheckpointer",
    "Gather",
    "Rank0Checkpointer",
    "SafetensorsCheckpointer",
    "UnsafeCheckpoint",
    "capture_rng",
    "checkpoint_name",
    "decode",
    "encode",
    "make_checkpointer",
    "parse_name",
    "read_checkpoint",
    "restore_rng",
    "seed_joining_rank",
    "snapshot",
    "write_checkpoint",
]

_WHERE = {
    **dict.fromkeys(("CheckpointError", "CheckpointFormat", "CorruptCheckpoint", "Gather", "UnsafeCheckpoint"),
                    "_base"),
    **dict.fromkeys(("FORMAT_VERSION", "MAGIC", "checkpoint_name", "decode", "encode", "parse_name",
                     "read_checkpoint", "snapshot", "write_checkpoint"), "_file"),
    **dict.fromkeys(("capture_rng", "restore_rng", "seed_joining_rank"), "_rng"),
    "Checkpointer": "_replica",
    "Rank0Checkpointer": "_rank0",
    "SafetensorsCheckpointer": "_safetensors",
    "DcpCheckpointer": "_dcp",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'hpoflow.train.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"hpoflow.train.checkpoint.{module}"), name)
    globals()[name] = value
    return value


def make_checkpointer(fmt: str, options: Mapping[str, Any] | None, directory: Path, *, rank: int = 0,
                      world_size: int = 1, keep: int = 2, background: bool = True,
                      elastic: bool = False) -> CheckpointFormat:
    """This rank's manager of format ``fmt`` (a name in ``hpoflow.registry.CHECKPOINT_FORMATS``) with its
    ``options`` validated by the format's options model."""
    from hpoflow.registry import CHECKPOINT_FORMATS

    cls = CHECKPOINT_FORMATS.get(fmt)
    opts = CHECKPOINT_FORMATS.options(fmt, options)
    made: CheckpointFormat = cls(directory, rank=rank, world_size=world_size, keep=keep, background=background,
                                 elastic=elastic, options=opts)
    return made
