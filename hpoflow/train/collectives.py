"""Traffic of collective operations, in bytes: the one formula the strategies' meters and the oracle share."""

from __future__ import annotations

__all__ = ["ring_allreduce_bytes"]


def ring_allreduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes one rank sends in a ring all-reduce of ``nbytes``: reduce-scatter + all-gather =
    2 (p - 1) / p * nbytes (0 for a single rank)."""
    return 2.0 * (world_size - 1) / world_size * nbytes if world_size > 1 else 0.0
