"""``search.algorithm: auto``: the searcher hpoflow recommends, from its benchmark (docs/search.md); and
what ``search.algorithm: bohb`` brings with it.

On YAHPO Gym's LCBench surrogate (the paper's 6,544-epoch budget, one trial at a time:
``bench/search_benchmark.py``), the lowest mean regret over the 3 instances at 10 %, 25 % and 100 % of the
budget was Optuna's GP, trials trained to the end (0.069, 15 repetitions); of the arms that stop trials
early, TPE fitted per budget (``per_budget``, on by default with a pruner: ``hpoflow.search.models``) with
the stopping ASHA pruner (judging from the first rung of Hyperband's geometry, ``hpoflow.search.options``)
(0.080, 30 repetitions; BOHB's model with promotion ASHA, which needs trials that checkpoint, 0.081; TPE
alone 0.129). With trials at once, GP's ask (a fifth to half a second of the driver's CPU, whatever the
history) counts against it, and GP was not measured on many workers; on 32 workers the stopping ASHA pruner
with TPE per budget was the best of the arms that need only reports. So ``auto`` is GP for a study that runs one trial
at a time (``max_concurrent: 1``), and otherwise TPE per budget with the ASHA pruner for trials of several
epochs and TPE alone for one-epoch trials (nothing to stop early, no budgets to model). A pruner or
scheduler the study names is kept; ``sampler_options`` go to the sampler ``auto`` picks.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUTO_ALGORITHM", "AUTO_ONE_AT_A_TIME", "AUTO_PRUNER", "BOHB_PRUNER", "resolve_auto", "resolve_bohb"]

AUTO_ONE_AT_A_TIME = "gp"  # the arm that won one trial at a time (docs/search.md)
AUTO_ALGORITHM = "tpe"  # the arm that won of those that stop trials early (with AUTO_PRUNER: per budget)
AUTO_PRUNER: dict[str, Any] = {"type": "asha"}  # its early stopping
# BOHB's scheduling where the study names none: asynchronous, as ASHA (Syne Tune's BOHB is ASHA with
# BOHB's model too); measured better with it than with the Hyperband pruner (docs/search.md)
BOHB_PRUNER: dict[str, Any] = {"type": "asha"}


def resolve_auto(search: dict[str, Any], training: Any) -> dict[str, Any]:
    """The ``search`` section with ``algorithm: auto`` replaced by what it stands for (module docstring)."""
    at_once = search.get("max_concurrent", 1)
    if isinstance(at_once, int) and not isinstance(at_once, bool) and at_once <= 1:
        return {**search, "algorithm": AUTO_ONE_AT_A_TIME}
    if _one_epoch(training):
        return {**search, "algorithm": "tpe"}
    return _with_default_pruner({**search, "algorithm": AUTO_ALGORITHM}, training, AUTO_PRUNER)


def resolve_bohb(search: dict[str, Any], training: Any) -> dict[str, Any]:
    """``search.algorithm: bohb`` (``hpoflow.search.bohb``, the model) stops trials early: with no pruner
    or scheduler named, and trials of several epochs, the ``asha`` pruner (which needs only reports;
    ``search.scheduler: asha`` or ``hyperband`` pauses and resumes instead)."""
    return _with_default_pruner(search, training, BOHB_PRUNER)


def _one_epoch(training: Any) -> bool:
    epochs = training.get("epochs", 10) if isinstance(training, dict) else 10
    return isinstance(epochs, int) and not isinstance(epochs, bool) and epochs <= 1


def _with_default_pruner(search: dict[str, Any], training: Any, pruner: dict[str, Any]) -> dict[str, Any]:
    named_pruner = search.get("pruner")
    named = (isinstance(named_pruner, dict) and named_pruner.get("type", "none") != "none") or (
        isinstance(named_pruner, str) and named_pruner != "none")
    scheduler = search.get("scheduler")
    scheduled = (isinstance(scheduler, dict) and scheduler.get("type", "none") != "none") or (
        isinstance(scheduler, str) and scheduler != "none")
    if _one_epoch(training) or named or scheduled or "pruner" in search:
        return search
    return {**search, "pruner": dict(pruner)}
