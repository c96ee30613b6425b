"""A study shared by several drivers, in one process: the budget verdict, leases, give-backs, and
drivers in threads on one journal file (each with its own storage object, as separate processes
have). The real processes are in test_multi_driver.py."""

from __future__ import annotations

import copy
import csv
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.engines.threads import Reporter, ThreadEngine
from hpoflow.run.lease import LEASE_PREFIX, Lease, LeaseInfo, LeaseWatch, read_leases
from hpoflow.run.ledger import ATTR_DRIVER, ATTR_GRID, ATTR_REPLACES, Tally, count_finished
from hpoflow.run.shared import SharedStudy
from hpoflow.run.storage import open_storage
from hpoflow.search.driver import Driver
from hpoflow.search.samplers import make_pruner, make_sampler
from hpoflow.spec import spec_from_mapping
from tests.conftest import ROOT

BASE: dict[str, Any] = {
    "study": {"name": "shared", "metric": "score", "direction": "maximize"},
    "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
    "search": {"algorithm": "random", "n_trials": 12, "max_concurrent": 2, "seed": 3},
    "training": {"function": "trainfns:counter"},
}


def spec_of(**search: Any) -> Any:
    data = copy.deepcopy(BASE)
    data["search"].update(search)
    return spec_from_mapping(data)


