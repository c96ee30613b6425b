"""The default storage: Optuna's journal format, readable by plain Optuna, with a fast WAITING index."""

from __future__ import annotations

import random
from pathlib import Path

import optuna
from optuna.storages import JournalStorage
from optuna.storages.journal import JournalFileBackend
from optuna.trial import TrialState

from hpoflow.search.storage import open_storage


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
