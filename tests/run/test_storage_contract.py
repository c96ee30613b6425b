"""Optuna's own storage contract (``optuna.testing.pytest_storages``, shipped with Optuna: the tests every
Optuna storage passes) on hpoflow's journal storage as a run opens it (``open_storage``: a writer that
keeps its file open). Plain Optuna code relies on it: samplers, ``study.optimize(n_jobs=...)``, and
joblib, Dask or multiprocessing, which pickle the storage (``test_pickle_storage``). Each test gets a
journal of its own: the suite's 59 tests take about 2 s here.

``RetryingStorage`` (the storage of the study ``optimize`` returns) is no full Optuna storage by design:
every trial it creates carries a system attr of its own (``TOKEN_ATTR``), which the contract's
system-attr tests do not expect; it must pickle all the same.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path

import optuna
import pytest
from optuna.storages import BaseStorage
from optuna.testing.pytest_storages import StorageTestCase

from hpoflow.run.retry import RetryingStorage
from hpoflow.run.storage import open_storage

STORAGES: dict[str, Callable[[Path], BaseStorage]] = {
    "journal": lambda d: open_storage(None, d),
}


@pytest.fixture(params=list(STORAGES))
def storage(request: pytest.FixtureRequest, tmp_path: Path) -> BaseStorage:
    """The fixture Optuna's ``StorageTestCase`` asks for: one hpoflow storage, on a journal of its own."""
    return STORAGES[request.param](tmp_path)


class TestOptunasStorageContract(StorageTestCase):
    """Every test of Optuna's contract, on each storage of ``STORAGES``."""


def test_the_study_optimize_returns_pickles_with_its_storage(tmp_path: Path) -> None:
    storage = RetryingStorage(open_storage(None, tmp_path), str(tmp_path / "study.journal"), 30.0)
    study = optuna.create_study(storage=storage, study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    copy = pickle.loads(pickle.dumps(study))
    assert copy._storage.retry_s == 30.0 and copy._storage._lock is not storage._lock
    copy.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)  # the copy writes to the same journal
    assert len(optuna.load_study(study_name="s", storage=open_storage(None, tmp_path)).trials) == 3


def test_a_pickled_journal_does_not_share_the_writers_descriptor_or_locks(tmp_path: Path) -> None:
    """The copy is a storage of its own (Optuna's ``JournalStorage`` pickles as the backend plus a fresh
    replay): it holds the journal file open through a descriptor of its own, so the original closing its
    descriptor (when it is collected) leaves the copy's good, and a copy made while the original's lock
    is held does not think it holds it."""
    storage = open_storage(None, tmp_path)
    study = optuna.create_study(storage=storage, study_name="s")
    study.enqueue_trial({"x": 0.5})
    backend = storage._backend  # type: ignore[attr-defined]
    copy = pickle.loads(pickle.dumps(storage))
    copied = copy._backend
    assert copied._held is not None and copied._held != backend._held
    assert copied._lock._held is None
    assert copied._gone_lock is not backend._gone_lock and copy._thread_lock is not storage._thread_lock  # type: ignore[attr-defined]
    del study, storage, backend  # the original's descriptor is closed with it
    import gc

    gc.collect()
    again = optuna.load_study(study_name="s", storage=copy)
    assert [t.system_attrs["fixed_params"] for t in again.get_trials()] == [{"x": 0.5}]
    again.enqueue_trial({"x": 0.25})
    assert len(optuna.load_study(study_name="s", storage=open_storage(None, tmp_path)).get_trials()) == 2
