"""Objectives used by the benchmarks (imported inside trial processes)."""

from __future__ import annotations

import time

from hpoflow.train import TrialContext


def sleep50(ctx: TrialContext) -> float:
    """A 50 ms trial (sleep: the CPU stays free, so the figure is pure system overhead)."""
    time.sleep(0.05)
    return float(ctx.params.get("x", 0.0))


def sleep_for(ctx: TrialContext) -> float:
    time.sleep(float(ctx.params["duration"]))
    return 0.0
