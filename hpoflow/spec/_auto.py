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

__all__ = ["AUTO_PRUNER", "BOHB_PRUNER", "resolve_auto", "resolve_bohb"]

AUTO_PRUNER: dict[str, Any] = {"type": "median"}  # the early-stopping arm that won (docs/search.md)
BOHB_PRUNER: dict[str, Any] = {"type": "hyperband"}  # BOHB's scheduling where the study names none


def resolve_auto(search: dict[str, Any], training: Any) -> dict[str, Any]:
    """The ``search`` section with ``algorithm: auto`` replaced by what it stands for (module docstring)."""
    return _with_default_pruner({**search, "algorithm": "tpe"}, training, AUTO_PRUNER)


def resolve_bohb(search: dict[str, Any], training: Any) -> dict[str, Any]:
    """``search.algorithm: bohb`` (``hpoflow.search.bohb``, the model) is Hyperband's: with no pruner or
    scheduler named, and trials of several epochs, the ``hyperband`` pruner (which needs only reports;
    ``search.scheduler: hyperband`` pauses and resumes instead)."""
    return _with_default_pruner(search, training, BOHB_PRUNER)


def _with_default_pruner(search: dict[str, Any], training: Any, pruner: dict[str, Any]) -> dict[str, Any]:
    epochs = training.get("epochs", 10) if isinstance(training, dict) else 10
    one_epoch = isinstance(epochs, int) and not isinstance(epochs, bool) and epochs <= 1
    named_pruner = search.get("pruner")
    named = (isinstance(named_pruner, dict) and named_pruner.get("type", "none") != "none") or (
        isinstance(named_pruner, str) and named_pruner != "none")
    scheduler = search.get("scheduler")
    scheduled = (isinstance(scheduler, dict) and scheduler.get("type", "none") != "none") or (
        isinstance(scheduler, str) and scheduler != "none")
    if one_epoch or named or scheduled or "pruner" in search:
        return search
    return {**search, "pruner": dict(pruner)}
