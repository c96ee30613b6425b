"""The trial-attribute ledger: what hpoflow writes on a trial beside Optuna's own fields, and which
trials count against ``n_trials``.

An interrupted trial (a stop signal, a crashed driver, a cancel) is rerun as a new trial whose user
attr ``ATTR_REPLACES`` holds its number (enqueued before the interrupted one is told FAIL, so no reader
ever counts it): the interrupted one does not count. Trials imported by a warm start
(``ATTR_IMPORTED``) and duplicates closed without running (``ATTR_UNUSED``) do not count either. The
driver, the report and ``status`` all count through ``is_counted``.

``Tally`` is the driver's view of the whole study, shared by every driver on the storage: the trials
that count, the ones in flight, and who holds which grid point or rerun. ``Tally.verdict`` decides
whether a trial just asked may run (see its docstring for why the budget stays exact across drivers).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Literal

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.feed import TrialFeed

__all__ = ["ATTR_BRACKET", "ATTR_CHECKPOINTS", "ATTR_DRIVER", "ATTR_ENQUEUED", "ATTR_GRID", "ATTR_IMPORTED",
           "ATTR_LINEAGE", "ATTR_NEXT_ATTEMPT", "ATTR_PAUSED", "ATTR_REPLACES", "ATTR_RUNGS", "ATTR_SEGMENTS",
           "ATTR_UNUSED", "FINISHED", "Tally", "Verdict", "claims", "count_finished", "interrupted", "is_counted",
           "reruns"]

ATTR_REPLACES = "hpoflow_replaces"  # user attr: the number of the interrupted trial this one reruns
_LEGACY_INTERRUPTED = "hpoflow_interrupted"  # system attr of runs written before ATTR_REPLACES
ATTR_GRID = "grid_index"  # user attr: the trial's point of an exact grid
ATTR_ENQUEUED = "hpoflow_enqueued"  # user attr: index in search.enqueue of a known configuration
ATTR_IMPORTED = "hpoflow_warm_start"  # user attr: a completed trial imported from another study (a prior)
ATTR_UNUSED = "hpoflow_asked_unused"  # user attr: closed without running (a duplicate, see Tally.verdict): not counted
ATTR_CHECKPOINTS = "checkpoint_dir"  # user attr: a rerun resumes from the replaced trial's checkpoints
ATTR_DRIVER = "hpoflow_driver"  # user attr: the id of the driver running the trial (hpoflow.run.lease)
# Schedulers that pause and resume trials (hpoflow.search.schedulers; docs/schedulers.md). A paused
# trial stays RUNNING in the storage (it counts in flight against n_trials, holds no slot, and is no
# dead driver's trial: any driver of the study may promote it); finished, the attr keeps its last pause.
ATTR_PAUSED = "hpoflow_paused"  # user attr: the step (rung) the trial is paused at; None while it runs
ATTR_RUNGS = "hpoflow_rungs"  # user attr: {step: value} the trial reported at each rung it reached
ATTR_BRACKET = "hpoflow_bracket"  # user attr: the trial's Hyperband bracket (0 for ASHA)
ATTR_NEXT_ATTEMPT = "hpoflow_next_attempt"  # user attr: the attempt number its next run (a promotion) takes
# user attr of a PBT interval trial (hpoflow.search.pbt): {member, interval, parent, donor, start, end, seed}
ATTR_LINEAGE = "hpoflow_lineage"
ATTR_SEGMENTS = "hpoflow_segments"  # user attr: [{start, end, step, outcome}] of its runs that paused
FINISHED = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL)


def reruns(trials: list[FrozenTrial]) -> dict[int, int | None]:
    """Each trial that was interrupted and rerun -> the number of the trial that reran it (None for a
    run written before ``ATTR_REPLACES``), by number. A rerun interrupted in turn is a link of its own
    (0 -> 4 -> 7: ``{0: 4, 4: 7}``)."""
    out: dict[int, int | None] = {t.number: None for t in trials if t.system_attrs.get(_LEGACY_INTERRUPTED)}
    for t in trials:  # by number: where two trials name one (cannot happen: Tally.verdict), the first
        if ATTR_REPLACES in t.user_attrs and out.get(int(t.user_attrs[ATTR_REPLACES])) is None:
            out[int(t.user_attrs[ATTR_REPLACES])] = t.number
    return dict(sorted(out.items()))


def interrupted(trials: list[FrozenTrial]) -> set[int]:
    """Numbers of the trials that were interrupted and rerun (they do not count)."""
    return set(reruns(trials))


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


Verdict = Literal["run", "duplicate", "yield", "contended"]


def claims(t: FrozenTrial) -> list[tuple[str, int]]:
    """What a trial stands for, that only one trial of the study may run: a grid point, the rerun of
    an interrupted trial, a configuration of ``search.enqueue``."""
    out = []
    for key, attr in (("grid", ATTR_GRID), ("rerun", ATTR_REPLACES), ("enqueued", ATTR_ENQUEUED)):
        value = t.user_attrs.get(attr)
        if isinstance(value, int) and not isinstance(value, bool):
            out.append((key, value))
    return out


class Tally:
    """The whole study as the driver needs it, from the storage, updated incrementally.

    ``refresh(study)`` reads the trials once (``get_trials(deepcopy=False)``) and looks only at trials
    new since the last refresh and at those not finished then: a finished trial never changes. Of
    those, a trial whose record is the very object of the last read is unchanged (Optuna's journal
    and in-memory storages replace a trial's record when they change it), so a refresh costs one
    list from Optuna plus a pointer comparison per trial in flight, and work only for what changed.
    Where the storage says which records changed (hpoflow's journal: ``hpoflow.run.feed``), only those
    are looked at, not every trial in flight.
    After a refresh: ``finished`` (the trials that count against ``n_trials``), ``n_complete``,
    ``n_pruned``, ``n_failed``, ``running``, ``waiting`` and ``paused`` (by number, every driver's),
    ``grid_claimed`` (grid indices some trial stands for).

    ``watch(fn)``: ``fn(changed, gone)`` after every refresh, for indexes kept beside the tally (a
    scheduler's rungs, PBT's population): ``changed``, by number, the trials new since the last
    refresh and those unfinished then whose record changed since (a report too); ``gone``, the
    numbers of trials found interrupted and rerun since (they stand for nothing any more:
    ``interrupted``).
    """

    def __init__(self) -> None:
        self._trials: list[FrozenTrial] = []
        self._seen = 0  # trials looked at: numbers below this
        self._open: dict[int, FrozenTrial | None] = {}  # seen unfinished -> its record at the last read
        self._fresh: set[int] = set()  # those of them whose record no read has shown yet
        self._feed = TrialFeed()
        self._replaced: set[int] = set()
        self._counted: dict[int, TrialState] = {}  # finished trials that count
        self._by_state: Counter[TrialState] = Counter()
        self._holders: dict[tuple[str, int], list[int]] = {}
        self._paused: dict[int, FrozenTrial] = {}
        self._watchers: list[Callable[[list[FrozenTrial], set[int]], None]] = []
        self.running: dict[int, FrozenTrial] = {}
        self.waiting: dict[int, FrozenTrial] = {}
        self.grid_claimed: set[int] = set()

    @property
    def finished(self) -> int:
        return len(self._counted)

    @property
    def trials(self) -> list[FrozenTrial]:
        """Every trial of the study as of the last refresh."""
        return self._trials

    @property
    def paused(self) -> dict[int, FrozenTrial]:
        """The RUNNING trials a scheduler paused (no process runs them), by number."""
        return dict(sorted(self._paused.items()))

    @property
    def n_complete(self) -> int:
        return self._by_state[TrialState.COMPLETE]

    @property
    def n_pruned(self) -> int:
        return self._by_state[TrialState.PRUNED]

    @property
    def n_failed(self) -> int:
        return self._by_state[TrialState.FAIL]

    def trial(self, number: int) -> FrozenTrial:
        """The trial ``number`` as of the last refresh (``KeyError`` if it was not there)."""
        if 0 <= number < len(self._trials) and self._trials[number].number == number:
            return self._trials[number]  # Optuna numbers a study's trials 0, 1, 2, ... in creation order
        for t in self._trials:
            if t.number == number:
                return t
        raise KeyError(number)

    def watch(self, fn: Callable[[list[FrozenTrial], set[int]], None]) -> None:
        """Call ``fn(changed, gone)`` after every refresh (class docstring); at once with every trial read
        so far, when there was a refresh already."""
        self._watchers.append(fn)
        if self._trials:
            fn(list(self._trials), set(self._replaced))

    def refresh(self, study: optuna.Study) -> list[FrozenTrial]:
        """Read the study; returns the trials that finished (and count) since the last refresh."""
        trials, touched = self._feed.read(study)
        self._trials = trials
        gone: set[int] = set()
        for t in trials[self._seen:]:
            if t.number not in self._open:
                self._open[t.number] = None
                self._fresh.add(t.number)
            for key in claims(t):
                self._holders.setdefault(key, []).append(t.number)
            if ATTR_GRID in t.user_attrs and ATTR_UNUSED not in t.user_attrs:
                self.grid_claimed.add(int(t.user_attrs[ATTR_GRID]))
            if ATTR_REPLACES in t.user_attrs:
                self._replace(int(t.user_attrs[ATTR_REPLACES]), gone)
            if t.system_attrs.get(_LEGACY_INTERRUPTED):
                self._replace(t.number, gone)
        self._seen = max(self._seen, len(trials))
        done: list[FrozenTrial] = []
        changed: list[FrozenTrial] = []
        size = len(trials)
        # (trials[number] is trial ``number`` in Optuna's numbering; a record that is the one of the last
        # read is that trial's, unchanged: only the others are looked at, through ``trial``. Where the storage
        # says which records changed since the last read, those are the ones looked at, and the trials no
        # read has shown yet: hpoflow.run.feed)
        if touched is None:
            moved = [number for number, last in self._open.items() if number >= size or trials[number] is not last]
        else:
            moved = sorted(self._fresh.union(n for n in touched if n in self._open))
        for number in moved:
            last = self._open[number]
            try:
                t = self.trial(number)
            except KeyError:  # (noted running, not in this read)
                continue
            self._fresh.discard(number)
            if t is last:
                continue
            changed.append(t)  # (not compared with ``last``: an ``optuna.Trial`` updates the record it read in place)
            self.running.pop(number, None)
            self.waiting.pop(number, None)
            self._paused.pop(number, None)
            if t.state == TrialState.RUNNING:
                self._open[number] = self.running[number] = t
                if t.user_attrs.get(ATTR_PAUSED) is not None:
                    self._paused[number] = t
            elif t.state == TrialState.WAITING:
                self._open[number] = self.waiting[number] = t
            else:
                del self._open[number]
                if self._counts(t):
                    self._counted[number] = t.state
                    self._by_state[t.state] += 1
                    done.append(t)
        if self._watchers and (changed or gone):
            changed.sort(key=lambda t: t.number)
            for fn in self._watchers:
                fn(changed, gone)
        done.sort(key=lambda t: t.number)
        return done

    def _replace(self, old: int, gone: set[int]) -> None:
        """Trial ``old`` was interrupted and rerun: it counts no more."""
        if old in self._replaced:
            return
        self._replaced.add(old)
        gone.add(old)
        state = self._counted.pop(old, None)
        if state is not None:  # counted before its rerun appeared (runs written before this order)
            self._by_state[state] -= 1

    def note_running(self, t: FrozenTrial) -> None:
        """This driver runs ``t`` (asked since the last refresh): counted in flight until the next refresh
        reads it. A trial of this driver that finished since is still in ``running`` then, so
        ``finished + len(running)`` stays right for a driver alone on the study."""
        self.waiting.pop(t.number, None)
        self.running[t.number] = t
        if t.number not in self._open:
            self._open[t.number] = None
            self._fresh.add(t.number)

    def _counts(self, t: FrozenTrial) -> bool:
        return (t.number not in self._replaced and ATTR_IMPORTED not in t.user_attrs
                and ATTR_UNUSED not in t.user_attrs)

    def verdict(self, number: int, budget: int) -> Verdict:
        """May the trial ``number``, just asked (RUNNING, no ``ATTR_DRIVER`` yet), run within ``budget``?

        ``run``: yes; ``duplicate``: another trial stands for the same grid point, rerun or known
        configuration and has run or is running (close this one uncounted); ``yield``: not now (put it
        back in the queue); ``contended``: it depends on other trials being decided right now, and this
        one is the lowest-numbered of them (look again in a moment; the others yield to it).

        Why the budget stays exact with several drivers: a trial runs only if, in a read made after it
        became RUNNING, the finished trials plus every RUNNING trial (decided or not, any driver's,
        itself included) fit the budget. Of two trials asked at once, each became RUNNING before its
        own read, so at least one of the reads sees both: they cannot both pass unless both fit. A
        trial that does not pass yields (back to WAITING, nothing counted), unless only undecided
        trials stand in its way and it is the lowest-numbered: then it waits for them to yield.
        """
        undecided = [n for n, t in self.running.items() if n != number and not t.user_attrs.get(ATTR_DRIVER)]
        contended = False
        if number not in self.running:
            return "yield"  # closed or put back by another driver meanwhile: nothing to run
        for key in claims(self.trial(number)):
            for j in self._holders.get(key, []):
                if j == number:
                    continue
                t = self.trial(j)
                if not self._counts(t):
                    continue
                if t.state in FINISHED or (t.state == TrialState.RUNNING and t.user_attrs.get(ATTR_DRIVER)):
                    return "duplicate"
                if t.state == TrialState.RUNNING:
                    contended = True
                elif t.state == TrialState.WAITING and j < number:
                    return "yield"  # the older copy goes first
        decided = len(self.running) - len(undecided) - 1
        if self.finished + decided + 1 > budget:
            return "yield"
        if not contended and self.finished + len(self.running) <= budget:
            return "run"
        return "contended" if all(n > number for n in undecided) else "yield"

