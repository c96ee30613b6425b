"""One reader's feed of a study's trials: every trial, and which of them changed since this reader's last read.

The driver keeps three indexes beside the study, each updated from what changed: the tally of what
counts and what runs (``hpoflow.run.ledger.Tally``), a model-based sampler's history
(``hpoflow.search.history.History``) and BOHB's count of reports per budget (``hpoflow.search.bohb``).
Each used to find what changed by comparing the record of every unfinished trial with the one of its last
read: with 1,024 trials running and thousands paused by a promotion scheduler, that was several thousand
comparisons a read, several reads a trial (a third of the driver's CPU in a 10,000-trial study).

hpoflow's journal storage knows which records it replaced (``hpoflow.run.storage``): it keeps, per study,
the numbers of the trials whose record a read swapped in, in order, and answers a reader "since your
cursor" (``trials_and_changes``). ``TrialFeed.read`` gives a reader the trials and those numbers; where the
storage cannot say (another storage, a pickled copy, a first read, a reader whose cursor fell behind what
the storage keeps), the numbers are None and the reader looks at every trial it would have looked at.

A storage offers the feed by a method ``trials_and_changes(study_id, since)`` returning None (no feed) or
``(trials, cursor, changed)``: the study's trials in number order as ``get_all_trials(study_id,
deepcopy=False)`` would, the cursor to give next time, and the numbers of the trials whose record is not
the one the reader's read at ``since`` handed out (None when ``since`` is None or too old). Trials created
since are not necessarily among them: a reader finds those by the list's length.
"""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial

__all__ = ["TrialFeed"]


class TrialFeed:
    """What one reader of one study has read (module docstring)."""

    def __init__(self) -> None:
        self._source: tuple[int, int] | None = None  # (the storage's id, the study's id) of the last read
        self._cursor: int | None = None

    def read(self, study: optuna.Study) -> tuple[list[FrozenTrial], list[int] | None]:
        """The study's trials in number order, and the numbers of those whose record changed since this
        feed's last read (None: unknown; look at every one that may have)."""
        storage: Any = study._storage
        source = (id(storage), study._study_id)
        ask = getattr(storage, "trials_and_changes", None)
        got = ask(study._study_id, self._cursor if source == self._source else None) if ask is not None else None
        if got is None:
            self._source, self._cursor = None, None
            return study._get_trials(deepcopy=False, states=None, use_cache=False), None
        trials, self._cursor, changed = got
        self._source = source
        return trials, changed
