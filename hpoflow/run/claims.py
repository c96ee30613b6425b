"""Claims: a compare-and-set that drivers sharing a study can trust, on every storage.

Optuna's storage API has no compare-and-set on attributes, and its one atomic-looking move, taking a
WAITING trial (``set_trial_state_values(..., RUNNING)``), is atomic on a journal and on PostgreSQL
(``SELECT ... FOR UPDATE``) but not on SQLite: both readers may see WAITING and both writes succeed. What
every storage does give is one order of a study's trials that every reader sees: trial ``n`` is numbered
only after trials ``0 .. n-1`` are written (a journal: the order of its records; a database: the trial is
numbered inside the transaction that inserts it, the study's row locked (PostgreSQL, MySQL) or the
database's one writer (SQLite) held until it commits), so a reader that sees trial ``n`` sees every trial
before it.

A *claim* is a trial of the study's companion study ``<study name>:hpoflow-claims`` (created on the first
claim; ``is_companion`` tells it from a user's study), carrying ``{"key": ..., "by": ...}`` in its user
attr ``hpoflow_claim``. The first claim of a key in that order holds the key. Whoever writes a claim
learns whether it holds the key by reading the claims once its own is written: every claim before it is
visible by then, and none can come before it later. So of any number of drivers claiming one key at once
exactly one holds it, and all of them agree which.

Used for the owner of a PBT study (``hpoflow.search.pbt``) and for promoting a paused trial
(``hpoflow.search.scheduling``). A claim is never taken back: a key that must pass on (its holder died)
is followed by a new key, which the drivers derive alike.

A study with a scheduler holds a claim per promotion, thousands in a long study, so the claims are read
incrementally: those read before are kept (a claim never changes), and a read parses only the claims
written since, which come after them in that order (a claim numbered below one read already means the
order was not what it should be: everything is read again).

The companion is a study of the same storage, so whatever lists a storage's studies (Optuna's
``get_all_studies``, ``optuna.get_all_study_summaries``, optuna-dashboard's study list) lists it beside the
user's; its name cannot change (drivers of a study find its claims by that name, a resumed study too). Its
creator marks it: the system attr ``COMPANION_ATTR`` names the study it serves, and the user
attr ``hpoflow`` says what it is (optuna-dashboard shows it on the study's page). ``hpoflow dashboard`` leaves
it out of its study list (``hpoflow.cli._readonly``); another program that lists studies shows it.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Container
from datetime import datetime
from typing import Any

import optuna
from optuna.study import StudyDirection
from optuna.study._frozen import FrozenStudy
from optuna.trial import FrozenTrial, TrialState

__all__ = ["CLAIMS_SUFFIX", "COMPANION_ATTR", "Claims", "is_companion"]

CLAIMS_SUFFIX = ":hpoflow-claims"
COMPANION_ATTR = "hpoflow_companion_of"  # study system attr of a companion study: the name of the study it serves
_ATTR = "hpoflow_claim"


def is_companion(study: FrozenStudy, names: Container[str]) -> bool:
    """Whether ``study``, of a storage holding the studies ``names``, is another study's claims companion:
    marked so (``COMPANION_ATTR``), or named ``<a study of names>:hpoflow-claims`` (a companion whose creator
    stopped before it marked it, or that an hpoflow before the mark made)."""
    if isinstance(study.system_attrs.get(COMPANION_ATTR), str):
        return True
    name = study.study_name
    return name.endswith(CLAIMS_SUFFIX) and name.removesuffix(CLAIMS_SUFFIX) in names


class Claims:
    """The claims of one study (see the module docstring)."""

    def __init__(self, study: optuna.Study) -> None:
        # Optuna keeps a study's storage private; its storage API (studies, trials) is public.
        self.storage: optuna.storages.BaseStorage = study._storage
        self.name = study.study_name + CLAIMS_SUFFIX
        self._id: int | None = None
        self._read_n = 0  # claims read so far: the first ones of the storage's order
        self._last = -1  # the highest number among them
        self._held: dict[str, str] = {}  # every key read -> its holder (the first claim of it)

    def holders(self, prefix: str = "") -> dict[str, str]:
        """Every claimed key that starts with ``prefix``, with the driver that holds it."""
        self._read()
        return {key: by for key, by in self._held.items() if key.startswith(prefix)}

    def holder(self, key: str) -> str | None:
        """The driver that holds ``key``, or None when nobody claimed it."""
        self._read()
        return self._held.get(key)

    def claim(self, key: str, by: str) -> str:
        """Claim ``key`` for ``by`` (unless it is held already); returns the holder: ``by`` when it won."""
        held = self.holder(key)
        if held is not None:
            return held
        self.storage.create_new_trial(self._create(), template_trial=FrozenTrial(
            number=-1, state=TrialState.FAIL, value=None, datetime_start=datetime.now(),
            datetime_complete=datetime.now(), params={}, distributions={}, user_attrs={_ATTR: {"key": key, "by": by}},
            system_attrs={}, intermediate_values={}, trial_id=-1))
        return self.holder(key) or ""  # ("": the claim just written is not there to read: nobody holds it)

    # -- internals --------------------------------------------------------------------------------
    def _study_id(self) -> int | None:
        """The companion study's id, None while it does not exist."""
        if self._id is None:
            with contextlib.suppress(KeyError):
                self._id = self.storage.get_study_id_from_name(self.name)
        return self._id

    def _create(self) -> int:
        """The companion study's id, created if need be (by whichever driver comes first)."""
        found = self._study_id()
        if found is not None:
            return found
        with contextlib.suppress(optuna.exceptions.DuplicatedStudyError):  # another driver made it first
            self._id = self.storage.create_new_study([StudyDirection.MINIMIZE], self.name)
            self._mark(self._id)
        if self._id is None:
            self._id = self.storage.get_study_id_from_name(self.name)
        return self._id

    def _mark(self, study_id: int) -> None:
        """Mark the companion just created as such (module docstring)."""
        served = self.name.removesuffix(CLAIMS_SUFFIX)
        self.storage.set_study_system_attr(study_id, COMPANION_ATTR, served)
        self.storage.set_study_user_attr(study_id, "hpoflow", f"the claims of study {served!r} (hpoflow's bookkeeping "
                                         "of the drivers sharing it): no search of its own")

    def _read(self) -> None:
        """Take in the claims written since the last read (module docstring), in the storage's order."""
        study_id = self._study_id()
        if study_id is None:
            return
        trials = self.storage.get_all_trials(study_id, deepcopy=False)
        new = trials[self._read_n:]
        if len(trials) < self._read_n or any(t.number <= self._last for t in new) or any(
                a.number > b.number for a, b in itertools.pairwise(new)):
            self._read_n, self._last, self._held = 0, -1, {}  # not in the order expected: read all again
            new = sorted(trials, key=lambda t: t.number)
        for t in new:
            c: Any = t.user_attrs.get(_ATTR)
            if isinstance(c, dict) and isinstance(c.get("key"), str) and isinstance(c.get("by"), str):
                self._held.setdefault(c["key"], c["by"])
            self._last = max(self._last, t.number)
        self._read_n = len(trials)
