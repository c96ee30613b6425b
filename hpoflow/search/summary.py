"""What the driver tells and returns: ``DriverListener`` (events as a study runs), ``DriverSummary``
(the whole study's counts and how it stopped), and the values a finished trial is told with. Kept
apart from ``driver.py`` so that readers of a study's outcome need not import the driver."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import optuna

from hpoflow.fileio import write_atomic
from hpoflow.run.ledger import ATTR_ENQUEUED
from hpoflow.spec import SYSTEM_PREFIX, StudySpec, parse_constraint
from hpoflow.trial import TrialRequest, TrialResult

__all__ = ["DriverListener", "DriverSummary", "constraint_values", "enqueue_known", "measured", "median_recent",
           "objective_values", "write_result"]


class DriverListener:
    """What the driver tells as a study runs (progress displays, tracking tools). Every method is a
    no-op here: a listener overrides the events it cares about. Called from the driver's thread."""

    def on_start(self, n_total: int, n_done: int) -> None:
        """The study starts: ``n_total`` is the budget, ``n_done`` the trials that already count."""

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        """Trial ``number`` was submitted with ``params``."""

    def on_trial_report(self, number: int, step: int, metrics: dict[str, float]) -> None:
        """An intermediate report of a running trial."""

    def on_trial_end(self, result: TrialResult, params: dict[str, Any], best: float | None) -> None:
        """A trial ended (``best``: the study's best value so far, one objective only)."""

    def on_finish(self, summary: DriverSummary) -> None:
        """The study's run ended."""


@dataclass
class DriverSummary:
    """The whole study's counts (earlier runs of a resumed study included); ``results`` and the
    times are this run's. ``n_trials`` is the budget."""

    n_trials: int
    n_complete: int = 0
    n_pruned: int = 0
    n_failed: int = 0
    # budget | timeout | energy_budget | max_failures | fail_fast | signal | preempted | grid_exhausted | storage
    # | capacity
    stopped_by: str = "budget"
    reason: str = ""  # why the study stopped early, in one line
    errors: list[str] = field(default_factory=list)  # the first distinct errors of failed trials
    elapsed_s: float = 0.0
    driver_overhead_s: float = 0.0
    results: list[TrialResult] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        """The CLI's exit code for this outcome (README, "Exit codes"): 130 stopped by a signal (a walltime
        warning included); 1 stopped by the storage (an outage past storage_retry_s, a full disk); 3 no
        trial of the study completed; 1 stopped early by max_failures or fail_fast, or because the engine
        can no longer run a trial (capacity: nodes lost); 0 otherwise."""
        if self.stopped_by in ("signal", "preempted"):
            return 130
        if self.stopped_by in ("storage", "capacity"):
            return 1
        if self.n_complete == 0:
            return 3
        return 1 if self.stopped_by in ("max_failures", "fail_fast") else 0

    def outcome_message(self) -> str:
        """One line (plus the first distinct errors, where trials failed with some) for a study that did not end
        well; '' if it did."""
        if self.stopped_by == "signal":
            return "stopped by a signal; rerun the same command to resume"
        if self.stopped_by == "preempted":
            return ("stopped by a walltime warning (SIGUSR1): the running trials paused with a checkpoint; rerun "
                    "the same command (or resubmit the job) to resume")
        if self.stopped_by in ("storage", "capacity"):
            return f"stopped: {self.reason}"
        errors = ("; first distinct errors (details in trials.csv and trials/<n>/rank<r>.log):"
                  + "".join(f"\n  - {e}" for e in self.errors)) if self.errors else ""
        if self.n_complete == 0:
            if self.stopped_by == "timeout" and self.n_finished == 0:
                return (f"no trial ran: {self.reason} before the first one started. Fix: raise search.timeout (it "
                        "counts from the start of the run), then rerun the same command to resume")
            why = f": {self.reason}" if self.reason else ""
            return f"no trial completed ({self.n_failed} failed, {self.n_pruned} pruned){why}{errors}"
        if self.stopped_by == "max_failures":
            return f"stopped: search.max_failures reached{errors}"
        if self.stopped_by in ("fail_fast", "energy_budget"):
            return f"stopped: {self.reason}"
        return ""

    def note_error(self, error: str | None) -> None:
        text = (error or "").strip()
        head = text.splitlines()[0][:300] if text else "failed without an error message"
        if head not in self.errors and len(self.errors) < 5:
            self.errors.append(head)

    def fail_fast(self, k: int | None) -> bool:
        """Whether the study's first ``k`` finished trials (``search.fail_fast``) all failed with one error:
        the rest would fail the same way (a typo, a missing file, an import error); sets ``reason``."""
        if k and self.n_complete == 0 and self.n_pruned == 0 and self.n_failed >= k and len(self.errors) == 1:
            self.reason = (f"the first {self.n_failed} trials all failed with the same error: {self.errors[0]} "
                           "(search.fail_fast; set it to 0 to keep going)")
            return True
        return False

    @property
    def n_finished(self) -> int:
        return self.n_complete + self.n_pruned + self.n_failed


