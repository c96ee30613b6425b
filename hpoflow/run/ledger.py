"""The trial-attribute ledger: what hpoflow writes on a trial beside Optuna's own fields, and which
trials count against ``n_trials``.

An interrupted trial (a stop signal, a crashed driver, a cancel) is told FAIL and rerun as a new trial
whose user attr ``ATTR_REPLACES`` holds its number: the interrupted one does not count. Trials imported
by a warm start (``ATTR_IMPORTED``) and trials asked ahead but never run (``ATTR_UNUSED``) do not
count either. The driver, the report and ``status`` all count through ``is_counted``.
"""

from __future__ import annotations

from collections.abc import Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

__all__ = ["ATTR_CHECKPOINTS", "ATTR_ENQUEUED", "ATTR_GRID", "ATTR_IMPORTED", "ATTR_REPLACES", "ATTR_UNUSED",
           "FINISHED", "count_finished", "interrupted", "is_counted"]

ATTR_REPLACES = "hpoflow_replaces"  # user attr: the number of the interrupted trial this one reruns
_LEGACY_INTERRUPTED = "hpoflow_interrupted"  # system attr of runs written before ATTR_REPLACES
ATTR_GRID = "grid_index"  # user attr: the trial's point of an exact grid
ATTR_ENQUEUED = "hpoflow_enqueued"  # user attr: index in search.enqueue of a known configuration
ATTR_IMPORTED = "hpoflow_warm_start"  # user attr: a completed trial imported from another study (a prior)
ATTR_UNUSED = "hpoflow_asked_unused"  # user attr: asked ahead, never run (the study ended first): not counted
ATTR_CHECKPOINTS = "checkpoint_dir"  # user attr: a rerun resumes from the replaced trial's checkpoints
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def interrupted(trials: list[FrozenTrial]) -> set[int]:
    """Numbers of the trials that were interrupted and rerun (they do not count)."""
    out = {int(t.user_attrs[ATTR_REPLACES]) for t in trials if ATTR_REPLACES in t.user_attrs}
    return out | {t.number for t in trials if t.system_attrs.get(_LEGACY_INTERRUPTED)}


def is_counted(trials: list[FrozenTrial]) -> Callable[[FrozenTrial], bool]:
    """A predicate: does this trial count (it was not interrupted and rerun, nor imported by a warm
    start, nor asked ahead and never run)?"""
    skip = interrupted(trials)
    return lambda t: t.number not in skip and ATTR_IMPORTED not in t.user_attrs and ATTR_UNUSED not in t.user_attrs


def count_finished(study: optuna.Study) -> int:
    """Trials that count against ``n_trials``: complete, pruned, or failed for a reason of their own."""
    trials = study.get_trials(deepcopy=False)
    counted = is_counted(trials)
    return sum(1 for t in trials if t.state in FINISHED and counted(t))