def journal_study(path: Path, spec: Any) -> optuna.Study:
    """The study through a storage object of its own (what one driver process has)."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(storage=open_storage(str(path), path.parent), study_name="shared",
                               direction="maximize", sampler=make_sampler(spec.search),
                               pruner=make_pruner(spec.search.pruner), load_if_exists=True)


def test_the_verdict_admits_within_the_budget_and_lets_the_oldest_undecided_trial_wait(tmp_path: Path) -> None:
    study = optuna.create_study()
    tally = Tally()
    a = study.ask()
    tally.refresh(study)
    assert tally.verdict(a.number, budget=2) == "run"
    a.set_user_attr(ATTR_DRIVER, "d1")
    b, c = study.ask(), study.ask()  # two drivers asked at once for the last place
    tally.refresh(study)
    assert tally.verdict(b.number, budget=2) == "contended"  # the lower-numbered one waits for the other
    assert tally.verdict(c.number, budget=2) == "yield"  # the other goes back to the queue
    study._storage.set_trial_state_values(c._trial_id, TrialState.WAITING)
    tally.refresh(study)
    assert tally.verdict(b.number, budget=2) == "run"
    b.set_user_attr(ATTR_DRIVER, "d2")
    d = study.ask()  # pops c again: the budget is full now (two decided, none finished)
    tally.refresh(study)
    assert d.number == c.number and tally.verdict(d.number, budget=2) == "yield"
    study.tell(a, 1.0)
    study.tell(b, 1.0)
    tally.refresh(study)
    assert tally.finished == 2 and tally.verdict(d.number, budget=3) == "run"


def test_the_verdict_closes_a_second_copy_of_a_grid_point(tmp_path: Path) -> None:
    study = optuna.create_study()
    study.enqueue_trial({"x": 0.5}, user_attrs={ATTR_GRID: 7})
    study.enqueue_trial({"x": 0.5}, user_attrs={ATTR_GRID: 7})  # two drivers enqueued the same point
    tally = Tally()
    second = study.ask()  # pops the first copy
    tally.refresh(study)
    assert tally.verdict(second.number, budget=10) == "run"  # the other copy only waits: it yields to this
    second.set_user_attr(ATTR_DRIVER, "d1")
    third = study.ask()
    tally.refresh(study)
    assert tally.verdict(third.number, budget=10) == "duplicate"
    assert tally.grid_claimed == {7}


def test_a_trial_given_back_is_asked_again_through_another_journal_storage(tmp_path: Path) -> None:
    """RUNNING -> WAITING is seen by the journal's WAITING index of every process, not only the one that
    wrote it."""
    path = tmp_path / "s.journal"
    spec = spec_of()
    one, two = journal_study(path, spec), journal_study(path, spec)
    assert two.get_trials(states=(TrialState.WAITING,)) == []  # the index of `two` is built before the give-back
    shared = SharedStudy(one, tmp_path, 60.0)
    t = one.ask()
    x = t.suggest_float("x", 0.0, 1.0)
    shared.give_back(t, admitted=False)
    again = two.ask()
    assert again.number == t.number and again.suggest_float("x", 0.0, 1.0) == x  # with its parameters


def run_drivers_in_threads(path: Path, spec: Any, n: int, objective: Any) -> list[Driver]:
    drivers = [Driver(spec, journal_study(path, spec), ThreadEngine(objective, slots=2), path.parent / f"d{i}")
               for i in range(n)]
    errors: list[BaseException] = []

    def go(d: Driver) -> None:
        try:
            d.run()
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            d.engine.close()

    threads = [threading.Thread(target=go, args=(d,)) for d in drivers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not errors, errors
    return drivers


def sleepy(p: dict[str, Any], r: Reporter) -> float:
    import time

    time.sleep(0.02)
    return float(p.get("x", 0.0))


def test_three_drivers_in_threads_run_exactly_n_trials(tmp_path: Path) -> None:
    path = tmp_path / "s.journal"
    spec = spec_of(n_trials=30)
    drivers = run_drivers_in_threads(path, spec, 3, sleepy)
    study = journal_study(path, spec)
    assert count_finished(study) == 30
    assert all(t.state in (TrialState.COMPLETE, TrialState.WAITING) for t in study.trials)  # no failure made up
    assert sum(len(d.summary.results) for d in drivers) == 30  # none ran twice
    assert all(d.summary.n_complete == 30 and d.summary.exit_code == 0 for d in drivers)  # the study's counts
    xs = [t.params["x"] for t in study.trials if t.state == TrialState.COMPLETE]
    assert len(set(xs)) == 30  # reseeded: drivers of one seed do not draw the same configurations


def test_a_grid_shared_by_two_drivers_in_threads_runs_each_point_once(tmp_path: Path) -> None:
    path = tmp_path / "s.journal"
    data = copy.deepcopy(BASE)
    data["space"] = {"a": {"type": "int", "low": 0, "high": 4}, "b": {"type": "categorical", "choices": ["u", "v"]}}
    data["search"] = {"algorithm": "grid", "max_concurrent": 2}
    spec = spec_from_mapping(data)
    run_drivers_in_threads(path, spec, 2, lambda p, r: float(p["a"]))
    study = journal_study(path, spec)
    done = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert sorted((t.params["a"], t.params["b"]) for t in done) == [(a, b) for a in range(5) for b in "uv"]
    assert count_finished(study) == 10


def test_a_grid_of_a_billion_points_runs_its_budget_without_being_built(tmp_path: Path) -> None:
    data = copy.deepcopy(BASE)
    data["space"] = {f"p{i}": {"type": "int", "low": 0, "high": 9} for i in range(9)}
    data["search"] = {"algorithm": "grid", "n_trials": 2, "max_concurrent": 1}
    spec = spec_from_mapping(data)
    study = optuna.create_study(direction="maximize")
    driver = Driver(spec, study, ThreadEngine(lambda p, r: 1.0, slots=1), tmp_path)
    assert driver.grid is not None and driver.grid.size == 10**9
    driver.run()
    assert [t.params for t in study.trials] == [{f"p{i}": 0 for i in range(9)},
                                                {**{f"p{i}": 0 for i in range(8)}, "p8": 1}]


def lease(beat: int, *, ended: bool = False, lease_s: float = 10.0, pid: int = 1, machine: str = "other") -> LeaseInfo:
    return LeaseInfo("x", "h", pid, "/r", 0.0, beat, 0.0, lease_s, machine, None, ended)


def test_a_lease_is_dead_after_its_lease_s_without_a_beat_as_this_driver_sees_it() -> None:
    watch = LeaseWatch("me", 10.0)
    watch.update({"x": lease(1)}, now=100.0)
    watch.update({"x": lease(2)}, now=104.0)
    assert not watch.dead("x", 104.0)
    watch.update({"x": lease(2)}, now=108.0)
    watch.update({"x": lease(2)}, now=112.0)
    assert not watch.dead("x", 112.0)  # 8 s since its beat moved
    watch.update({"x": lease(2)}, now=114.5)
    assert watch.dead("x", 114.5)
    watch.update({"x": lease(3)}, now=115.0)
    assert not watch.dead("x", 115.0)  # it beat again


def test_a_gap_in_this_drivers_reads_restarts_the_observation() -> None:
    watch = LeaseWatch("me", 10.0)
    watch.update({"x": lease(5)}, now=0.0)
    watch.update({"x": lease(5)}, now=60.0)  # this driver stalled (or the storage was away) for a minute
    assert not watch.dead("x", 60.0)
    watch.update({"x": lease(5)}, now=64.0)
    watch.update({"x": lease(5)}, now=68.0)
    watch.update({"x": lease(5)}, now=70.0)
    assert watch.dead("x", 70.0)


def test_an_ended_lease_or_a_gone_process_of_this_machine_is_dead_at_once(tmp_path: Path) -> None:
    from hpoflow.run.lease import _machine

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    watch = LeaseWatch("me", 60.0)
    watch.update({"e": lease(1, ended=True), "g": lease(1, pid=int(gone.stdout), machine=_machine()),
                  "a": lease(1, pid=os.getpid(), machine=_machine())}, now=0.0)
    assert watch.dead("e", 0.0) and watch.dead("g", 0.0) and not watch.dead("a", 0.0)  # "a": this very process
    assert watch.any_other_alive(0.0)
    del watch.leases["a"]
    assert not watch.any_other_alive(0.0)


def test_a_lease_this_process_ended_is_dead_at_once_though_the_storage_missed_the_mark(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A study stopped by a storage outage and run again from the same script or notebook: the first
    driver's lease still looks alive in the storage (its end could not be written, its pid is this
    process), yet nothing of it runs. Its trials are rerun at once, not after its lease_s."""
    study = optuna.create_study()
    first = Lease(study, tmp_path, lease_s=3600.0)
    first.start()

    def down(ended: bool = False) -> None:
        raise OSError("Stale file handle")

    monkeypatch.setattr(first, "_write", down)
    first.end()
    from hpoflow.run.lease import _storage

    storage, study_id = _storage(study)
    record = storage.get_study_system_attrs(study_id)[LEASE_PREFIX + first.id]
    assert not record["ended"] and record["pid"] == os.getpid()  # what the storage holds
    info = read_leases(study)[first.id]
    watch = LeaseWatch("next", 3600.0)
    watch.update(read_leases(study), now=0.0)
    assert watch.dead(first.id, 0.0) and watch.orphaned(7, first.id, 0.0, {7})
    assert info.state() == "ended"


