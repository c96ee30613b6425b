"""GPUs per rank as a spec gives them: a whole number, or a share ``1/k`` of one GPU.

``resources.gpus_per_process`` is ``0`` (CPU ranks), a whole number of GPUs per rank, or ``1/k``
(``0.5``, ``0.25``, ``0.125``, ``0.333`` for a third): ``k`` ranks of different trials then share one
GPU. Every engine reads the value through :func:`shares_per_gpu`.
"""

from __future__ import annotations

__all__ = ["SHARE_TOLERANCE", "share_error", "shares_per_gpu"]

SHARE_TOLERANCE = 1e-3
"""How far a written share may be from ``1/k`` (``0.333`` is a third; ``0.3`` is no share)."""

_MAX_SHARES = 64  # a GPU split into more than 64 shares leaves each rank too little to train anything


def shares_per_gpu(gpus_per_process: float) -> int:
    """``k`` for a share ``1/k`` of one GPU per rank; ``0`` for a whole number of GPUs (``0`` included).
    ``ValueError`` for any other value (the spec refuses them first: ``share_error``)."""
    why = share_error(gpus_per_process)
    if why:
        raise ValueError(why)
    if gpus_per_process >= 1 or gpus_per_process == 0:
        return 0
    return round(1 / gpus_per_process)


def share_error(value: float) -> str:
    """Why ``value`` is no valid ``gpus_per_process`` (``""``: it is valid)."""
    if value < 0:
        return "must be 0 or more"
    if value == 0 or (value >= 1 and float(value).is_integer()):
        return ""
    if value > 1:
        return "above 1 must be a whole number of GPUs"
    k = round(1 / value)
    if k > _MAX_SHARES:
        return f"is below 1/{_MAX_SHARES}, the smallest share of one GPU"
    if abs(value - 1 / k) > SHARE_TOLERANCE:
        return "below 1 must be a share 1/k of one GPU (0.5, 0.25, 0.125, 0.333 for a third)"
    return ""
