"""The claims companion study (``<study>:hpoflow-claims``, hpoflow.run.claims) beside a user's study: marked
as hpoflow's bookkeeping when it is created, told from a user's study, and left out of ``hpoflow
dashboard``'s study list (optuna-dashboard lists every study its storage's ``get_all_studies`` gives)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import optuna
import pytest

from hpoflow.cli._readonly import ReadOnlyStorage
from hpoflow.run.claims import CLAIMS_SUFFIX, COMPANION_ATTR, Claims, is_companion
from hpoflow.run.storage import open_storage


def _study_with_claims(tmp_path: Path) -> optuna.Study:
    study = optuna.create_study(storage=open_storage(None, tmp_path), study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=1)
    assert Claims(study).claim("promote:0", "driver-a") == "driver-a"
    return study


def test_the_companion_is_marked_as_the_claims_of_its_study(tmp_path: Path) -> None:
    study = _study_with_claims(tmp_path)
    studies = {s.study_name: s for s in optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(tmp_path / "study.journal"))).get_all_studies()}
    assert sorted(studies) == ["s", f"s{CLAIMS_SUFFIX}"]  # plain Optuna lists both
    companion = studies[f"s{CLAIMS_SUFFIX}"]
    assert companion.system_attrs[COMPANION_ATTR] == "s"
    assert "claims of study 's'" in companion.user_attrs["hpoflow"]
    names = set(studies)
    assert is_companion(companion, names) and not is_companion(studies["s"], names)
    assert Claims(study).holders() == {"promote:0": "driver-a"}  # (the marks are no claims)


def test_an_unmarked_companion_is_known_by_its_name_beside_its_study(tmp_path: Path) -> None:
    """A companion an earlier hpoflow made (no mark) is still one; a user's study that only ends alike is not."""
    storage = open_storage(None, tmp_path)
    for name in ("s", f"s{CLAIMS_SUFFIX}", f"other{CLAIMS_SUFFIX}"):
        storage.create_new_study([optuna.study.StudyDirection.MINIMIZE], name)
    names = {s.study_name for s in storage.get_all_studies()}
    verdicts = {s.study_name: is_companion(s, names) for s in storage.get_all_studies()}
    assert verdicts == {"s": False, f"s{CLAIMS_SUFFIX}": True, f"other{CLAIMS_SUFFIX}": False}


def test_hpoflow_dashboard_lists_the_users_study_alone(tmp_path: Path) -> None:
    study = _study_with_claims(tmp_path)
    readonly = ReadOnlyStorage(open_storage(None, tmp_path, create=False))
    assert [s.study_name for s in readonly.get_all_studies()] == ["s"]
    companion_id = study._storage.get_study_id_from_name(f"s{CLAIMS_SUFFIX}")
    assert readonly.get_study_name_from_id(companion_id) == f"s{CLAIMS_SUFFIX}"  # still read by its id

    optuna_dashboard = pytest.importorskip("optuna_dashboard")
    from wsgiref.util import setup_testing_defaults

    environ: dict[str, Any] = {"PATH_INFO": "/api/studies", "REQUEST_METHOD": "GET"}
    setup_testing_defaults(environ)
    status: list[str] = []
    body = b"".join(optuna_dashboard.wsgi(readonly)(environ, lambda s, h, *a: status.append(s)))
    assert status == ["200 OK"], body[:500]
    assert [s["study_name"] for s in json.loads(body)["study_summaries"]] == ["s"]