def measured(res: TrialResult) -> dict[str, float]:
    """A trial's figures by the names objectives and constraints use: its metrics, and its system
    usage as ``system_<figure>`` (``system_energy_j``, ``system_rss_peak_mb``)."""
    return {**res.metrics, **{f"{SYSTEM_PREFIX}{k}": v for k, v in res.system.items()}}


def constraint_values(spec: StudySpec, res: TrialResult) -> dict[str, float]:
    """``study.constraints`` of a finished trial as Optuna's constraint values (<= 0: feasible), from
    its metrics and ``system_`` usage; a figure the trial did not measure counts as infeasible."""
    measured_ = measured(res)
    out = {}
    for text in spec.study.constraints:
        name, op, bound = parse_constraint(text)
        value = measured_.get(name)
        if value is None or not math.isfinite(value):
            out[text] = 1.0
        else:
            out[text] = value - bound if op == "<=" else bound - value
    return out


def objective_values(spec: StudySpec, res: TrialResult) -> tuple[list[float] | None, str | None]:
    """The values to tell for a complete trial (one per objective), or why it has none."""
    objectives = spec.study.objectives
    if len(objectives) == 1:
        ok = res.value is not None and math.isfinite(res.value)
        return ([float(res.value)] if ok and res.value is not None else None), None
    values = []
    figures = measured(res)
    for name, _ in objectives:
        v = figures.get(name)
        if v is None and name.startswith(SYSTEM_PREFIX):
            return None, (f"objective {name!r} (study.metrics) was not measured for this trial (for energy: "
                          "no counter of its devices was readable on its node; docs/energy.md)")
        if v is None or not math.isfinite(v):
            return None, (f"objective {name!r} (study.metrics) is {'missing' if v is None else v} in the "
                          f"trial's result; it returned {sorted(res.metrics)}. Fix: return every objective")
        values.append(float(v))
    return values, None


def write_result(request: TrialRequest, res: TrialResult) -> None:
    """Write the trial's result.json (``OSError`` when the disk is full: the storage still gets the
    result). Not fsynced: the storage's write that finishes the trial is the one durable write per
    trial (docs/performance.md, "One fsync per trial")."""
    d = Path(request.trial_dir)
    payload = {"params": request.params, "attempt": request.attempt, **res.to_dict()}
    d.mkdir(parents=True, exist_ok=True)
    write_atomic(d / "result.json", json.dumps(payload, indent=1, default=str), durable=False)


def enqueue_known(study: optuna.Study, points: list[dict[str, Any]]) -> None:
    """``search.enqueue``: known configurations, evaluated first; each once per study (a resumed study
    does not enqueue again what it already holds)."""
    done = {t.user_attrs.get(ATTR_ENQUEUED) for t in study.get_trials(deepcopy=False)}
    for i, point in enumerate(points):
        if i not in done:
            study.enqueue_trial(point, user_attrs={ATTR_ENQUEUED: i}, skip_if_exists=False)


def median_recent(xs: list[float]) -> float:
    """The median of the last 200 of ``xs`` (recent ones: samplers slow down as the study grows)."""
    ordered = sorted(xs[-200:])
    return ordered[len(ordered) // 2]
