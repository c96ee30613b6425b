"""Several ``hpoflow run`` processes on one study: real CLI processes on a journal file, SQLite and
PostgreSQL, each with its own run directory. The study ends with exactly ``n_trials`` finished
trials; no driver dies; a driver killed with SIGKILL has its running trials rerun by the others."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import FrozenTrial, TrialState

from hpoflow.run.lease import read_leases
from hpoflow.run.ledger import ATTR_DRIVER, ATTR_REPLACES, ATTR_UNUSED, FINISHED, interrupted, is_counted
from hpoflow.run.storage import open_storage
from tests.conftest import ROOT
from tests.infra.fixtures import USES_POSTGRES

pytestmark = pytest.mark.slow  # three drivers at once, each with its worker processes

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
STORAGE_ENV = "HPOFLOW_TEST_SHARED_STORAGE"


def write_spec(tmp_path: Path, storage: str, *, n_trials: int | None = 12, seconds: float = 0.4,
               max_concurrent: int = 2, lease_s: float = 4.0, space: dict[str, Any] | None = None,
               algorithm: str = "random") -> tuple[Path, str]:
    """The spec every driver of a test runs (a fresh study name, so tests can share a database); the
    storage URL is given through ``storage_env`` (PostgreSQL's has a password)."""
    name = f"md-{uuid.uuid4().hex[:8]}"
    search: dict[str, Any] = {"algorithm": algorithm, "max_concurrent": max_concurrent, "seed": 1, "lease_s": lease_s}
    if n_trials is not None:
        search["n_trials"] = n_trials
    data = {
        "study": {"name": name, "metric": "value", "direction": "maximize"},
        "space": space or {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": search,
        "training": {"function": "trainfns_light:nap", "options": {"seconds": seconds}},
        "storage_env": STORAGE_ENV,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, name


class Drivers:
    """``hpoflow run`` processes of one spec, each in its own run directory and process group."""

    def __init__(self, tmp_path: Path, spec: Path, storage: str) -> None:
        self.tmp_path, self.spec = tmp_path, spec
        self.env = {**ENV, STORAGE_ENV: storage}
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> subprocess.Popen[bytes]:
        rd = self.tmp_path / name
        rd.mkdir()
        proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "run", str(self.spec), "--run-dir", str(rd),
                                 "--quiet"], env=self.env, cwd=ROOT, stdout=(rd.parent / f"{name}.out").open("wb"),
                                stderr=(rd.parent / f"{name}.err").open("wb"), start_new_session=True)
        self.procs[name] = proc
        return proc

    def wait(self, timeout: float = 240) -> dict[str, int | None]:
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise
        return {name: proc.returncode for name, proc in self.procs.items()}

    def stderr(self, name: str) -> str:
        return (self.tmp_path / f"{name}.err").read_text()

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


STORAGE_KINDS = ["journal", "sqlite", pytest.param("postgresql", marks=USES_POSTGRES)]


def storage_for(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "journal":
        return str(tmp_path / "shared.journal")
    if kind == "sqlite":
        return f"sqlite:///{tmp_path / 'shared.db'}"
    return str(request.getfixturevalue("postgres_url"))  # skips where no PostgreSQL server can run


def load(storage: str, name: str, tmp_path: Path) -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(storage, tmp_path, create=False))


def counted_finished(study: optuna.Study) -> list[FrozenTrial]:
    trials = study.get_trials(deepcopy=False)
    counted = is_counted(trials)
    return [t for t in trials if t.state in FINISHED and counted(t)]


def assert_exact(study: optuna.Study, n: int) -> list[FrozenTrial]:
    """Exactly ``n`` finished trials count, all complete; none running; a trial closed without running
    (a duplicate) never ran."""
    done = counted_finished(study)
    assert len(done) == n and all(t.state == TrialState.COMPLETE for t in done), [
        (t.number, t.state.name) for t in done]
    assert not study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
    for t in study.get_trials(deepcopy=False):
        if t.user_attrs.get(ATTR_UNUSED):
            assert "metrics" not in t.user_attrs
    return done


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_three_drivers_on_one_study_finish_exactly_n_trials(tmp_path: Path, request: pytest.FixtureRequest,
                                                            kind: str) -> None:
    storage = storage_for(kind, tmp_path, request)
    spec, name = write_spec(tmp_path, storage)
    drivers = Drivers(tmp_path, spec, storage)
    for d in ("a", "b", "c"):
        drivers.start(d)
    codes = drivers.wait()
    errors = {d: drivers.stderr(d) for d in codes}
    assert codes == {"a": 0, "b": 0, "c": 0}, errors
    assert not any("Traceback" in e for e in errors.values()), errors
    study = load(storage, name, tmp_path)
    done = assert_exact(study, 12)
    assert not study.get_trials(deepcopy=False, states=(TrialState.FAIL,))  # no failure, and none made up
    ran_by = {t.user_attrs[ATTR_DRIVER] for t in done}
    leases = read_leases(study)
    assert ran_by <= set(leases) and len(ran_by) >= 2, ran_by  # they shared the work
    assert all(info.ended for info in leases.values())
    labels = {leases[i].label for i in ran_by}
    for d in ("a", "b", "c"):  # every run directory's trials.csv shows the whole study and who ran what
        rows = list(csv.DictReader((tmp_path / d / "trials.csv").open()))
        finished = [r for r in rows if r["state"] == "COMPLETE"]
        assert len(finished) == 12 and {r["driver"] for r in finished} == labels


def trials_in_progress(run_dir: Path) -> set[int]:
    started = {int(p.parent.name) for p in run_dir.glob("trials/*/rank0.log")}
    return started - {int(p.parent.name) for p in run_dir.glob("trials/*/result.json")}


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_a_driver_killed_mid_study_has_its_trials_rerun_by_the_others(tmp_path: Path,
                                                                      request: pytest.FixtureRequest,
                                                                      kind: str) -> None:
    storage = storage_for(kind, tmp_path, request)
    spec, name = write_spec(tmp_path, storage, seconds=1.5)
    drivers = Drivers(tmp_path, spec, storage)
    victim = drivers.start("a")
    drivers.start("b")
    drivers.start("c")
    deadline = time.monotonic() + 120
    while not trials_in_progress(tmp_path / "a") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert trials_in_progress(tmp_path / "a"), "driver a never started a trial"
    os.killpg(victim.pid, signal.SIGKILL)  # the driver and its workers, at once, mid-trial
    codes = drivers.wait()
    assert codes["a"] == -signal.SIGKILL and codes["b"] == 0 and codes["c"] == 0, (
        f"codes {codes}\n--- b:\n{drivers.stderr('b')}\n--- c:\n{drivers.stderr('c')}")  # a str: shown whole
    assert not any("Traceback" in drivers.stderr(d) for d in ("b", "c"))
    study = load(storage, name, tmp_path)
    done = assert_exact(study, 12)
    leases = read_leases(study)
    killed = next(i for i, info in leases.items() if info.pid == victim.pid)
    assert not leases[killed].ended
    lost = [t for t in study.trials if t.user_attrs.get(ATTR_DRIVER) == killed and t.state != TrialState.COMPLETE]
    assert lost and {t.number for t in lost} <= interrupted(study.trials)  # left running, then interrupted
    for t in lost:  # each rerun once, by another driver, with every parameter it had (a driver killed between
        # asking a trial and sampling it leaves some or none: the rerun samples those)
        reruns = [r for r in done if r.user_attrs.get(ATTR_REPLACES) == t.number]
        assert len(reruns) == 1 and t.params.items() <= reruns[0].params.items(), (t.params, reruns)
        assert reruns[0].user_attrs[ATTR_DRIVER] != killed
    assert "which is gone; rerunning it" in drivers.stderr("b") + drivers.stderr("c")


def test_a_second_driver_started_midway_keeps_the_budget(tmp_path: Path) -> None:
    """The first driver has finished some trials and sits between trials (one slot) when the second
    starts: together they run exactly n_trials (both used to count only what had finished at their
    start: 6 asked, 10 ran)."""
    storage = str(tmp_path / "shared.journal")
    spec, name = write_spec(tmp_path, storage, n_trials=6, seconds=0.5, max_concurrent=1)
    drivers = Drivers(tmp_path, spec, storage)
    drivers.start("a")
    deadline = time.monotonic() + 120
    while len(list((tmp_path / "a").glob("trials/*/result.json"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    drivers.start("b")
    codes = drivers.wait()
    assert codes == {"a": 0, "b": 0}, (drivers.stderr("a"), drivers.stderr("b"))
    done = assert_exact(load(storage, name, tmp_path), 6)
    assert len(done) == 6


def test_a_grid_across_two_drivers_runs_every_point_once(tmp_path: Path) -> None:
    storage = str(tmp_path / "shared.journal")
    space = {"x": {"type": "categorical", "choices": [0.1, 0.5, 0.9]}, "k": {"type": "int", "low": 0, "high": 3}}
    spec, name = write_spec(tmp_path, storage, n_trials=None, seconds=0.5, space=space, algorithm="grid")
    drivers = Drivers(tmp_path, spec, storage)
    drivers.start("a")
    drivers.start("b")
    codes = drivers.wait()
    assert codes == {"a": 0, "b": 0}, (drivers.stderr("a"), drivers.stderr("b"))
    done = assert_exact(load(storage, name, tmp_path), 12)
    points = sorted((t.params["x"], t.params["k"]) for t in done)
    assert points == sorted((x, k) for x in (0.1, 0.5, 0.9) for k in range(4))  # each point exactly once
    assert len({t.user_attrs[ATTR_DRIVER] for t in done}) == 2