def test_status_lists_the_drivers_and_changes_nothing(tmp_path: Path) -> None:
    storage = tmp_path / "shared.journal"
    data = copy.deepcopy(BASE)
    data["search"]["n_trials"] = 3
    data["storage"] = str(storage)
    result = optimize(data, tmp_path / "run", engine=ThreadEngine(lambda p, r: p["x"], 2))
    assert result.summary.n_complete == 3
    rows = list(csv.DictReader((tmp_path / "run" / "trials.csv").open()))
    leases = read_leases(result.study)
    (only,) = leases.values()
    assert {r["driver"] for r in rows} == {only.label} and only.label == f"{only.host}:{os.getpid()}"
    before = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")}
    r = subprocess.run([sys.executable, "-m", "hpoflow", "status", str(tmp_path / "run"), "--json"],
                       capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, r.stderr
    drivers = json.loads(r.stdout)["drivers"]
    assert [(d["id"], d["state"], d["pid"], d["run_dir"], d["trials_running"]) for d in drivers] == [
        (only.id, "ended", os.getpid(), str(tmp_path / "run"), 0)]
    after = {p: (p.stat().st_size, p.stat().st_mtime_ns) for p in tmp_path.rglob("*")}
    assert after == before  # read-only: no file created or changed, the journal included


def test_a_lease_beats_from_its_thread_and_ends(tmp_path: Path) -> None:
    import time

    study = optuna.create_study()
    lease_ = Lease(study, tmp_path, lease_s=1.0)
    lease_.start()
    first = read_leases(study)[lease_.id].beat
    time.sleep(0.8)  # beats every 0.25 s; a loaded machine may delay some, not all
    assert read_leases(study)[lease_.id].beat > first
    lease_.end()
    info = read_leases(study)[lease_.id]
    assert info.ended and info.run_dir == str(tmp_path) and info.pid == os.getpid()


def test_a_dead_drivers_running_trial_is_rerun_with_its_checkpoints(tmp_path: Path) -> None:
    """A trial left RUNNING by a driver whose process is gone (a lease of this machine with a dead pid)
    is rerun at once by the next driver, from the dead driver's run directory's checkpoints."""
    path = tmp_path / "s.journal"
    spec = spec_of(n_trials=2)
    study = journal_study(path, spec)
    dead = Lease(study, tmp_path / "dead", 60.0)
    dead.start()
    dead._stop.set()  # the process is "killed": no more beats, never ended
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead._record["pid"] = int(gone.stdout)
    dead._write()
    t = study.ask()
    t.suggest_float("x", 0.0, 1.0)
    t.set_user_attr(ATTR_DRIVER, dead.id)
    (driver,) = run_drivers_in_threads(path, spec, 1, sleepy)
    study = journal_study(path, spec)
    rerun = next(r for r in study.trials if r.user_attrs.get(ATTR_REPLACES) == t.number)
    assert rerun.state == TrialState.COMPLETE and rerun.params == study.trials[t.number].params
    assert rerun.user_attrs["checkpoint_dir"] == str(tmp_path / "dead" / "trials" / str(t.number) / "checkpoints")
    assert count_finished(study) == 2 and driver.summary.n_complete == 2



def test_a_driver_whose_trial_was_taken_over_goes_on_without_a_traceback(tmp_path: Path,
                                                                        caplog: Any) -> None:
    """Another driver judged this one dead (it stalled for longer than search.lease_s) and reran its
    trial: this driver's result for it is dropped with a warning, and the study still ends exact."""
    import time

    path = tmp_path / "s.journal"
    spec = spec_of(n_trials=3, max_concurrent=1)
    other = journal_study(path, spec)
    taken: list[int] = []

    def objective(p: dict[str, Any], r: Reporter) -> float:
        if not taken:  # the first trial: "another driver" interrupts it while it runs
            (running,) = other.get_trials(states=(TrialState.RUNNING,))
            SharedStudy(other, tmp_path, 60.0).interrupt(running.number, running.params, {})
            taken.append(running.number)
        time.sleep(0.01)
        return float(p["x"])

    with caplog.at_level("WARNING", logger="hpoflow"):
        (driver,) = run_drivers_in_threads(path, spec, 1, objective)
    study = journal_study(path, spec)
    assert count_finished(study) == 3 and driver.summary.n_complete == 3
    assert study.trials[taken[0]].state == TrialState.FAIL
    rerun = next(t for t in study.trials if t.user_attrs.get(ATTR_REPLACES) == taken[0])
    assert rerun.state == TrialState.COMPLETE and rerun.params == study.trials[taken[0]].params
    assert "was finished by another driver" in caplog.text


def test_a_driver_alone_does_not_read_every_trial_per_start(tmp_path: Path, monkeypatch: Any) -> None:
    """Alone on its study, a driver admits a trial from the leases (no other driver alive), not from a
    read of all trials: reading every trial at every start would make a 10,000-trial study slower
    per trial as it grows (bench/driver_scale.py)."""
    reads = {"n": 0}
    original = Tally.refresh

    def counting(self: Tally, study: optuna.Study) -> Any:
        reads["n"] += 1
        return original(self, study)

    monkeypatch.setattr(Tally, "refresh", counting)
    path = tmp_path / "s.journal"
    spec = spec_of(n_trials=60)
    (driver,) = run_drivers_in_threads(path, spec, 1, lambda p, r: 0.0)
    assert driver.summary.n_complete == 60 and count_finished(journal_study(path, spec)) == 60
    assert reads["n"] < 10  # the start, the end, and a beat interval or two
