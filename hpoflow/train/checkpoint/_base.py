"""The contract of a checkpoint format (``training.checkpoint.format``; ``hpoflow.registry.CHECKPOINT_FORMATS``).

A format is a class whose instance manages **one rank's** checkpoints of one trial, in one directory.
Every rank of a trial builds one (``make_checkpointer``) with the same arguments but its own ``rank``:

* ``save(state, step, private)``: every rank calls it at the same step, from one thread (the training
  loop's). ``state`` is what the trial resumes from; ``private`` is this rank's own (its RNG states),
  kept per rank by every format. A format whose ``shared_state`` is true keeps **one** copy of
  ``state`` for all ranks (rank 0's, or any rank's when they are equal), so it needs ``state`` to be
  the same on every rank (DDP's model and optimizer: the ``allreduce`` strategy). ``save`` copies what
  it needs before it returns (training may change the tensors at once) and may write in the
  background; it may be a collective (``dcp``), so it must be called on every rank. A failed write
  warns and is counted (``errors``, ``last_error``): a checkpoint is a safety net, training goes on.
* ``latest(gather)``: the newest step usable on every rank, and this rank's state for it:
  ``{**state, **private}`` as saved (``state`` is rank 0's for a shared-state format), or ``None``.
  Collective: ``gather(my_steps)`` returns every rank's list (an all-gather in a distributed trial,
  ``None`` in a single process). A checkpoint of another world size is not used (the global batch
  would change) and a damaged one is skipped with a ``RuntimeWarning``: the previous one is used.
* ``latest_any_world(gather)``: the same for an elastic trial, whose ranks all hold the same state and
  whose global batch is the same on every size: a checkpoint of any world size, and whether this rank's
  state is another rank's (it did not exist when the checkpoint was written: no RNG states of its own).
* A format whose ``sharded_state`` is true (``dcp``) also keeps a state **sharded over the ranks**
  (``fsdp``'s and ``zero1``'s model and optimizer): ``save(..., sharded=items)`` with this rank's part
  as a flat mapping of names to tensors (``DTensor`` shards, or tensors this rank holds), written
  sharded; ``latest(gather, sharded=template)`` / ``latest_any_world(...)`` with ``template`` a
  function returning the tensors to read into, by the same names, at this rank's sharding now (called
  on every rank once the step is agreed, only when there is one to read): they are filled in place,
  resharded when the world size changed. Other formats refuse ``sharded`` (``CheckpointError``).
* ``wait()`` blocks until the last write is on disk; ``close()`` does that and stops any thread.
* ``step_files(step)``: the files that hold ``step`` (every rank's), for tests and the study.

Every format is atomic (a crash leaves the previous checkpoint usable, never a partial one under a
final name), checksummed (SHA-256: a damaged file is refused), loads no pickled code, and on CPU
resumes bitwise where its docs say so (docs/checkpointing.md). Attributes every format keeps:
``last_step`` (newest step saved or resumed), ``last_size`` (bytes this rank wrote for it), ``write_s``
(seconds its writes took, in the background when they run there), ``errors``, ``last_error``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from hpoflow.registry import Options

__all__ = ["CheckpointError", "CheckpointFormat", "CorruptCheckpoint", "Gather", "Template", "UnsafeCheckpoint"]

Gather = Callable[[list[int]], list[list[int]]]
#: a sharded state's template: the tensors to read into, by name (``CheckpointFormat.latest``)
Template = Callable[[], Mapping[str, Any]]


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used."""


class CorruptCheckpoint(CheckpointError):
    """The file is truncated, damaged or not a checkpoint (header, length or checksum test failed)."""


class UnsafeCheckpoint(CheckpointError):
    """The payload holds something other than tensors and plain data (``weights_only`` refused it)."""


class CheckpointFormat(abc.ABC):
    """One rank's checkpoints in one directory; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    #: one copy of ``state`` for all ranks: ``state`` must be the same on every rank
    shared_state: ClassVar[bool] = False
    #: keeps a state sharded over the ranks (``sharded=`` of ``save`` and ``latest``)
    sharded_state: ClassVar[bool] = False

    def __init__(self, directory: Path, rank: int = 0, world_size: int = 1, keep: int = 2,
                 background: bool = True, elastic: bool = False, options: Options | None = None) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint keep >= 1 must hold, but got keep={keep}. Fix: set training.checkpoint.keep")
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.background = background
        self.elastic = elastic
        self.options = options
        self.last_step: int | None = None
        self.last_size = 0
        self.write_s = 0.0
        self.errors = 0
        self.last_error: BaseException | None = None

    @abc.abstractmethod
    def save(self, state: Mapping[str, Any], step: int, private: Mapping[str, Any] | None = None, *,
             sharded: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``state`` (and this rank's ``private``, and its part of a ``sharded`` state) as
        ``step``; every rank, same step."""

    @abc.abstractmethod
    def latest(self, gather: Gather | None = None, *,
               sharded: Template | None = None) -> tuple[int, dict[str, Any]] | None:
        """The newest step usable on every rank and this rank's state for it, or ``None``."""

    @abc.abstractmethod
    def latest_any_world(self, gather: Gather | None = None, *,
                         sharded: Template | None = None) -> tuple[int, dict[str, Any], bool] | None:
        """Elastic ``latest``: any world size; the flag says the state is not this rank's own."""

    def _no_sharded(self, sharded: object) -> None:
        """Refuse a sharded state in a format that cannot keep one."""
        if sharded is not None:
            raise CheckpointError(
                f"checkpoint format {self.name!r} keeps each rank's state whole, not a state sharded over the "
                "ranks (fsdp's and zero1's model and optimizer). Fix: use training.checkpoint.format: dcp")

    @abc.abstractmethod
    def wait(self) -> None:
        """Block until the last write has finished."""

    @abc.abstractmethod
    def close(self) -> None:
        """Wait for the last write and stop any thread (idempotent; a later save starts again)."""

    @abc.abstractmethod
    def step_files(self, step: int) -> list[Path]:
        """The files (every rank's) that hold ``step``, as they are on disk now."""
