"""PBT's population as the study holds it (``hpoflow.search.pbt``), kept up to date from the trials that change.

A long PBT study holds thousands of interval trials; the driver asks what is due after every interval
that ends. ``Population`` answers from an index updated with the trials new or changed since the
driver's last read (``hpoflow.run.ledger.Tally.watch``), so an answer costs what changed, not a pass
over every trial:

- the interval trials (``ATTR_LINEAGE``), not interrupted and rerun nor closed unused, by member;
- ``exists``: the (member, interval) pairs the study holds, whatever their state;
- per member its latest finished interval (``latest``) and its latest complete one with a value
  (``best``): the highest interval, the lowest number among equals;
- ``due``: the members whose latest finished interval has no next one yet and ends before the study's
  epochs (those ``PbtScheduling.sync`` enqueues the next interval of);
- ``ranking``: the members whose ``best`` has epochs left (a donor must), best value first (then the
  lower member), the order ``PbtPolicy.split`` cuts its top and bottom from.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter

from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.ledger import ATTR_LINEAGE, ATTR_UNUSED, FINISHED

__all__ = ["Population"]


class Population:
    """The interval trials of a PBT study of ``epochs`` epochs (module docstring). ``maximize``: the
    direction ``ranking`` orders values in."""

    def __init__(self, epochs: int, maximize: bool) -> None:
        self.epochs = epochs
        self.maximize = maximize
        self.exists: Counter[tuple[int, int]] = Counter()
        self.latest: dict[int, FrozenTrial] = {}
        self.best: dict[int, FrozenTrial] = {}
        self.due: set[int] = set()
        self.ranking: list[tuple[float, int]] = []  # (rank key: the value, negated when maximizing; member)
        self._of: dict[int, dict[int, FrozenTrial]] = {}  # member -> its interval trials, by number
        self._member: dict[int, tuple[int, int, int]] = {}  # trial number -> (member, interval, end epoch)
        self._ranked: dict[int, tuple[float, int]] = {}  # member -> its entry in ranking
        self._gone: set[int] = set()

    @property
    def members(self) -> set[int]:
        """The members with at least one interval in the study."""
        return set(self._of)

    @property
    def n_members(self) -> int:
        return len(self._of)

    def __contains__(self, number: object) -> bool:
        """Whether trial ``number`` is one of the population's interval trials."""
        return number in self._member

    def trials(self) -> list[FrozenTrial]:
        """Every interval trial, as of the read that last found it changed, by number."""
        return sorted((t for ts in self._of.values() for t in ts.values()), key=lambda t: t.number)

    def update(self, changed: list[FrozenTrial], gone: set[int]) -> None:
        """Take in the trials new or changed since the last update, and those interrupted and rerun."""
        touched: set[int] = set()
        stale: set[int] = set()  # members whose latest or best interval left: judged from all their intervals
        for n in gone:
            self._gone.add(n)
            self._drop(n, touched, stale)
        for t in changed:
            self._drop(t.number, touched, stale)
            lin = t.user_attrs.get(ATTR_LINEAGE)
            if isinstance(lin, dict) and t.number not in self._gone and ATTR_UNUSED not in t.user_attrs:
                m, i = int(lin["member"]), int(lin["interval"])
                self._of.setdefault(m, {})[t.number] = t
                self._member[t.number] = (m, i, int(lin["end"]))
                self.exists[(m, i)] += 1
                touched.add(m)
                self._consider(m, t)
        for m in stale:
            self.latest.pop(m, None)
            self.best.pop(m, None)
            for t in self._of.get(m, {}).values():
                self._consider(m, t)
        for m in touched:
            self._settle(m)

    # -- internals --------------------------------------------------------------------------------
    def _drop(self, number: int, touched: set[int], stale: set[int]) -> None:
        at = self._member.pop(number, None)
        if at is None:
            return
        m, i, _ = at
        del self._of[m][number]
        if not self._of[m]:
            del self._of[m]
        self.exists[(m, i)] -= 1
        if not self.exists[(m, i)]:
            del self.exists[(m, i)]
        touched.add(m)
        if any(t.number == number for t in (self.latest.get(m), self.best.get(m)) if t is not None):
            stale.add(m)

    def _later(self, t: FrozenTrial, than: FrozenTrial | None) -> bool:
        """Whether interval trial ``t`` comes after ``than``: a higher interval, or the same with a lower number."""
        return than is None or (self._member[t.number][1], -t.number) > (self._member[than.number][1], -than.number)

    def _consider(self, m: int, t: FrozenTrial) -> None:
        """Interval trial ``t`` of member ``m`` as its latest and best."""
        if t.state not in FINISHED:
            return
        if self._later(t, self.latest.get(m)):
            self.latest[m] = t
        if t.state == TrialState.COMPLETE and t.value is not None and self._later(t, self.best.get(m)):
            self.best[m] = t

    def _settle(self, m: int) -> None:
        """Member ``m``'s place in ``due`` and ``ranking``, from its latest and best."""
        latest, best = self.latest.get(m), self.best.get(m)
        if latest is not None and (m, self._member[latest.number][1] + 1) not in self.exists \
                and self._member[latest.number][2] < self.epochs:
            self.due.add(m)
        else:
            self.due.discard(m)
        old = self._ranked.pop(m, None)
        if old is not None:
            del self.ranking[bisect_left(self.ranking, old)]
        if best is not None and best.value is not None and self._member[best.number][2] < self.epochs:
            entry = (-float(best.value) if self.maximize else float(best.value), m)
            insort(self.ranking, entry)
            self._ranked[m] = entry


def _put(d: dict[int, FrozenTrial], key: int, value: FrozenTrial | None) -> None:
    if value is None:
        d.pop(key, None)
    else:
        d[key] = value
