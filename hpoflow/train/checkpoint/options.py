"""Options of the built-in checkpoint formats (``training.checkpoint.options``), checked when a spec
loads. Light: pydantic only (no torch), like every options module of a registry."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from hpoflow.registry import Options

__all__ = ["DcpOptions", "FormatOptions", "Rank0Options", "ReplicaOptions", "SafetensorsOptions"]


class FormatOptions(Options):
    """Base of a format's options. ``shared_state``: the format keeps one copy of the state for every
    rank, which holds only where every rank has the same state (the built-in trainer: strategy
    ``allreduce``); the spec refuses it with the replicated strategies that keep per-rank state.
    ``sharded_state``: it also keeps a state sharded over the ranks (``fsdp``, ``zero1``: their model
    and optimizer); the spec refuses a format without it for them."""

    shared_state: ClassVar[bool] = False
    sharded_state: ClassVar[bool] = False


class ReplicaOptions(FormatOptions):
    """``replica`` takes no options."""


class SafetensorsOptions(FormatOptions):
    """``safetensors`` takes no options."""


class Rank0Options(FormatOptions):
    """``rank0`` takes no options."""

    shared_state: ClassVar[bool] = True


class DcpOptions(FormatOptions):
    """``dcp``: ``async_save`` (true: ``torch.distributed.checkpoint.async_save``, false: ``save``, blocking;
    default: ``training.checkpoint.async``) and ``thread_count`` (writer threads, and files, per rank)."""

    shared_state: ClassVar[bool] = True
    sharded_state: ClassVar[bool] = True

    async_save: bool | None = None
    thread_count: int = Field(default=1, ge=1, le=64)
