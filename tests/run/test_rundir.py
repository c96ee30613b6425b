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
from tests.infra.postgres import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}

pytestmark = pytest.mark.slow  # whole studies through the CLI


def _spec(path: Path, **extra: Any) -> Path:
    data = {
        "study": {"name": "rd", "metric": "value", "direction": "maximize"},
        "space": {"value": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": 3, "max_concurrent": 2, "seed": 1},
        # torch-free: these tests are about the run directory, the storage and exit codes, not training
        # (light workers, no forkserver preloading torch for each hpoflow run)
        "training": {"function": "trainfns_light:behave"},
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
    assert "s3cret" not in r.stdout + r.stderr
    assert not (tmp_path / "run").exists()  # a storage that cannot be opened writes nothing
    # the URL can come from an environment variable that the spec names
    spec = _spec(tmp_path / "spec2.yaml", storage_env="HPO_TEST_DB")
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", "run2")
    assert r.returncode == 2 and "HPO_TEST_DB is not set" in r.stderr


def test_a_password_written_in_the_spec_is_redacted_in_spec_yaml(postgres_server: PostgresServer,
                                                                  tmp_path: Path) -> None:
    """A URL with a password in the spec's storage: (which hpoflow warns against) runs, and the run
    directory's copy of the spec holds ``***`` in its place."""
    url = postgres_server.create_database(f"rd_{abs(hash(tmp_path.name)) % 10**8}")
    spec = _spec(tmp_path / "spec.yaml", storage=url, space={"x": {"type": "float", "low": 0.0, "high": 1.0}},
                 training={"function": "trainfns_light:nap", "options": {"seconds": 0.05}})
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", "run", "--json")
    assert r.returncode == 0, r.stderr
    written = "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*") if p.is_file())
    assert postgres_server.password not in written + r.stdout + r.stderr
    shown = redact(url)
    assert shown is not None and ":***@" in shown and shown in (tmp_path / "run" / "spec.yaml").read_text()


def _one_line(r: subprocess.CompletedProcess[str]) -> str:
    """The one line a refused command printed (asserting exit code 2, one line, no traceback)."""
    assert r.returncode == 2, r.stderr
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    return r.stderr.strip()


def test_a_storage_that_cannot_be_opened_writes_nothing_and_the_same_command_runs_once_fixed(tmp_path: Path) -> None:
    """A storage URL that fails to open: one line naming the file at fault, and nothing written to the
    run directory (spec.yaml was left behind, so the command with the URL fixed was refused: "holds a
    run of a different study (they differ at storage)"). ``sqlite:////some/dir`` (a directory) is seen
    before the run directory is touched, by validate too; a directory that is not there when the
    database is opened, and a database that does not answer, are met in the run directory, and what
    the run wrote there is taken back (a directory it made is removed)."""
    space = {"x": {"type": "float", "low": 0.0, "high": 1.0}}
    training = {"function": "trainfns_light:nap", "options": {"seconds": 0.05}}
    adir = tmp_path / "adir"
    adir.mkdir()
    (tmp_path / "empty").mkdir()  # a run directory made beforehand: left as found, but for the run lock
    _spec(tmp_path / "spec.yaml", storage=f"sqlite:///{adir}", space=space, training=training)
    expected = (f"hpoflow: error: storage: cannot open the study's storage sqlite:///{adir}: {adir} is a directory, "
                f"not an SQLite database file. Fix: name a file, such as sqlite:///{adir / 'study.db'}")
    for args in (("run", str(tmp_path / "spec.yaml"), "--run-dir", "run"), ("validate", str(tmp_path / "spec.yaml"))):
        assert _one_line(hpoflow(tmp_path, *args)) == expected
    assert not (tmp_path / "run").exists()
    met_at_open = [(f"sqlite:///{tmp_path / 'nodir' / 'study.db'}", ("run", "empty"),
                    f"{tmp_path / 'nodir'} does not exist (SQLite creates the database file, not its directory)"),
                   ("postgresql://u@127.0.0.1:1/hpo", ("run",),
                    "cannot open the study's storage postgresql://u@127.0.0.1:1/hpo: ")]
    for url, run_dirs, words in met_at_open:
        _spec(tmp_path / "spec.yaml", storage=url, space=space, training=training)
        for rd in run_dirs:
            line = _one_line(hpoflow(tmp_path, "run", str(tmp_path / "spec.yaml"), "--run-dir", rd))
            assert line.startswith("hpoflow: error: ") and words in line, line
            assert not (tmp_path / "run").exists()  # made by the command, removed with what it wrote
            assert [p.name for p in (tmp_path / "empty").iterdir()] in ([], [".hpoflow.lock"])
    _spec(tmp_path / "spec.yaml", storage=f"sqlite:///{adir / 'study.db'}", space=space, training=training)
    for rd in ("run", "empty"):
        r = hpoflow(tmp_path, "run", str(tmp_path / "spec.yaml"), "--run-dir", rd, "--json")
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["n_complete"] == 3


def test_a_study_whose_trials_all_fail_exits_3_and_says_why(tmp_path: Path) -> None:
    spec = _spec(tmp_path / "spec.yaml", space={"mode": {"type": "categorical", "choices": ["raise"]}},
                 search={"algorithm": "random", "n_trials": 6, "max_concurrent": 1, "seed": 1})
    r = hpoflow(tmp_path, "run", str(spec), "--run-dir", "run", "--json")
    assert r.returncode == 3, r.stderr
    assert "no trial completed (3 failed, 0 pruned)" in r.stderr and "boom from user code" in r.stderr
    assert "search.fail_fast" in r.stderr  # stopped early: the first 3 failed alike
    status = json.loads(r.stdout)
    assert status["n_failed"] == 3 and status["n_complete"] == 0 and status["n_trials"] == 6
