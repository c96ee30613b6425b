"""The driver's side of a scheduler (``search.scheduler``): what it writes in the storage when a trial
reaches a rung, pauses, is promoted, or is closed at the end (``hpoflow.search.schedulers`` decides).

Kept out of ``driver.py``: the driver calls ``at_report`` for every report that wants an answer,
``paused`` for a result that is the pause it asked for, ``promotion`` when a slot is free, and
``close_paused`` when nothing is left to run.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpoflow.registry import SCHEDULERS
from hpoflow.run.claims import Claims
from hpoflow.run.energy import SEGMENT_ENERGY, carried_energy, run_energy
from hpoflow.run.ledger import (
    ATTR_BRACKET,
    ATTR_CHECKPOINTS,
    ATTR_DRIVER,
    ATTR_LINEAGE,
    ATTR_NEXT_ATTEMPT,
    ATTR_PAUSED,
    ATTR_RUNGS,
    ATTR_SEGMENTS,
)
from hpoflow.run.shared import SharedStudy, promotion_key
from hpoflow.search.schedulers import PromotionScheduler, Rungs
from hpoflow.spec import StudySpec
from hpoflow.trial import TrialRequest, TrialResult

__all__ = ["Scheduling", "carried"]

_log = logging.getLogger("hpoflow")


class Scheduling:
    """One driver's use of the study's scheduler."""

    def __init__(self, spec: StudySpec, study: optuna.Study, shared: SharedStudy) -> None:
        s = spec.search.scheduler
        self.study = study
        self.shared = shared
        self.policy: PromotionScheduler = SCHEDULERS.get(s.type)(SCHEDULERS.options(s.type, s.options),
                                                                 spec.study.direction)
        self.rungs = Rungs(self.policy)  # the study's rungs, kept up to date at every read of the study
        shared.tally.watch(self.rungs.update)
        self.claims = Claims(study)
        self._asked: dict[int, tuple[int, int]] = {}  # trial number -> (rung, step) this driver asked it to pause at
        self.n_paused = 0  # this run's pauses
        self.n_promoted = 0  # this run's promotions (a paused trial resumed)
        self.n_went_on = 0  # rungs passed without a pause (in the top 1/eta on arrival)

    def most_runs_per_trial(self, epochs: int) -> int:
        """The most runs a trial may take: one, and one more after each rung it may pause at (the
        bracket with the most rungs)."""
        brackets = self.policy.n_brackets(epochs)
        return 1 + max(len(self.policy.rungs(self.policy.base + b, epochs)) for b in range(brackets))

    def at_report(self, trial: optuna.trial.Trial, request: TrialRequest, step: int, value: float) -> bool:
        """A report that wants an answer: records the rung value if the report at ``step`` reaches a rung
        of the trial (its first report at or past the rung: ``PromotionScheduler.at_rung``); True when the
        trial should pause here (the driver answers pause; it pauses at that rung)."""
        if not math.isfinite(value):
            return False
        epochs = int(request.train.get("epochs") or 0) or step + 1
        attrs = trial.user_attrs
        reached = self.policy.at_rung(trial.number, attrs, step, epochs)
        if reached is None:
            return False
        bracket, rung = reached
        rungs = dict(attrs.get(ATTR_RUNGS) or {})
        rungs[str(rung)] = float(value)
        if attrs.get(ATTR_BRACKET) != bracket:
            trial.set_user_attr(ATTR_BRACKET, bracket)
        trial.set_user_attr(ATTR_RUNGS, rungs)
        self.shared.refresh()
        if self.rungs.goes_on(trial.number, bracket, rung, float(value)):
            self.n_went_on += 1
            return False
        self._asked[trial.number] = (rung, step)
        return True

    def paused(self, trial: optuna.trial.Trial, request: TrialRequest, res: TrialResult) -> bool:
        """A result of a trial this driver asked to pause: if it paused (a checkpoint at the rung), the
        trial stays RUNNING, marked paused at that rung, and True; otherwise False (the driver handles
        it as any result: an interrupted trial is rerun)."""
        asked = self._asked.pop(trial.number, None)
        if asked is None or res.status != "cancelled" or not (res.error or "").startswith("paused"):
            return False
        rung, step = asked
        tm = res.timings
        start = float(tm.get("started_at", 0.0)) - float(tm.get("launch_s", 0.0))  # its submit, as the report's
        duration = float(tm.get("duration_s", 0.0))
        segments = list(trial.user_attrs.get(ATTR_SEGMENTS) or [])
        segments.append({"start": round(start, 3), "end": round(start + duration, 3), "step": rung,
                         "reported": step, "run_s": round(float(tm.get("run_s", duration)), 3),
                         "outcome": "paused", **({SEGMENT_ENERGY: e} if (e := run_energy(res.system)) else {})})
        trial.set_user_attr(ATTR_SEGMENTS, segments)
        if ATTR_CHECKPOINTS not in trial.user_attrs:  # where any driver's promotion finds its checkpoint
            trial.set_user_attr(ATTR_CHECKPOINTS, str(Path(request.trial_dir) / "checkpoints"))
        trial.set_user_attr(ATTR_NEXT_ATTEMPT, request.attempt + 1)
        trial.set_user_attr(ATTR_PAUSED, rung)  # last: from here any driver may promote it
        self.n_paused += 1
        return True

    def promotion(self, busy: set[int]) -> tuple[optuna.trial.Trial, int] | None:
        """A paused trial to resume now (claimed: no longer paused, this driver's), with the attempt
        number its run takes; None if none is promotable."""
        self.shared.refresh()
        skip = set(busy)
        while True:
            t = self.rungs.next_promotion(skip)
            if t is None:
                return None
            if self._claim(t):
                break
            skip.add(t.number)  # another driver promoted (or closed) it first
        trial = optuna.trial.Trial(self.study, t._trial_id)
        try:
            trial.set_user_attr(ATTR_DRIVER, self.shared.lease.id)
            trial.set_user_attr(ATTR_PAUSED, None)
        except optuna.exceptions.UpdateFinishedTrialError:
            return None
        self.n_promoted += 1
        _log.info("trial %d promoted from rung %s", t.number, t.user_attrs.get(ATTR_PAUSED))
        return trial, int(t.user_attrs.get(ATTR_NEXT_ATTEMPT, 1))

    def active(self) -> bool:
        """Whether any trial of the study (any driver's) runs now, paused ones aside."""
        tally = self.shared.tally
        return len(tally.running) > len(tally.paused)

    def close_paused(self) -> int:
        """Nothing runs, nothing may start, none is promotable: the paused trials stopped at their rung
        for good (PRUNED, with the value of their last report). Returns how many were closed."""
        self.shared.refresh()
        closed = 0
        for t in list(self.shared.tally.paused.values()):
            if not self._claim(t):
                continue  # another driver promoted it
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self.study.tell(t.number, state=TrialState.PRUNED, skip_if_finished=True)
                closed += 1
        self.shared.refresh()
        return closed

    def _claim(self, t: FrozenTrial) -> bool:
        """Whether this driver may resume (or close) the paused trial ``t``: a compare-and-set on its pause
        in the storage (``promotion_key``, a claim: ``hpoflow.run.claims``), so that of the drivers that try
        at once exactly one does. (Should that one die before it resumes the trial, the trial is rerun as
        any dead driver's: ``SharedStudy.rerun_orphans``.)"""
        me = self.shared.lease.id
        return self.claims.claim(promotion_key(t), me) == me


def carried(attrs: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's attrs a rerun of an interrupted trial keeps (its rungs and bracket, a PBT lineage),
    and the energy of its paused segments, which the rerun resumes from (``hpoflow.run.energy``)."""
    return {**{k: v for k, v in attrs.items() if k in (ATTR_RUNGS, ATTR_BRACKET, ATTR_LINEAGE)},
            **carried_energy(attrs)}

