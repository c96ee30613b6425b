"""``search.algorithm: auto``: the searcher hpoflow recommends, from its benchmark (docs/search.md).

On YAHPO Gym's LCBench surrogate (the paper's 6,544-epoch budget, 30 repetitions, one trial at a time:
``bench/search_benchmark.py``), of the arms that need nothing of the training
code but per-epoch reports, TPE with the median pruner (judging from the first rung of Hyperband's
geometry, ``hpoflow.search.options``) had the lowest mean regret over the 3 instances at 10 %, 25 % and
100 % of the budget. So
``auto`` is TPE (constant liar when trials run at once) with that pruner for a study whose trials train
several epochs, and TPE alone for one whose trials have one epoch (nothing to stop early). A pruner or
scheduler the study names is kept; ``sampler_options`` are TPE's.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUTO_PRUNER", "resolve_auto"]

AUTO_PRUNER: dict[str, Any] = {"type": "median"}  # the early-stopping arm that won (docs/search.md)


def resolve_auto(search: dict[str, Any], training: Any) -> dict[str, Any]:
    """The ``search`` section with ``algorithm: auto`` replaced by what it stands for (module docstring)."""
    out = {**search, "algorithm": "tpe"}
    epochs = training.get("epochs", 10) if isinstance(training, dict) else 10
    one_epoch = isinstance(epochs, int) and not isinstance(epochs, bool) and epochs <= 1
    pruner = search.get("pruner")
    named = (isinstance(pruner, dict) and pruner.get("type", "none") != "none") or (
        isinstance(pruner, str) and pruner != "none")
    scheduler = search.get("scheduler")
    scheduled = isinstance(scheduler, dict) and scheduler.get("type", "none") != "none"
    if not (one_epoch or named or scheduled):
        out["pruner"] = dict(AUTO_PRUNER)
    return out
