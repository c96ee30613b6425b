"""Helpers shared by the benchmark scripts: medians, JSON line, spec building."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))


def median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def emit(figures: dict[str, Any]) -> None:
    """The last line of every benchmark: one JSON object."""
    print(json.dumps(figures, sort_keys=True))


def function_spec(name: str, function: str, n_trials: int, slots: int, space: dict[str, Any] | None = None,
                  processes: int = 1) -> dict[str, Any]:
    return {
        "study": {"name": name, "metric": "value", "direction": "minimize"},
        "space": space or {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": slots, "seed": 0},
        "training": {"function": function},
        "resources": {"processes": processes, "cpus_per_process": 1},
    }
