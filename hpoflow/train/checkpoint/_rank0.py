"""The ``rank0`` format: the state is written once, by rank 0; every rank restores from it.

Under DDP (the ``allreduce`` strategy) every rank holds the same model and optimizer, so ``replica``
writes ``world_size`` identical copies. Here rank 0 writes ``rank0-<step:08d>-r0.pt`` (the state and
its own RNG states) and every other rank writes ``rank0-<step:08d>-r<rank>.pt`` holding only its RNG
states (a few kB): a 2-rank trial writes half the bytes of ``replica``, and the save stays free of
collectives (each file is written by its own rank, in the background). A step is complete when every
rank's file is there; a rank resumes with rank 0's state and its own RNG states, so on CPU a resume
at the same world size is bitwise the uninterrupted run. In an elastic trial a rank that did not
exist when the step was written takes rank 0's state and RNG streams seeded from the trial's seed.

The files, their checks, atomicity and pruning are the ``replica`` format's (``_replica``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpoflow.train.checkpoint._file import snapshot
from hpoflow.train.checkpoint._replica import Checkpointer

__all__ = ["Rank0Checkpointer"]


class Rank0Checkpointer(Checkpointer):
    """The ``rank0`` format; see the module docstring."""

    name = "rank0"
    shared_state = True
    prefix = "rank0"
    needs_chief = True

    def _payload(self, state: Mapping[str, Any], private: Mapping[str, Any]) -> dict[str, Any]:
        # only rank 0 copies the state: the other ranks' saves cost a few kB
        return {"state": snapshot(state) if self.rank == 0 else None, "private": snapshot(dict(private))}

    def _compose(self, chief: dict[str, Any], own: dict[str, Any] | None) -> dict[str, Any]:
        private = (own.get("private") if own is not None else None) or {}
        return {**chief["state"], **private}  # rank 0's state (checked by _mismatch), this rank's RNG

    def _mismatch(self, payload: Any, step: int, rank: int) -> str | None:
        problem = super()._mismatch(payload, step, rank)
        if problem is None and rank == 0 and not isinstance(payload.get("state"), dict):
            return "rank 0's file holds no state (not a rank0-format checkpoint)"
        return problem
