"""The time limit of a batch job that runs a study (``hpoflow launch``, compss or slurm), from its budget.

A batch system stops a job at its time limit, and its default is often short (COMPSs's
``enqueue_compss``: 10 minutes): the job asks for the study's own budget instead. Pure functions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["FLOOR_MINUTES", "MARGIN_MINUTES", "JobTime", "job_time"]

FLOOR_MINUTES = 30  # never ask for less: the runtime's start-up, queueing of the first trials, shutdown
MARGIN_MINUTES = 5  # on top of the study's budget: runtime start and stop


@dataclass(frozen=True)
class JobTime:
    """The job's time limit in minutes (``--exec_time``, ``--time``), how it was chosen, and warnings."""

    minutes: int
    source: str
    warnings: tuple[str, ...] = ()


def job_time(given: int | None, *, search_timeout: float | None, n_trials: int | None, max_concurrent: int,
             trial_timeout: float | None) -> JobTime:
    """``given`` (``--time``) or one derived from the study's budget, with a floor.

    Derived: ``search.timeout`` (no trial starts after it) plus one trial's ``resources.timeout`` (a
    trial started just before the deadline runs to its end); else ``ceil(n_trials / max_concurrent)``
    waves of ``resources.timeout``; plus ``MARGIN_MINUTES``, at least ``FLOOR_MINUTES``. A warning when
    the time is shorter than one trial's timeout, or when nothing bounds the study.
    """
    warnings: list[str] = []
    if given is not None:
        minutes, source = given, "--time"
    else:
        budget_s: float | None = None
        if search_timeout:
            budget_s = search_timeout + (trial_timeout or 0.0)
            source = "search.timeout" + (" + resources.timeout" if trial_timeout else "")
        elif n_trials and trial_timeout:
            budget_s = math.ceil(n_trials / max(1, max_concurrent)) * trial_timeout
            source = "ceil(search.n_trials / search.max_concurrent) x resources.timeout"
        if budget_s is None:
            minutes, source = FLOOR_MINUTES, "the floor"
            warnings.append(
                f"--time not given and the study has no time budget (search.timeout, or search.n_trials with "
                f"resources.timeout): asking for {FLOOR_MINUTES} minutes; the batch system stops the study "
                "then. Fix: pass --time MINUTES, or set search.timeout")
        else:
            minutes = max(FLOOR_MINUTES, math.ceil(budget_s / 60) + MARGIN_MINUTES)
            source += f" + {MARGIN_MINUTES} min" + (f", at least {FLOOR_MINUTES}" if minutes == FLOOR_MINUTES else "")
    if trial_timeout and minutes * 60 < trial_timeout:
        warnings.append(
            f"the job's time ({minutes} min, from {source}) is shorter than one trial's timeout "
            f"(resources.timeout = {trial_timeout:g} s): the batch system will kill trials before they end. "
            f"Fix: --time {math.ceil(trial_timeout / 60) + MARGIN_MINUTES} or more, or lower resources.timeout")
    return JobTime(minutes, source, tuple(warnings))
