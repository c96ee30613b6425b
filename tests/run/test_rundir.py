"""A run directory is one thing however it is spelled; readers change nothing; no secret is written;
a second run on a busy directory is refused; outcomes have honest exit codes."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.storages.journal import JournalFileBackend

from hpoflow.errors import RunDirError
from hpoflow.run.rundir import RunLock, redact, resolve

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}

pytestmark = pytest.mark.slow  # whole studies through the CLI


def _spec(path: Path, **extra: Any) -> Path:
    data = {
        "study": {"name": "rd", "metric": "value", "direction": "maximize"},
        "space": {"value": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": 3, "max_concurrent": 2, "seed": 1},
        "training": {"function": "trainfns:behave"},
        "oracle": {"enabled": False},
        **extra,
    }
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def hpoflow(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpoflow", *args], cwd=cwd, env=ENV, capture_output=True,
                          text=True, timeout=300)


def _digests(rd: Path) -> dict[str, str]:
    return {str(p.relative_to(rd)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((rd / "trials").rglob("*")) if p.is_file()}


def test_a_relative_run_dir_is_one_place_and_every_spelling_resumes_it(tmp_path: Path) -> None:
    _spec(tmp_path / "spec.yaml")
    first = hpoflow(tmp_path, "run", "spec.yaml", "--run-dir", "runs/rd", "--json")
    assert first.returncode == 0, first.stderr
    rd = tmp_path / "runs" / "rd"
    assert (rd / "study.journal").is_file() and not (rd / "runs").exists()  # not joined twice
    info = json.loads((rd / "run.json").read_text())
    assert info["storage"] == str(rd / "study.journal") and len(info["run_id"]) == 32
    assert json.loads(first.stdout)["storage"] == info["storage"]
    backend = JournalFileBackend(str(rd / "study.journal"))
    study = optuna.load_study(study_name="rd", storage=optuna.storages.JournalStorage(backend))
    assert len(study.trials) == 3
    before = _digests(rd)
    # status from inside the directory, as "."
    status = hpoflow(rd, "status", ".", "--json")
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["n_complete"] == 3 and json.loads(status.stdout)["n_trials"] == 3
    # the absolute path, a symlink and ~ all resume the same study: nothing rerun, no file changed
    link = tmp_path / "link"
    link.symlink_to(rd)
    home = {**ENV, "HOME": str(tmp_path)}
    for spelling in (str(rd), str(link), "~/runs/rd"):
        again = subprocess.run([sys.executable, "-m", "hpoflow", "run", "spec.yaml", "--run-dir", spelling, "--json"],
                               cwd=tmp_path, env=home, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr
        assert json.loads(again.stdout)["n_total"] == 3, spelling
    assert _digests(rd) == before
    assert json.loads((rd / "run.json").read_text())["run_id"] == info["run_id"]


def test_readers_create_and_change_nothing(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    r = hpoflow(tmp_path, "status", str(missing))
    assert r.returncode == 2 and "Traceback" not in r.stderr and not missing.exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    r = hpoflow(tmp_path, "status", str(empty))
    assert r.returncode == 2 and "not an hpoflow run directory" in r.stderr and list(empty.iterdir()) == []
    (empty / "run.json").write_text(json.dumps({"study_name": "x"}))
    r = hpoflow(tmp_path, "status", str(empty))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert sorted(p.name for p in empty.iterdir()) == ["run.json"]  # no empty journal left behind


def test_run_dir_errors_are_one_line_with_exit_2(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "spec.yaml")
    a_file = tmp_path / "file"
    a_file.write_text("x")
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", str(a_file))
    assert r.returncode == 2 and "is a file, not a directory" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(RunDirError, match="is a file"):
        resolve(a_file, create=True)


def test_a_second_run_on_a_busy_directory_is_refused(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "spec.yaml")
    rd = resolve(tmp_path / "run", create=True)
    with RunLock(rd):
        r = hpoflow(tmp_path, "run", str(spec), "--run-dir", str(rd))
        assert r.returncode == 2 and f"another hpoflow run (pid {os.getpid()}) is using {rd}" in r.stderr
        with pytest.raises(RunDirError, match="another hpoflow run"), RunLock(rd):
            pass
    with RunLock(rd):  # released: usable again
        pass


def test_no_password_is_written_or_printed(tmp_path: Path) -> None:
    url = "postgresql://alice:s3cret-pw@127.0.0.1:1/hpo"
    assert redact(url) == "postgresql://alice:***@127.0.0.1:1/hpo"
    assert redact("sqlite:///x.db") == "sqlite:///x.db" and redact(None) is None
    spec = _spec(tmp_path / "spec.yaml", storage=url)
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", "run", "--json")
    assert r.returncode == 2, r.stderr  # no database answers on port 1: a clean error
    assert "cannot open the study's storage postgresql://alice:***@127.0.0.1:1/hpo" in r.stderr
    assert "Traceback" not in r.stderr
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert "s3cret" not in written + r.stdout + r.stderr
    assert not (tmp_path / "run" / "spec.yaml").exists()  # a storage that did not open: no spec.yaml to refuse
    # the URL can come from an environment variable that the spec names
    spec = _spec(tmp_path / "spec2.yaml", storage_env="HPO_TEST_DB")
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", "run2")
    assert r.returncode == 2 and "HPO_TEST_DB is not set" in r.stderr


def test_a_storage_password_is_redacted_in_spec_yaml(tmp_path: Path, postgres_url: str) -> None:
    from sqlalchemy.engine import make_url

    password = make_url(postgres_url).password
    assert password
    spec = _spec(tmp_path / "spec.yaml", storage=postgres_url,
                 study={"name": f"rd-{os.getpid()}-{tmp_path.name}", "metric": "value", "direction": "maximize"},
                 space={"x": {"type": "float", "low": 0.0, "high": 1.0}},
                 search={"algorithm": "random", "n_trials": 1, "seed": 1},
                 training={"function": "trainfns_light:nap", "options": {"seconds": 0.0}})
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", "run", "--json")
    assert r.returncode == 0, r.stderr
    assert ":***@" in (tmp_path / "run" / "spec.yaml").read_text()
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert password not in written + r.stdout + r.stderr


def test_a_study_whose_trials_all_fail_exits_3_and_says_why(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "spec.yaml", space={"mode": {"type": "categorical", "choices": ["raise"]}},
                 search={"algorithm": "random", "n_trials": 6, "max_concurrent": 1, "seed": 1})
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", "run", "--json")
    assert r.returncode == 3, r.stderr
    assert "no trial completed (3 failed, 0 pruned)" in r.stderr and "boom from user code" in r.stderr
    assert "search.fail_fast" in r.stderr  # stopped early: the first 3 failed alike
    status = json.loads(r.stdout)
    assert status["n_failed"] == 3 and status["n_complete"] == 0 and status["n_trials"] == 6
