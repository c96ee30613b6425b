"""A study that several drivers may share: what one driver does so that together they stay exact.

``SharedStudy`` wraps the Optuna study for one driver: its lease (``hpoflow.run.lease``), its view of
the whole study (``hpoflow.run.ledger.Tally``), and the moves that keep the study exact when other
drivers work on it at the same time:

- ``admit(trial)`` right after ``ask``: the trial runs only if the budget, counted from a fresh read
  of the storage, still has room for it, and no other trial already stands for its grid point, rerun
  or known configuration (``Tally.verdict``). Otherwise it goes back to the queue (WAITING: not
  counted, not a failure, run by the next ``ask``), or is closed uncounted if it is a duplicate.
- ``rerun_orphans()`` every beat interval: the RUNNING trials whose driver is dead are rerun
  (``interrupt``). The first time another live driver is seen, the sampler is reseeded
  (``reseed_rng``, as Optuna does for threads): drivers started from one spec share its seed and
  would otherwise draw the same configurations.
- ``give_back(trial)``: a trial asked but never run returns to the queue.
- A trial a scheduler paused (``ATTR_PAUSED``) is RUNNING but nobody's: any driver may promote it
  (``hpoflow.search.schedulers``), once it holds the trial's ``promotion_key`` (a claim:
  ``hpoflow.run.claims``), and it is not rerun as a dead driver's, unless the driver holding that
  claim died before it resumed the trial.

A driver alone on its study (no other lease alive) admits a trial from a read of the leases rather
than of every trial (``_alone``); per trial that is two small reads and one user attr, plus a lease
beat every ``lease_s / 4`` seconds.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.claims import Claims
from hpoflow.run.lease import Lease, LeaseInfo, LeaseWatch, read_leases
from hpoflow.run.ledger import (
    ATTR_DRIVER,
    ATTR_GRID,
    ATTR_NEXT_ATTEMPT,
    ATTR_PAUSED,
    ATTR_REPLACES,
    ATTR_UNUSED,
    Tally,
    claims,
)

__all__ = ["SharedStudy", "promotion_key"]

_log = logging.getLogger("hpoflow")
_CONTEND_S = 2.0  # how long a just-asked trial waits for other drivers' undecided trials to yield to it


def promotion_key(t: FrozenTrial) -> str:
    """The claim (``hpoflow.run.claims``) that lets one driver resume the paused trial ``t``: its number and
    the attempt its next run takes, so each pause of a trial has its own."""
    return f"promote:{t.number}:{int(t.user_attrs.get(ATTR_NEXT_ATTEMPT, 1))}"


class SharedStudy:
    """One driver's handle on a study other drivers may share. ``on_finished`` is called with every
    trial that finished (and counts) since the previous read, whoever ran it; ``pbt``: this driver runs
    ``search.scheduler: {type: pbt}`` (its lease says so: ``hpoflow.search.pbt``)."""

    def __init__(self, study: optuna.Study, run_dir: Path, lease_s: float,
                 on_finished: Callable[[FrozenTrial], None] | None = None, *, pbt: bool = False) -> None:
        self.study = study
        self.tally = Tally()
        self.lease = Lease(study, run_dir, lease_s, pbt=pbt)
        self.watch = LeaseWatch(self.lease.id, lease_s)
        self.on_finished = on_finished
        self._next_tick = 0.0
        self.claims = Claims(study)
        self._grid_next = 0  # no grid index below this is free
        self._reseeded = False

    def refresh(self) -> list[FrozenTrial]:
        """Read the study (``Tally.refresh``); the trials that finished (and count) since the last read."""
        done = self.tally.refresh(self.study)
        if self.on_finished is not None:
            for t in done:
                self.on_finished(t)
        return done

    def room(self, more: int, budget: int) -> bool:
        """Whether ``more`` trials fit the budget beside those finished and in flight in the whole
        study (every driver's). Alone on the study, the last read is exact enough (this driver's own
        trials finishing move from running to finished); beside other live drivers it reads again, so
        that a trial is rarely asked only to go back to the queue."""
        if more and self.watch.any_other_alive(time.monotonic()):
            self.refresh()
        return self.tally.finished + len(self.tally.running) + more <= budget

    def others_running(self, mine: set[int]) -> bool:
        return bool(set(self.tally.running) - mine)

    def next_grid_index(self, size: int) -> int | None:
        """The lowest index of a grid of ``size`` points that no trial of the study stands for yet
        (None: every point is taken), as of the last read."""
        while self._grid_next < size and self._grid_next in self.tally.grid_claimed:
            self._grid_next += 1
        return self._grid_next if self._grid_next < size else None

    def admit(self, trial: optuna.trial.Trial, budget: int, *, grid: bool = False) -> bool:
        """Right after ``ask``: may this trial run (``Tally.verdict``, from a fresh read)? If so it is
        marked as this driver's; if not it goes back to the queue, or is closed uncounted when another
        trial already stands for the same grid point, rerun or known configuration. ``grid``: every
        trial must stand for a grid point."""
        if not grid and self._alone(trial, budget):
            try:
                trial.set_user_attr(ATTR_DRIVER, self.lease.id)
            except optuna.exceptions.UpdateFinishedTrialError:
                return False
            return True
        until = time.monotonic() + min(_CONTEND_S, self.lease.lease_s / 4)  # well before others call it orphaned
        while True:
            self.refresh()
            verdict = self.tally.verdict(trial.number, budget)
            if grid and ATTR_GRID not in self.tally.trial(trial.number).user_attrs:
                verdict = "duplicate"  # no grid point (drivers emptied the queue at once): nothing to run
            if verdict != "contended" or time.monotonic() >= until:
                break
            time.sleep(0.02)
        if verdict == "run":
            try:
                trial.set_user_attr(ATTR_DRIVER, self.lease.id)
            except optuna.exceptions.UpdateFinishedTrialError:
                return False  # another driver closed it meanwhile
            return True
        if verdict == "duplicate":
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                trial.set_user_attr(ATTR_UNUSED, True)
                self.study.tell(trial, state=TrialState.FAIL)
        elif trial.number in self.tally.running:
            self.give_back(trial, admitted=False)
        return False

    def _alone(self, trial: optuna.trial.Trial, budget: int) -> bool:
        """Whether a trial just asked may run without reading the study's trials: no other driver may be
        alive (leases read after the ask: a driver writes its lease before its first ask, so of two
        drivers at least one sees the other's lease, and then reads every trial), the trial stands for
        nothing another trial could stand for too, and the budget, as last read plus this driver's own
        trials since, has room."""
        now = time.monotonic()
        self.watch.update(read_leases(self.study), now)
        frozen = trial.storage.get_trial(trial._trial_id)
        if self.watch.any_other_alive(now) or claims(frozen) or frozen.number in self.tally.running:
            return False
        if self.tally.finished + len(self.tally.running) + 1 > budget:
            return False
        self.tally.note_running(frozen)
        return True

    def give_back(self, trial: optuna.trial.Trial, *, admitted: bool) -> None:
        """Put a trial asked but never run back in the study's queue (WAITING): it does not count, is
        no failure, and the next ``ask`` of any driver (or a resume) runs it with whatever parameters
        it already has. ``admitted``: it carries this driver's mark, which is taken off."""
        try:
            if admitted:
                trial.set_user_attr(ATTR_DRIVER, None)
            # Optuna has no public call for this; its storages (memory, journal, RDB) all accept it.
            trial.storage.set_trial_state_values(trial._trial_id, TrialState.WAITING)
        except optuna.exceptions.UpdateFinishedTrialError:
            pass  # another driver closed it meanwhile

    def interrupt(self, number: int, params: dict[str, Any], user_attrs: dict[str, Any]) -> None:
        """Rerun a trial that will not finish: the rerun is enqueued first, so no reader ever counts the
        interrupted trial, which is then told FAIL (another driver may have done so first: then its
        rerun and this one stand for the same trial, and the later one is closed unrun when asked)."""
        self.study.enqueue_trial(params, user_attrs={**user_attrs, ATTR_REPLACES: number}, skip_if_exists=False)
        try:
            running = self.tally.trial(number).state == TrialState.RUNNING
        except KeyError:  # newer than the last read
            running = True
        if running:
            with contextlib.suppress(optuna.exceptions.UpdateFinishedTrialError):
                self.study.tell(number, state=TrialState.FAIL, skip_if_finished=True)

    def beat_due(self, now: float) -> bool:
        """Whether ``rerun_orphans`` would look at the study at ``now`` (once every beat interval)."""
        return now >= self._next_tick

    def rerun_orphans(self, now: float, mine: set[int],
                      carry_over: Callable[[FrozenTrial, Path | None], dict[str, Any]]) -> None:
        """Every beat interval (nothing in between): rerun the RUNNING trials, not in ``mine``, whose
        driver is dead (``LeaseWatch``). ``carry_over(trial, run_dir)``: the rerun's user attrs, given
        the dead driver's run directory (None: unknown). Trials are read before leases, so a trial seen
        here was asked after its driver wrote its lease."""
        if now < self._next_tick:
            return
        self._next_tick = now + self.lease.beat_s
        if self.lease.failed_beats:  # the storage takes no writes now: judge no one, observe afresh later
            self.watch.forget()
            return
        self.refresh()
        self.watch.update(read_leases(self.study), time.monotonic())
        if not self._reseeded and self.watch.any_other_alive(now):
            self.study.sampler.reseed_rng()
            self._reseeded = True
        running = set(self.tally.running)
        promoted = self.claims.holders("promote:") if self.tally.paused else {}
        for number, t in sorted(self.tally.running.items(), key=lambda kv: kv[0]):
            owner = t.user_attrs.get(ATTR_DRIVER)
            owner = owner if isinstance(owner, str) else None
            if t.user_attrs.get(ATTR_PAUSED) is not None:  # paused by a scheduler: nothing runs it, any driver
                # promotes it from its checkpoint (hpoflow.search.schedulers), unless one claimed it and died
                owner = promoted.get(promotion_key(t))
                if owner is None or not self.watch.dead(owner, now):
                    continue
            if number in mine or owner == self.lease.id or not self.watch.orphaned(number, owner, now, running):
                continue
            info: LeaseInfo | None = self.watch.leases.get(owner or "")
            _log.warning("trial %d was left running by %s, which is gone; rerunning it", number,
                         f"driver {info.label} ({info.run_dir})" if info is not None else "a driver")
            self.interrupt(number, dict(t.params), carry_over(t, Path(info.run_dir) if info is not None else None))
