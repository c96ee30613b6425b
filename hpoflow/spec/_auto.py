"""``search.algorithm: auto``: the searcher hpoflow recommends, from its benchmark (docs/search.md); and
what ``search.algorithm: bohb`` brings with it.

On YAHPO Gym's LCBench surrogate (the paper's 6,544-epoch budget: ``bench/search_benchmark.py``,
docs/search.md), 30 repetitions on each of 3 instances:

- one trial at a time, the lowest mean regret at 10 %, 25 % and 100 % of the budget was Optuna's GP fitted
  per budget (``per_budget``, on by default with a pruner: ``hpoflow.search.models``) with Thompson
  sampling (``acquisition: auto`` with a budget: ``hpoflow.search.gp_parallel``) and the stopping ASHA
  pruner (0.045), then the same GP with the Hyperband pruner (0.064) and the GP training every trial to the
  end (0.070); TPE per budget with the ASHA pruner 0.081, BOHB's model with promotion ASHA 0.082;
- with 32 trials at once (5 repetitions, one instance), the same GP with the stopping ASHA pruner had the
  lowest final regret of every arm (0.014, against 0.028-0.146) and at 25 % of the budget, and reached
  Random's final regret in 148 s of virtual time (Random 276 s; with the Hyperband pruner 117 s); at 1,024
  trials at once its Thompson sampling keeps the driver under 20 ms of CPU a trial.

So ``auto`` is ``gp`` with the ``asha`` pruner for trials of several epochs, and ``gp`` alone for one-epoch
trials (nothing to stop early, no budgets to model). A pruner or scheduler the study names is kept;
``sampler_options`` go to the GP.
"""

from __future__ import annotations

from typing import Any

__all__ = ["AUTO_ALGORITHM", "AUTO_PRUNER", "BOHB_PRUNER", "resolve_auto", "resolve_bohb"]

AUTO_ALGORITHM = "gp"  # the arm that won (docs/search.md)
AUTO_PRUNER: dict[str, Any] = {"type": "asha"}  # its early stopping, for trials of several epochs
# BOHB's scheduling where the study names none: asynchronous, as ASHA (Syne Tune's BOHB is ASHA with
# BOHB's model too); measured better with it than with the Hyperband pruner (docs/search.md)
BOHB_PRUNER: dict[str, Any] = {"type": "asha"}


def resolve_auto(search: dict[str, Any], training: Any) -> dict[str, Any]:
    """The ``search`` section with ``algorithm: auto`` replaced by what it stands for (module docstring)."""
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
