"""The driver: asks the search for configurations, keeps trials in flight, tells results back.

It keeps ``min(max_concurrent, engine capacity)`` trials running and consumes every event in the
order it happens, so no slot waits for a batch. Ask-ahead (``search.ask_ahead``): while every slot is
busy it asks the sampler for the next trial, so a freed slot gets it at once instead of waiting for a
slow sampler (``auto``: once the median ask takes over 1 % of the median trial). Budgets:
``n_trials`` is exact (finished trials: complete, pruned or failed; a trial interrupted by a stop or a
crash does not count and is rerun with the same parameters), ``timeout`` stops new trials and lets
running ones finish, ``max_failures`` stops the study. Imports neither torch nor pycompss.

Several drivers may share one study (Optuna-style workers, each with its own run directory): the
budget is counted from the storage at every start, and only dead drivers' trials are rerun
(``hpoflow.run.shared``). A driver whose part is done waits for the others' last trials, to rerun
them if their driver dies.

With ``search.scheduler`` (``hpoflow.search.scheduling``), a trial may pause at a rung (it checkpoints
and stops; its slot is free) and a free slot goes first to a paused trial that earned promotion,
resumed from its checkpoint; with ``type: pbt`` (``hpoflow.search.pbt``) each trial is one interval of
a member, resumed from its parent's checkpoint. Ask-ahead is off with a scheduler. A PBT study has one
driver, which claims it before it does anything else; any other driver refuses it (``_own``).

Each attempt after a trial's first (a retry, a promotion, the rerun of an interrupted trial) checkpoints
in a directory of its own, holding what the attempt before it checkpointed (``hpoflow.run.fencing``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import optuna
from optuna.trial import TrialState

from hpoflow.engines.base import Engine
from hpoflow.errors import EngineError
from hpoflow.run.energy import record_run, spent_j, trial_energy
from hpoflow.run.fencing import attempt_dir
from hpoflow.run.lease import WaitStopped
from hpoflow.run.ledger import ATTR_CHECKPOINTS, ATTR_GRID
from hpoflow.run.retry import StorageUnavailable, is_disk_error
from hpoflow.run.rundir import disk_why
from hpoflow.run.shared import SharedStudy
from hpoflow.search.pbt import PbtScheduling, refuse_pbt_study
from hpoflow.search.pruners import TrialObserver
from hpoflow.search.scheduling import Scheduling, carried
from hpoflow.search.space import Grid, suggest
from hpoflow.search.summary import (
    DriverListener,
    DriverSummary,
    constraint_values,
    enqueue_known,
    median_recent,
    objective_values,
    write_result,
)
from hpoflow.spec import StudySpec, parse_constraint, resolve_training
from hpoflow.trial import Event, TrialReport, TrialRequest, TrialResult, Verdict, clip_error

__all__ = ["Driver", "DriverListener", "DriverSummary", "Precheck"]

_log = logging.getLogger("hpoflow")
_J_PER_KWH = 3.6e6
_IDLE_S = 0.25  # how often a driver with nothing in flight looks at the study again


class Precheck(Protocol):
    """Judges a trial before it takes a slot (``hpoflow.oracle.precheck.OraclePrecheck``)."""

    def __call__(self, request: TrialRequest) -> Verdict | None:
        """The verdict on ``request``; None for a trial it does not judge."""

    def interrupt(self) -> None:
        """A stop has begun (maybe in a signal handler: no lock, no wait): start or restart nothing, and
        answer at once from now on."""


@dataclass
class _InFlight:
    trial: optuna.trial.Trial
    request: TrialRequest
    params: dict[str, Any]
    first_attempt: int = 0  # the attempt this run started with (a promoted trial's is above 0)
    reported: set[int] = field(default_factory=set)  # steps told to the study (a retry reports them again)


class Driver:
    """One study's loop. Create it, call ``run()`` once; ``request_stop()`` may come from a signal."""

    def __init__(self, spec: StudySpec, study: optuna.Study, engine: Engine, run_dir: Path,
                 listener: DriverListener | None = None, n_trials: int | None = None,
                 python_path: tuple[str, ...] = (),
                 precheck: Precheck | None = None) -> None:
        self.spec = spec
        self.study = study
        self.engine = engine
        self.run_dir = run_dir
        self.listener = listener
        self.python_path = python_path
        self.precheck = precheck
        names = [n for n, _ in spec.study.objectives] + [parse_constraint(c)[0] for c in spec.study.constraints]
        self._metric_names = tuple(dict.fromkeys(names))  # what a command trial's output is read for
        self._workdir = os.getcwd()  # where a command trial's program runs
        self.grid = Grid(spec.space) if spec.search.algorithm == "grid" else None
        budget = n_trials or spec.search.n_trials
        if self.grid is not None:
            budget = min(budget or self.grid.size, self.grid.size)
        if budget is None:  # the spec guarantees n_trials for non-grid algorithms
            raise ValueError("n_trials is required")
        self.n_trials = budget
        self._stop_reason: str | None = None
        r = spec.resources
        self._probe = TrialRequest.shape(r.processes, r.cpus_per_process, r.gpus_per_process, r.nodes,
                                         memory_gb=r.memory_gb or 0.0)  # the study's trial shape
        self._inflight: dict[int, _InFlight] = {}
        self._failures = 0
        self._energy_j: dict[int, float] = {}  # energy every run of each trial spent, by number (any state)
        pbt = spec.search.scheduler.type == "pbt"
        self.shared = SharedStudy(study, run_dir, spec.search.lease_s, on_finished=self._on_finished, pbt=pbt)
        self.tally = self.shared.tally  # the whole study, every driver's trials, as of the last read
        self.tally.watch(self._energy_seen)  # every trial read anew: paused and interrupted ones spent energy too
        # A pruner that indexes the study (hpoflow.search.pruners) is fed every trial each read of the storage finds
        # changed (other drivers' too; the first read, in ``run``, finds them all), and each trial this driver tells,
        # at once (``_tell``): its ``prune`` then reads no trials, and counts this driver's results before the next read
        self._observer = study.pruner if isinstance(study.pruner, TrialObserver) else None
        if self._observer is not None:
            self.tally.watch(self._observer.observe)
        self._best: float | None = None
        self.summary = DriverSummary(self.n_trials)
        # Ask-ahead (search.ask_ahead): a trial asked while every slot was busy, submitted when one frees
        self._ready: _InFlight | None = None
        self._ask_s: list[float] = []  # seconds each ask (sample + suggest + precheck) took
        self._trial_s: list[float] = []  # durations of finished trials
        self._worth_asking: tuple[tuple[int, int], bool] = ((0, 0), False)  # ask-ahead's verdict, for these lengths
        self.asked_ahead = 0  # trials asked while every slot was busy
        # A sampler whose asks read no result (Optuna's random and QMC samplers, not a subclass, which may): a freed
        # slot is refilled before the finished trial's bookkeeping, with a trial asked then, as ask-ahead does with
        # one asked before (``_start_early``). Never with a scheduler: a freed slot may be a paused trial's.
        self._blind = (type(study.sampler) in (optuna.samplers.RandomSampler, optuna.samplers.QMCSampler)
                       and spec.search.ask_ahead is not False and self.grid is None
                       and not spec.search.scheduler.enabled)
        self.scheduling = Scheduling(spec, study, self.shared) if spec.search.scheduler.enabled and not pbt else None
        self.pbt = PbtScheduling(spec, study, self.shared, run_dir, budget) if pbt else None
        if self.pbt is not None:  # population x intervals at most (hpoflow.search.pbt)
            self.n_trials = self.summary.n_trials = min(budget, self.pbt.budget)

    # -- public ---------------------------------------------------------------------------------
    def request_stop(self, reason: str = "signal") -> None:
        """Stop starting trials and cancel the running ones, or with ``reason="preempted"`` (a walltime
        warning) pause them at their next step with a checkpoint; either way they are rerun on resume.
        A stop restarts nothing: the precheck and the engine are told at once (``interrupt``), so
        neither starts a helper process again nor keeps the loop waiting for one. A signal handler
        calls it."""
        if self._stop_reason is None:
            self._stop_reason = reason
            if self.precheck is not None:
                self.precheck.interrupt()
            self.engine.interrupt()

    def run(self) -> DriverSummary:
        t_start = time.monotonic()
        overhead = 0.0
        summary = self.summary
        deadline = t_start + self.spec.search.timeout if self.spec.search.timeout else None
        probe = self._probe
        capacity = self.engine.capacity(probe)
        if capacity < 1:  # refuse before asking the study for a trial that could never run
            raise EngineError(
                f"the {self.engine.name} engine cannot run a trial of {probe.processes} process(es) x "
                f"{probe.cpus_per_process} CPU(s) x {probe.gpus_per_process} GPU(s) on {probe.nodes} node(s) "
                "here. Fix: lower resources, or use an engine/allocation that has them"
            )
        slots = max(1, min(self.spec.search.max_concurrent, capacity))
        epochs = self.spec.training.get("epochs")  # a placeholder (a searched epoch count): the default's
        per_trial = (self.scheduling.most_runs_per_trial(epochs if isinstance(epochs, int) else 10)
                     if self.scheduling else 1)
        runs = self.n_trials * per_trial
        self.engine.expect_runs(runs, runs * (1 + self.spec.resources.max_retries))
        cancelling = False
        self.shared.lease.start()  # before the first ask: other drivers see this one's trials as alive
        try:
            self._own()
            self._reconcile()
            if self._observer is not None:  # the first read fed it the whole study (if any): it answers from now on
                self._observer.observe([], set())
            enqueue_known(self.study, self.spec.search.enqueue)
            if self.listener:
                self.listener.on_start(self.n_trials, self.tally.finished)
            while True:
                t0 = time.monotonic()
                if deadline is not None and t0 >= deadline and self._stop_reason is None:
                    summary.stopped_by = "timeout"
                    summary.reason = f"search.timeout ({self.spec.search.timeout:g} s) ran out"
                    deadline = None
                if summary.stopped_by == "budget" and self._stop_reason is None and self._energy_spent():
                    summary.stopped_by = "energy_budget"  # no new trial; the running ones finish
                    summary.reason = self._energy_reason()
                if self._stop_reason is not None and not cancelling:
                    cancelling = True
                    # a walltime warning pauses the running trials (a checkpoint at their next step);
                    # any other stop cancels them; either way they are rerun on resume
                    stop = self.engine.pause if self._stop_reason == "preempted" else self.engine.cancel
                    for number in list(self._inflight):
                        stop(number, f"study stopped ({self._stop_reason})")
                self._tick(t0)
                while (not cancelling and summary.stopped_by == "budget" and len(self._inflight) < slots
                       and self._promote()):
                    pass
                while not cancelling and summary.stopped_by == "budget" and self._can_start(slots):
                    started = self._start_one()
                    if started is None:  # another driver's trial took the room first
                        break
                    if not started:
                        summary.stopped_by = "grid_exhausted"
                        break
                if not cancelling and summary.stopped_by == "budget" and self._should_ask_ahead(slots):
                    prepared = self._prepare()  # every slot is busy: ask for the next trial now
                    if prepared is False:
                        summary.stopped_by = "grid_exhausted"
                    elif self._ready is not None:  # (None: the precheck recorded it pruned, or it yielded)
                        self.asked_ahead += 1
                        self.engine.prepare(self._ready.request)
                overhead += time.monotonic() - t0
                if not self._inflight:
                    if (self.scheduling is not None and not cancelling and summary.stopped_by == "budget"
                            and not self._room(1) and not self.scheduling.active()):
                        self.scheduling.close_paused()  # nothing runs or may start, none is promotable
                    if cancelling or summary.stopped_by != "budget" or self._study_over():
                        break
                    time.sleep(_IDLE_S)  # other drivers' trials hold the rest of the budget: rerun them if they die
                    continue
                wait = 0.25 if deadline is None else max(0.0, min(0.25, deadline - time.monotonic()))
                events = self.engine.poll(wait)
                t1 = time.monotonic()
                while events:
                    if (self._ready is not None or self._blind) and not cancelling and summary.stopped_by == "budget":
                        self._start_early(events, slots)
                    for ev in events:
                        if isinstance(ev, TrialReport):
                            self._on_report(ev)
                        else:
                            self._on_result(ev)
                    # Results that came while these were recorded: their slots are refilled now, not after the
                    # next ask ahead (with trials of one length, slots end together, each behind the other's
                    # bookkeeping)
                    events = self.engine.poll(0) if self._blind and any(
                        isinstance(ev, TrialResult) for ev in events) else []
                overhead += time.monotonic() - t1
        except WaitStopped:  # stopped while it waited to see whether another host's driver runs: nothing done
            pass
        except (StorageUnavailable, OSError) as exc:  # the storage stopped answering, or a disk filled
            if not isinstance(exc, StorageUnavailable) and not is_disk_error(exc):
                raise
            self._storage_fault(exc)
        finally:
            if self._inflight:  # an exception escaped: leave nothing running
                for number in list(self._inflight):
                    self.engine.cancel(number, "driver error")
            if self._ready is not None:  # asked ahead, never started: back in the queue, to run on resume
                ready, self._ready = self._ready, None
                with contextlib.suppress(StorageUnavailable, OSError):  # (a storage that is down keeps it
                    self.shared.give_back(ready.trial, admitted=True)  # RUNNING: a resume reruns it)
            with contextlib.suppress(StorageUnavailable, OSError):
                self.shared.lease.end()
        if self._stop_reason != "storage":
            self.shared.refresh()  # the whole study's counts, other drivers' trials included
            summary.n_complete, summary.n_pruned = self.tally.n_complete, self.tally.n_pruned
            summary.n_failed = self.tally.n_failed
        if self._stop_reason is not None:
            summary.stopped_by = self._stop_reason
        elif self.spec.search.max_failures and self._failures >= self.spec.search.max_failures:
            summary.stopped_by = "max_failures"
        summary.elapsed_s = time.monotonic() - t_start
        summary.driver_overhead_s = overhead
        if self.listener:
            self.listener.on_finish(summary)
        return summary

    # -- internals ------------------------------------------------------------------------------
    def _storage_fault(self, exc: OSError | StorageUnavailable) -> None:
        """Stop at once: the storage did not answer within ``storage_retry_s``, or a write found the disk
        full. Running trials are cancelled and, where the storage still answers, recorded interrupted;
        those it cannot record stay RUNNING, and a resume reruns them."""
        self._stop_reason = "storage"
        self.summary.reason = str(exc) if isinstance(exc, StorageUnavailable) else (
            f"cannot write to run directory {self.run_dir}: {disk_why(exc)}; free space, then rerun the same "
            "command to resume")
        stopped = list(self._inflight.values())
        self._inflight = {}
        for fl in stopped:
            self.engine.cancel(fl.trial.number, "study stopped (storage)")
        try:
            for fl in stopped:
                number = fl.trial.number
                self.shared.interrupt(number, fl.params, self._carry_over(number, dict(fl.trial.user_attrs)))
        except (StorageUnavailable, OSError):
            pass

    def _own(self) -> None:
        """Before anything else (its lease just written): a PBT driver claims the study, which has one
        owner (``PbtScheduling.own``); any other driver refuses a study that PBT runs. A stop ends a wait
        there for a driver of another host (``WaitStopped``): then this driver does nothing."""
        def stopping() -> bool:
            return self._stop_reason is not None

        if self.pbt is not None:
            self.pbt.own(stopping)
        else:
            refuse_pbt_study(self.study, self.shared.lease.id, stopping)

    def _reconcile(self) -> None:
        """Start or resume: the study's counts so far, and the trials of dead drivers rerun."""
        for t in self.shared.refresh():  # every finished trial that counts, at the first read
            if t.state == TrialState.FAIL:
                self.summary.note_error(t.user_attrs.get("error"))
        s, tally = self.summary, self.tally
        s.n_complete, s.n_pruned, s.n_failed = tally.n_complete, tally.n_pruned, tally.n_failed
        self._tick(time.monotonic())

    def _on_finished(self, t: optuna.trial.FrozenTrial) -> None:
        """A trial of the study finished (this driver's or another's), seen in a read of the storage."""
        if t.state == TrialState.COMPLETE and t.values is not None and len(t.values) == 1:
            self._update_best(t.values[0])
        if t.state == TrialState.FAIL:
            self._failures = max(self._failures, self.tally.n_failed)
        self._note_energy(t.number, spent_j(t.user_attrs))

    def _energy_seen(self, changed: list[optuna.trial.FrozenTrial], _gone: set[int]) -> None:
        for t in changed:
            self._note_energy(t.number, spent_j(t.user_attrs))

    def _note_energy(self, number: int, joules: float | None) -> None:
        """Count what a trial's runs spent so far (``hpoflow.run.energy``: paused segments, retried attempts,
        cancelled runs, any driver's) against ``search.energy_budget_kwh``."""
        if joules is not None and math.isfinite(joules):
            self._energy_j[number] = max(self._energy_j.get(number, 0.0), joules)

    def _energy_spent(self, more_j: float = 0.0) -> bool:
        """Whether the finished trials' energy (plus ``more_j``) reached ``search.energy_budget_kwh``."""
        kwh = self.spec.search.energy_budget_kwh
        return kwh is not None and sum(self._energy_j.values()) + more_j >= kwh * _J_PER_KWH

    def _energy_reason(self) -> str:
        kwh = self.spec.search.energy_budget_kwh or 0.0
        spent = sum(self._energy_j.values())
        return (f"search.energy_budget_kwh ({kwh:g} kWh) is spent: the runs of {len(self._energy_j)} trial(s) with "
                f"a measured energy (paused, retried and cancelled runs included) used {spent / _J_PER_KWH:.6g} kWh "
                f"({spent:.6g} J); no new trial was started, "
                "the running ones finished. Fix: raise search.energy_budget_kwh and rerun the same command to go on")

    def _tick(self, now: float) -> None:
        """Every beat interval: rerun the RUNNING trials of drivers found dead (``SharedStudy``), from
        their run directory's checkpoints if this host can read them."""
        if not self.shared.beat_due(now):
            return  # (nothing to do between beats; the trials in flight are not gathered every event)
        mine = {*self._inflight, *([self._ready.trial.number] if self._ready is not None else [])}
        self.shared.rerun_orphans(now, mine, lambda t, rd: self._carry_over(t.number, t.user_attrs, rd))

    def _carry_over(self, number: int, user_attrs: dict[str, Any], run_dir: Path | None = None) -> dict[str, Any]:
        """User attrs for the rerun of an interrupted trial: its grid point, and the checkpoint
        directory it was writing to (kept from the first trial of a chain of reruns; ``run_dir``: the
        run directory of the driver that ran it)."""
        attrs = {k: v for k, v in user_attrs.items() if k in (ATTR_GRID, ATTR_CHECKPOINTS)}
        attrs.update(carried(user_attrs))
        trial_dir = (run_dir or self.run_dir) / "trials" / str(number)
        attrs.setdefault(ATTR_CHECKPOINTS, str(trial_dir / "checkpoints"))
        return attrs

    def _room(self, more: int) -> bool:
        """Whether the budget (``n_trials``, ``max_failures``) allows ``more`` trials beyond those finished
        and in flight in the whole study (every driver's, as of the last read)."""
        if not self.shared.room(more, self.n_trials):
            return False
        mf = self.spec.search.max_failures
        return not (mf is not None and self._failures >= mf)

    def _study_over(self) -> bool:
        """Nothing of this driver's is in flight and it may start nothing: is the study over, or do
        other drivers' trials hold the rest of the budget?"""
        self.shared.refresh()
        mf = self.spec.search.max_failures
        return (self.tally.finished >= self.n_trials or (mf is not None and self._failures >= mf)
                or (self.pbt is not None and self.pbt.over()))

    def _can_start(self, slots: int) -> bool:
        # a trial asked ahead is within the budget already
        return (len(self._inflight) < slots and self._room(0 if self._ready is not None else 1)
                and (self.pbt is None or self.pbt.may_ask()))  # pbt: a new member or an interval due

    def _should_ask_ahead(self, slots: int) -> bool:
        """Every slot busy, budget left, nothing asked ahead yet, and asking is worth hiding: always with
        ``ask_ahead: true``; with ``auto`` once the median ask took over 1 % of the median trial."""
        mode = self.spec.search.ask_ahead
        if (mode is False or self.scheduling is not None or self.pbt is not None or self._ready is not None
                or len(self._inflight) < slots or not self._room(1)):
            return False
        if mode is True:
            return True
        if slots < 2 or not self._ask_s or not self._trial_s:  # one slot: keep sequential search sequential
            return False
        seen = (len(self._ask_s), len(self._trial_s))
        if self._worth_asking[0] != seen:  # (judged again when a new ask or trial time came, not every event)
            self._worth_asking = (seen, median_recent(self._ask_s) > 0.01 * median_recent(self._trial_s))
        return self._worth_asking[1]

    def _update_best(self, value: float | None) -> None:
        if value is not None and (self._best is None or (
                value > self._best if self.spec.study.direction == "maximize" else value < self._best)):
            self._best = value

    def _start_one(self) -> bool | None:
        """Submit the trial asked ahead, or ask for one and submit it; False when the grid is exhausted,
        None when the trial asked went back to the queue (``_admit``)."""
        if self._ready is None:
            prepared = self._prepare()
            if not prepared:
                return prepared
        ready, self._ready = self._ready, None
        if ready is not None:  # None: the precheck recorded it as pruned already
            self._inflight[ready.trial.number] = ready
            if self.listener:
                self.listener.on_trial_start(ready.trial.number, ready.params)
            self.engine.submit(ready.request)
        return True

    def _prepare(self) -> bool | None:
        """Ask the study for the next trial and build its request into ``_ready`` (or record it pruned
        when the oracle says it cannot fit); False when the grid is exhausted, None when the trial asked
        may not run now (``_admit``)."""
        t_ask = time.monotonic()
        if self.grid is not None:  # each ask brings its own point to the queue, so no ask finds it empty
            idx = self.shared.next_grid_index(self.grid.size)
            if idx is not None:
                self.study.enqueue_trial(self.grid.point(idx), user_attrs={ATTR_GRID: idx})
            elif not self.tally.waiting:
                return None if self.shared.others_running(set(self._inflight)) else False
        trial = self.study.ask()
        if not self.shared.admit(trial, self.n_trials, grid=self.grid is not None):
            return None
        params = suggest(trial, self.spec.space)
        if self.pbt is not None:  # its member and interval; its checkpoints copied from its parent's
            self.pbt.adopt(trial, resolve_training(self.spec.training, params).seed)
        request = self._request(trial, params)
        fl = _InFlight(trial, request, params)
        verdict = self.precheck(request) if self.precheck else None
        self._ask_s.append(time.monotonic() - t_ask)
        if verdict is not None:
            if verdict.predicted:
                trial.set_user_attr("oracle", verdict.summary())
            if not verdict.feasible:  # recorded as pruned, with the numbers, without taking a slot
                self._inflight[trial.number] = fl
                if self.listener:
                    self.listener.on_trial_start(trial.number, params)
                self._on_result(TrialResult(trial.number, "pruned", error=f"oracle: {verdict.reason}"))
                return True
        self._ready = fl
        return True

    def _request(self, trial: optuna.trial.Trial, params: dict[str, Any], attempt: int = 0) -> TrialRequest:
        """What the engine runs for ``trial``: its training config, resources and checkpoint directory."""
        train = resolve_training(self.spec.training, params)
        if self.pbt is not None:
            train = self.pbt.configure(trial, train)
        r = self.spec.resources
        return TrialRequest(
            number=trial.number, params=params, train=train.model_dump(mode="json"),
            metric=self.spec.study.metric, direction=self.spec.study.direction,
            trial_dir=str(self.run_dir / "trials" / str(trial.number)),
            processes=r.processes, cpus_per_process=r.cpus_per_process,
            gpus_per_process=r.gpus_per_process, nodes=r.nodes, timeout=r.timeout, memory_gb=r.memory_gb or 0.0,
            pruning=self.spec.search.pruner.type != "none" or self.scheduling is not None,
            python_path=self.python_path, attempt=attempt,
            seed=train.seed, checkpoint_dir=self._checkpoint_dir(trial.number, trial.user_attrs, attempt),
            elastic_sizes=r.elastic_sizes(train.batch_size if train.builtin else None),
            elastic_policy=r.elastic.policy if r.elastic is not None else "longest_remaining",
            plugins=tuple(self.spec.plugins), metric_names=self._metric_names, workdir=self._workdir,
        )

    def _checkpoint_dir(self, number: int, user_attrs: dict[str, Any], attempt: int) -> str:
        """Where this attempt of trial ``number`` checkpoints, made ready (``hpoflow.run.fencing``): its
        chain's root (its own trial directory's ``checkpoints``, ``""``, unless it inherited one) for the
        chain's first attempt, else a directory of its own holding the newest older attempt's checkpoints."""
        trial_dir = self.run_dir / "trials" / str(number)
        root = Path(user_attrs.get(ATTR_CHECKPOINTS) or trial_dir / "checkpoints")
        path = attempt_dir(root, trial_dir, number, attempt)
        return str(path) if ATTR_CHECKPOINTS in user_attrs or path != root else ""

    def _promote(self) -> bool:
        """Resume a paused trial that earned promotion (``search.scheduler``) from its checkpoint, in a
        free slot; False if there is none."""
        if self.scheduling is None:
            return False
        picked = self.scheduling.promotion(set(self._inflight))
        if picked is None:
            return False
        trial, attempt = picked
        params = suggest(trial, self.spec.space)  # the values it has: nothing is sampled again
        fl = _InFlight(trial, self._request(trial, params, attempt), params, first_attempt=attempt)
        self._inflight[trial.number] = fl
        self.engine.submit(fl.request)
        return True

    def _on_report(self, ev: TrialReport) -> None:
        fl = self._inflight.get(ev.number)
        if fl is None:
            return
        if self.listener:
            self.listener.on_trial_report(ev.number, ev.step, ev.metrics)
        value = ev.metrics.get(self.spec.study.metric)
        prune = False
        if value is not None and math.isfinite(value):
            try:
                if ev.step not in fl.reported:  # Optuna keeps a step's first value, and warns at a second
                    fl.trial.report(value, ev.step)
                    fl.reported.add(ev.step)
            except (NotImplementedError, ValueError):  # multi-objective or a repeated step
                pass
            except optuna.exceptions.UpdateFinishedTrialError:
                self._taken_over(fl)
                prune = True
            if ev.wants_answer and not prune:
                prune = fl.trial.should_prune()
        if ev.wants_answer:
            if self.scheduling is not None and not prune and value is not None and \
                    self.scheduling.at_report(fl.trial, fl.request, ev.step, value):
                self.engine.answer(ev.number, False, pause=True)  # checkpoint here and stop: promoted later
                return
            self.engine.answer(ev.number, prune)

    def _taken_over(self, fl: _InFlight) -> None:
        """Another driver finished this driver's running trial (it judged this one dead: no beat for
        ``search.lease_s``): stop it here and leave the study's record as the other driver wrote it."""
        if self._inflight.pop(fl.trial.number, None) is not None:
            _log.warning("trial %d was finished by another driver (this one did not beat for search.lease_s); "
                         "stopping it here", fl.trial.number)
            self.engine.cancel(fl.trial.number, "taken over by another driver")

    def _start_early(self, events: list[Event], slots: int) -> None:
        """Results that free slots: submit the trial asked ahead (with a blind sampler, a trial asked now for
        each freed slot) before the finished trials' bookkeeping (their storage writes, one of them fsynced,
        and their result files), so a slot does not idle through it. Only for complete and pruned results: a
        failure may be retried in its slot, or stop the study (``max_failures``), and a pause is the
        scheduler's (which asks nothing ahead)."""
        freed = sum(1 for ev in events if isinstance(ev, TrialResult) and ev.number in self._inflight
                    and ev.status in ("complete", "pruned"))
        ending_j = sum(float(ev.system.get("energy_j", 0.0)) for ev in events if isinstance(ev, TrialResult)
                       and ev.number in self._inflight)
        if not freed or self._energy_spent(ending_j):
            return
        for _ in range(freed if self._blind else 1):  # a blind sampler's ask needs no result: one per freed slot
            if (len(self._inflight) - freed >= slots or not self._room(0 if self._ready is not None else 1)
                    or (self._ready is None and not self._blind) or self._start_one() is not True):
                return

    def _on_result(self, res: TrialResult) -> None:
        fl = self._inflight.get(res.number)
        if fl is None:
            return
        mr = self.spec.resources.max_retries
        if res.status == "failed" and res.retryable and self.engine.capacity(self._probe) < 1:
            res = self._out_of_room(res)
        if (res.status == "failed" and res.retryable and fl.request.attempt - fl.first_attempt < mr
                and self._stop_reason is None):
            attempt = fl.request.attempt + 1
            retry = replace(fl.request, attempt=attempt,
                            checkpoint_dir=self._checkpoint_dir(res.number, fl.trial.user_attrs, attempt))
            fl.request = retry
            fl.trial.set_user_attr("attempts", retry.attempt + 1)
            self._note_energy(res.number, record_run(fl.trial, res.system))  # the failed attempt's, in the budget
            self.engine.submit(retry)
            return
        del self._inflight[res.number]
        if self.scheduling is not None and self.scheduling.paused(fl.trial, fl.request, res):
            self._note_energy(res.number, record_run(fl.trial, res.system))  # the segment's, in the budget
            return  # paused at a rung with a checkpoint: RUNNING in the study, holding no slot
        if "duration_s" in res.timings and res.status in ("complete", "pruned"):  # failures are no guide
            self._trial_s.append(float(res.timings["duration_s"]))
        try:
            self._tell(fl, res)
        except optuna.exceptions.UpdateFinishedTrialError:
            _log.warning("trial %d was finished by another driver (this one did not beat for search.lease_s); "
                         "its result here is in %s only", res.number, fl.request.trial_dir)

    def _out_of_room(self, res: TrialResult) -> TrialResult:
        """A trial the system killed (its node failed) when the engine can no longer run a trial of this
        shape (the nodes left are too few): recorded interrupted, its retries kept, and the study stops;
        a resume where it fits reruns it from its checkpoint."""
        if self._stop_reason is None:
            p = self._probe
            self.summary.reason = (
                f"the {self.engine.name} engine can no longer run a trial of {p.nodes} node(s) x {p.processes} "
                f"process(es) (trial {res.number}: {(res.error or 'killed').splitlines()[0][:200]}); its trials are "
                "interrupted, to rerun from their checkpoints: rerun the same command where they fit (more nodes)")
            self.request_stop("capacity")
        return replace(res, status="cancelled", error=f"interrupted: {res.error or 'killed'}")

    def _tell(self, fl: _InFlight, res: TrialResult) -> None:
        """Record a finished trial in the study (and its result file), and count it."""
        trial = fl.trial
        res = replace(res, system=trial_energy(res.system, trial.user_attrs))  # summed over its segments
        values, missing = objective_values(self.spec, res)
        if res.status == "complete" and missing:
            res = replace(res, status="failed", error=missing)
        trial.set_user_attr("metrics", res.metrics)
        trial.set_user_attr("timings", {k: round(v, 4) for k, v in res.timings.items()})
        if res.system:
            trial.set_user_attr("system", res.system)
        if res.error:
            trial.set_user_attr("error", clip_error(res.error))  # its first line and its cause at the end
        if not self._write_result(fl.request, res) and res.status == "failed":
            res = replace(res, status="cancelled")  # the disk filled under it: rerun it on resume, uncounted
        self._note_energy(trial.number, spent_j({"system": res.system}))  # a cancelled run's too
        if res.status == "cancelled":
            self.shared.interrupt(trial.number, fl.params, self._carry_over(trial.number, dict(trial.user_attrs)))
            return
        summary = self.summary
        for key, violation in constraint_values(self.spec, res).items():
            trial.set_constraint(key, violation)
        if res.status == "complete" and values is not None:
            self.study.tell(trial, values if len(values) > 1 else values[0])
            self._update_best(values[0] if len(values) == 1 else None)
            summary.n_complete += 1
        elif res.status == "pruned":
            self.study.tell(trial, state=TrialState.PRUNED)
            summary.n_pruned += 1
        else:
            self.study.tell(trial, state=TrialState.FAIL)
            self._failures += 1
            summary.n_failed += 1
            summary.note_error(res.error)
            self._check_fail_fast()
        if self._observer is not None:  # the record as told (one trial: O(1) from the journal and Optuna's storages)
            self._observer.observe([self.study._storage.get_trial(trial._trial_id)], set())
        summary.results.append(res)
        if self.listener:
            self.listener.on_trial_end(res, fl.params, self._best)

    def _check_fail_fast(self) -> None:
        """Stop when the study's first ``search.fail_fast`` finished trials all failed with one error."""
        if self.summary.fail_fast(self.spec.search.fail_fast):
            self.request_stop("fail_fast")

    def _write_result(self, request: TrialRequest, res: TrialResult) -> bool:
        """Write the trial's result.json (``write_result``); False (and the study stops) when the disk is full."""
        try:
            write_result(request, res)
        except OSError as exc:
            if not is_disk_error(exc):
                raise
            if self._stop_reason is None:
                self.summary.reason = (f"cannot write to run directory {self.run_dir}: {disk_why(exc)}; free space, "
                                       "then rerun the same command to resume")
                self.request_stop("storage")
            return False
        return True
