"""The storage password stays out of reach of trial code: never in a trial process's environment, nor
in what it can read of its ancestors (/proc/PID/environ, /proc/PID/cmdline); the CLI says
--storage-env first and warns about a password on the command line (hpoflow.credentials)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpoflow.credentials import scrub
from tests.infra.postgres import PostgresServer

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")])}


def _child(code: str, *args: str, env: dict[str, str]) -> Any:
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_take_env_takes_the_variable_out_of_the_environment_and_the_initial_block() -> None:
    url = "postgresql://alice:pw-7f3a9c@db.example/hpo"
    code = """if True:
        import json, os
        from hpoflow.credentials import take_env
        first = take_env("HPO_SECRET_URL")
        print(json.dumps({"value": first, "again": take_env("HPO_SECRET_URL"),
                          "left": sorted(k for k in os.environ if k in ("HPO_SECRET_URL", "COPY_OF_IT", "OTHER")),
                          "proc": open("/proc/self/environ", "rb").read().decode(errors="replace")}))
    """
    seen = _child(code, env={**ENV, "HPO_SECRET_URL": url, "COPY_OF_IT": f"x {url} y", "OTHER": "pw"})
    assert seen["value"] == url and seen["again"] == url  # kept in memory for the driver
    assert seen["left"] == ["OTHER"]  # the variable and any other holding the URL are gone
    assert "pw-7f3a9c" not in seen["proc"] and "db.example" not in seen["proc"]  # what other processes read


def test_wipe_argv_blanks_a_password_out_of_the_command_line() -> None:
    code = """if True:
        import json
        from hpoflow.credentials import wipe_argv
        found = wipe_argv("pw-5e1d")
        print(json.dumps({"found": found, "cmdline": open("/proc/self/cmdline", "rb").read().decode()}))
    """
    seen = _child(code, "--storage", "postgresql://bob:pw-5e1d@h/db", env=ENV)
    assert seen["found"] and "pw-5e1d" not in seen["cmdline"] and "bob:*******@h/db" in seen["cmdline"]


def test_rank_processes_of_a_cluster_trial_get_no_database_url_with_a_password(monkeypatch: pytest.MonkeyPatch
                                                                               ) -> None:
    env = {"DATABASE_URL": "postgresql+psycopg2://u:secret@h:5432/db", "MY_DB": "mysql://root:pw@localhost/x",
           "PROXY": "http://user:pass@proxy:3128", "SQLITE": "sqlite:////tmp/x.db", "NOPW": "postgresql://u@h/db",
           "PATH": "/usr/bin"}
    assert sorted(scrub(dict(env), any_database_url=True)) == ["DATABASE_URL", "MY_DB"]
    from hpoflow.engines.cluster import node

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    job = {"request": {"number": 0}, "world_size": 1, "master_addr": "127.0.0.1", "master_port": 0, "env": {}}
    rank_env = node._rank_env(job, 0, 0, 1, (0,), (), False)
    assert "DATABASE_URL" not in rank_env and "MY_DB" not in rank_env
    assert rank_env["PROXY"] == env["PROXY"] and rank_env["NOPW"] == env["NOPW"]


@pytest.mark.parametrize("command", ["status", "report", "dashboard"])
def test_help_says_storage_env_first(command: str) -> None:
    r = subprocess.run([sys.executable, "-m", "hpoflow", command, "--help"], env={**ENV, "COLUMNS": "400"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert text.index("--storage-env NAME") < text.index("--storage URL")
    assert "visible to every user of this machine (ps): prefer --storage-env" in text


def test_a_password_on_the_command_line_is_warned_about(tmp_path: Path) -> None:
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "run.json").write_text(json.dumps({"study_name": "s"}))
    r = subprocess.run([sys.executable, "-m", "hpoflow", "status", str(rd), "--storage",
                        "postgresql://carol:pw-9b2c@127.0.0.1:1/hpo"], env=ENV, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2  # nothing answers on port 1
    assert "hpoflow: warning: --storage put the database password on the command line" in r.stderr
    assert "--storage-env HPOFLOW_STORAGE" in r.stderr and "pw-9b2c" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "hpoflow", "status", str(rd), "--storage-env", "HPO_UNSET"],
                       env=ENV, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr == ("hpoflow: error: --storage-env: the environment variable HPO_UNSET is "
                                              "not set. Fix: export HPO_UNSET=<storage URL>\n")


@pytest.mark.slow  # two studies through the CLI, one on warm workers (torch preloaded)
@pytest.mark.parametrize("processes", [1, 2])  # 1: light workers (spawned); 2: warm ones (the forkserver)
def test_the_storage_password_never_reaches_a_trial(postgres_server: PostgresServer, tmp_path: Path,
                                                    processes: int) -> None:
    url = postgres_server.create_database(f"creds_{processes}_{abs(hash(tmp_path.name)) % 10**6}")
    spec = {"study": {"name": "creds", "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 2 // processes, "seed": 1},
            "training": {"function": "trainfns_light:environment"}, "resources": {"processes": processes},
            "oracle": {"enabled": False}, "storage_env": "HPO_TEST_PG"}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    env = {**ENV, "HPO_TEST_PG": url, "ALSO_THE_URL": url}
    r = subprocess.run([sys.executable, "-m", "hpoflow", "run", "spec.yaml", "--run-dir", "run", "--json"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["n_complete"] == 2
    seen = sorted((tmp_path / "run" / "trials").glob("*/seen*.json"))
    assert len(seen) == 2 * processes
    for path in seen:
        text = path.read_text()
        data = json.loads(text)
        assert "HPO_TEST_PG" not in data["environ"] and "ALSO_THE_URL" not in data["environ"]
        assert postgres_server.password not in text, path  # nor in any ancestor's environ or command line
        assert len(data["ancestors"]) >= 2  # the driver (and the forkserver) were looked at
    status = subprocess.run([sys.executable, "-m", "hpoflow", "status", "run", "--json"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0 and json.loads(status.stdout)["n_complete"] == 2, status.stderr
