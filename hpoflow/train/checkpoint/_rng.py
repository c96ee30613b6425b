"""A process's global RNG states as plain data (tensors and numbers: what ``weights_only`` loads)."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng", "seed_joining_rank"]


def capture_rng() -> dict[str, Any]:
    """This process's global RNG states (Python, NumPy's legacy global, torch CPU and CUDA) as plain data."""
    version, py_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the global RNG states from ``capture_rng()``'s output."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                         float(n["cached_gaussian"])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_joining_rank(seed: int, step: int, rank: int) -> None:
    """Seed Python's, NumPy's and torch's generators for a rank that joins a resized (elastic) trial at
    ``step``, whose checkpoint holds no RNG states of its own: a function of the trial's seed, the
    step and the rank, so reruns draw the same."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    value = int.from_bytes(digest[:8], "little")
    random.seed(value)
    np.random.seed(value % (2**32))
    torch.manual_seed(value % (2**63))


