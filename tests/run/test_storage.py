"""The default storage: Optuna's journal format, readable by plain Optuna, with a fast WAITING index."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from hpoflow.run.storage import open_storage


def test_waiting_index_answers_like_optunas_scan(tmp_path: Path) -> None:
    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    rng = random.Random(0)
    running = []
    for step in range(300):
        op = rng.random()
        if op < 0.3:
            study.enqueue_trial({"x": rng.random()})
        elif op < 0.7:
            t = study.ask()  # pops a waiting trial when there is one
            t.suggest_float("x", 0, 1)
            running.append(t)
        elif running:
            study.tell(running.pop(rng.randrange(len(running))), rng.random())
        if step % 10 == 0:
            plain = JournalStorage(JournalFileBackend(str(tmp_path / "study.journal")))
            want = [t.number for t in plain.get_all_trials(study._study_id, states=(TrialState.WAITING,))]
            got = [t.number for t in storage.get_all_trials(study._study_id, states=(TrialState.WAITING,))]
            assert got == want
    # other processes' enqueues are seen too (they arrive through the journal file)
    plain = JournalStorage(JournalFileBackend(str(tmp_path / "study.journal")))
    other = optuna.load_study(study_name="s", storage=plain)
    other.enqueue_trial({"x": 0.5})
    waiting = storage.get_all_trials(study._study_id, deepcopy=False, states=(TrialState.WAITING,))
    assert waiting and waiting[-1].system_attrs["fixed_params"] == {"x": 0.5}


def test_the_fast_paths_are_taken_with_this_optuna(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both fast paths read Optuna's journal internals and fall back to Optuna's own code when those
    change shape. The fallback would be silent (only slower), so here Optuna's own code paths raise:
    an Optuna upgrade that moves the internals fails this test instead of slowing every study."""

    def scan(self: JournalStorage, study_id: int, deepcopy: bool = True, states: Any = None) -> Any:
        if states is not None and list(states) == [TrialState.WAITING]:
            raise AssertionError("the WAITING query fell back to Optuna's full scan")
        return original_scan(self, study_id, deepcopy, states)

    def append(self: JournalFileBackend, logs: list[dict[str, Any]]) -> None:
        raise AssertionError("the journal append fell back to Optuna's fsync per append")

    original_scan = JournalStorage.get_all_trials
    monkeypatch.setattr(JournalStorage, "get_all_trials", scan)
    monkeypatch.setattr(JournalFileBackend, "append_logs", append)
    monkeypatch.delenv("HPOFLOW_JOURNAL_FSYNC", raising=False)
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="fast")
    study.enqueue_trial({"x": 0.25})
    trial = study.ask()
    assert trial.suggest_float("x", 0, 1) == 0.25
    study.tell(trial, 1.0)
    assert [t.state for t in study.get_trials()] == [TrialState.COMPLETE]
