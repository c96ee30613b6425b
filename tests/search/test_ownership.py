"""Exact ownership among drivers that share a study, on every storage: a PBT study's one owner and the
promotion of a paused trial are claims (``hpoflow.run.claims``), raced here by two drivers released at
once, 20 times; leases are judged by beats on this host's clock only; and an attempt's checkpoints are
fenced off from older attempts that still run (``hpoflow.run.fencing``)."""

from __future__ import annotations

import copy
import os
import queue
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import optuna
import pytest
import torch
from optuna.trial import TrialState

from hpoflow.engines.threads import Reporter, ThreadEngine
from hpoflow.errors import OwnerLost, StudyTaken
from hpoflow.fileio import write_atomic
from hpoflow.run.claims import Claims
from hpoflow.run.fencing import attempt_dir, current, link_tree
from hpoflow.run.lease import LEASE_PREFIX, LeaseWatch, first_alive, lease_rows, read_leases
from hpoflow.run.ledger import ATTR_BRACKET, ATTR_NEXT_ATTEMPT, ATTR_PAUSED, ATTR_RUNGS
from hpoflow.run.storage import open_storage
from hpoflow.search.driver import Driver
from hpoflow.spec import spec_from_mapping
from hpoflow.train.checkpoint import make_checkpointer
from tests.infra.fixtures import USES_POSTGRES

ROUNDS = 20
STORAGES = ["journal", "sqlite", pytest.param("postgresql", marks=USES_POSTGRES)]
BASE: dict[str, Any] = {
    "study": {"name": "own", "metric": "score", "direction": "maximize"},
    "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
    "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 2, "seed": 3},
    "training": {"function": "trainfns:counter", "epochs": 2},
}


def _spec(**search: Any) -> Any:
    data = copy.deepcopy(BASE)
    data["search"].update(search)
    return spec_from_mapping(data)


def _url(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> str:
    if kind == "journal":
        return str(tmp_path / "shared.journal")
    if kind == "sqlite":
        return f"sqlite:///{request.getfixturevalue('db_dir') / 'shared.db'}"
    return str(request.getfixturevalue("postgres_url"))  # skips where no PostgreSQL server can run


@pytest.fixture
def db_dir(tmp_path: Path) -> Iterator[Path]:
    """Where a test's SQLite file goes: a tmpfs where the machine has one. SQLite fsyncs every commit (5 ms
    on a virtual disk) and each race here makes hundreds; what is tested does not depend on the medium."""
    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        yield tmp_path
        return
    d = Path(tempfile.mkdtemp(dir=shm, prefix="hpoflow-test-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _storages(url: str, tmp_path: Path) -> list[optuna.storages.BaseStorage]:
    """One storage object per driver, as two driver processes have."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return [open_storage(url, tmp_path) for _ in range(2)]


def _race(fns: list[Any]) -> list[Any]:
    """Run ``fns`` in threads released together by a barrier; their results (or the exceptions raised)."""
    barrier = threading.Barrier(len(fns))
    out: list[Any] = [None] * len(fns)

    def go(i: int) -> None:
        barrier.wait(timeout=60)
        try:
            out[i] = fns[i]()
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


@pytest.mark.parametrize("kind", STORAGES)
def test_two_pbt_drivers_started_together_never_both_own_the_study(
        tmp_path: Path, request: pytest.FixtureRequest, kind: str) -> None:
    """Two PBT drivers of one study start at the same moment, 20 times: every time exactly one proceeds
    (its trials run, held until the other has decided) and the other is refused in one line, before it
    asked or enqueued anything; the storage names one owner."""
    url = _url(kind, tmp_path, request)
    storages = _storages(url, tmp_path)
    spec = _spec(scheduler={"type": "pbt", "population": 2, "interval": 1})
    for r in range(ROUNDS):
        _one_pbt_race(storages, spec, tmp_path / f"r{r}")


def _one_pbt_race(storages: list[optuna.storages.BaseStorage], spec: Any, tmp_path: Path) -> None:
    name = f"pbt-{uuid.uuid4().hex[:8]}"
    optuna.create_study(storage=storages[0], study_name=name, direction="maximize")
    release = threading.Event()  # holds the trials of the driver that proceeds until the other has decided
    refused: queue.Queue[StudyTaken] = queue.Queue()

    def held(params: dict[str, Any], reporter: Reporter) -> float:
        release.wait(timeout=120)
        return 1.0

    drivers = [Driver(spec, optuna.load_study(study_name=name, storage=s), ThreadEngine(held, slots=2),
                      tmp_path / f"d{i}") for i, s in enumerate(storages)]

    def run(d: Driver) -> Any:
        try:
            return d.run()
        except StudyTaken as exc:
            refused.put(exc)
            raise

    out: list[Any] = []
    racing = threading.Thread(target=lambda: out.extend(_race([lambda d=d: run(d) for d in drivers])))
    racing.start()
    try:
        refused.get(timeout=60)  # (queue.Empty here: neither was refused, both proceeded)
    finally:
        release.set()
        racing.join(timeout=120)
        for d in drivers:
            d.engine.close()
    assert len(out) == 2 and [type(o) for o in out].count(StudyTaken) == 1, out
    lost = 0 if isinstance(out[0], StudyTaken) else 1
    winner, loser = drivers[1 - lost], drivers[lost]
    assert not isinstance(out[1 - lost], Exception), out
    assert "\n" not in str(out[lost]) and "pbt runs with one driver per study" in str(out[lost])
    assert not loser.engine.submitted and winner.summary.n_complete == 2  # type: ignore[attr-defined]
    study = optuna.load_study(study_name=name, storage=storages[0])
    assert Claims(study).holders("pbt-owner:") == {"pbt-owner:0": winner.shared.lease.id}
    assert len(study.trials) == 2  # the refused driver asked nothing and enqueued nothing


def _paused_study(storage: optuna.storages.BaseStorage) -> tuple[str, int]:
    """A study with one paused trial that has earned promotion (ASHA, eta 2: the better of two at rung 1)."""
    name = f"asha-{uuid.uuid4().hex[:8]}"
    study = optuna.create_study(storage=storage, study_name=name, direction="maximize")
    paused, other = study.ask({"x": optuna.distributions.FloatDistribution(0.0, 1.0)}), study.ask()
    for t, value in ((paused, 0.9), (other, 0.1)):
        t.set_user_attr(ATTR_RUNGS, {"1": value})
        t.set_user_attr(ATTR_BRACKET, 0)
    study.tell(other, state=TrialState.PRUNED)
    paused.set_user_attr(ATTR_NEXT_ATTEMPT, 1)
    paused.set_user_attr(ATTR_PAUSED, 1)  # last, as Scheduling.paused writes it
    return name, paused.number


@pytest.mark.parametrize("kind", STORAGES)
def test_one_paused_trial_promoted_by_two_drivers_at_once_runs_once(
        tmp_path: Path, request: pytest.FixtureRequest, kind: str) -> None:
    """Two drivers with a free slot try to promote the same paused trial at the same moment, 20 times:
    the promotion is a compare-and-set on the trial's pause in the storage, so it runs once."""
    url = _url(kind, tmp_path, request)
    storages = _storages(url, tmp_path)
    spec = _spec(n_trials=4, scheduler={"type": "asha", "reduction_factor": 2})
    for r in range(ROUNDS):
        name, number = _paused_study(storages[0])
        drivers = [Driver(spec, optuna.load_study(study_name=name, storage=s), ThreadEngine(lambda p, rep: 1.0),
                          tmp_path / f"r{r}-d{i}") for i, s in enumerate(storages)]
        for d in drivers:
            d.shared.lease.start()
        try:
            won = _race([d._promote for d in drivers])
        finally:
            for d in drivers:
                d.shared.lease.end()
                d.engine.close()
        assert sorted(won) == [False, True], won
        runs = [req for d in drivers for req in d.engine.submitted]  # type: ignore[attr-defined]
        assert [(req.number, req.attempt) for req in runs] == [(number, 1)]
        study = optuna.load_study(study_name=name, storage=storages[0])
        assert study.trials[number].user_attrs[ATTR_PAUSED] is None  # resumed, by the one that won


def _write_lease(study: optuna.Study, driver_id: str, *, beat: int, wall: float, lease_s: float) -> None:
    """A lease as a driver of another machine writes it, its wall clock ``wall`` (skewed as the test says)."""
    study._storage.set_study_system_attr(study._study_id, LEASE_PREFIX + driver_id, {
        "host": "elsewhere", "pid": 4242, "run_dir": "/far/run", "started": wall, "beat": beat, "time": wall,
        "lease_s": lease_s, "machine": "elsewhere/boot/1", "pid_start": None, "ended": False, "pbt": True})


def test_a_lease_is_judged_by_its_beats_on_this_hosts_clock_never_by_its_writers_clock() -> None:
    """A driver whose wall clock is hours behind but which beats is alive; one whose clock is hours
    ahead but which stopped beating is dead once its beat has not moved for its lease_s on this host's
    monotonic clock. No reading compares the two hosts' clocks (status says "unknown" for both)."""
    study = optuna.create_study()
    behind, ahead = time.time() - 5 * 3600, time.time() + 5 * 3600
    _write_lease(study, "behind", beat=1, wall=behind, lease_s=2.0)
    _write_lease(study, "ahead", beat=7, wall=ahead, lease_s=1.0)
    stop = threading.Event()

    def beating() -> None:  # the driver behind beats (its clock stays 5 h behind)
        beat = 1
        while not stop.wait(0.05):
            beat += 1
            _write_lease(study, "behind", beat=beat, wall=behind + beat, lease_s=2.0)

    beater = threading.Thread(target=beating)
    beater.start()
    try:
        alive = first_alive(study, lambda info: info.id == "behind", "me")
        assert alive is not None and alive.id == "behind"
        t0 = time.monotonic()
        assert first_alive(study, lambda info: info.id == "ahead", "me") is None
        assert time.monotonic() - t0 >= 1.0  # dead only after its lease_s without a beat, on this clock
        watch = LeaseWatch("me", 60.0)
        watch.update(read_leases(study), 100.0)
        watch.update(read_leases(study), 101.5)  # 1.5 s of this host's clock: ahead's lease_s is 1 s
        assert watch.dead("ahead", 101.5)
        assert {row["id"]: row["state"] for row in lease_rows(study, {})} == {"behind": "unknown", "ahead": "unknown"}
    finally:
        stop.set()
        beater.join()


def test_a_stale_attempt_writes_where_the_current_attempt_never_reads(tmp_path: Path) -> None:
    """Trial 3's first attempt is given up for dead (its driver cut off by a partition) while trial 9
    reruns it from its checkpoints: the rerun's directory takes them, so what the stale attempt writes
    afterwards lands where no newer attempt reads, nor the rerun's retry after it."""
    root = tmp_path / "a" / "trials" / "3" / "checkpoints"

    def checkpointer(directory: Path) -> Any:
        return make_checkpointer("replica", {}, directory, keep=5, background=False)

    stale = checkpointer(attempt_dir(root, root.parent, 3, 0))  # the chain's first attempt: the root itself
    stale.save({"w": torch.tensor([1.0])}, 1)
    rerun_dir = attempt_dir(root, tmp_path / "b" / "trials" / "9", 9, 0)  # another driver's rerun, trial 9
    assert rerun_dir == root.with_name("checkpoints.9.0") and current(root) == rerun_dir
    rerun = checkpointer(rerun_dir)
    step, state = rerun.latest()
    assert step == 1 and state["w"].item() == 1.0  # it resumes from the stale attempt's checkpoint of before
    stale.save({"w": torch.tensor([2.0])}, 2)  # the stale attempt goes on writing
    assert rerun.latest()[0] == 1  # never read by the current attempt
    rerun.save({"w": torch.tensor([10.0])}, 2)
    retry_dir = attempt_dir(root, tmp_path / "b" / "trials" / "9", 9, 1)  # the rerun's retry
    assert current(root) == retry_dir
    step, state = checkpointer(retry_dir).latest()
    assert step == 2 and state["w"].item() == 10.0  # the rerun's own step 2, not the stale one's
    assert checkpointer(root).latest()[1]["w"].item() == 2.0  # the stale write is there, unread


def test_a_pbt_copy_is_hard_links_that_neither_side_writes_through(tmp_path: Path) -> None:
    """PBT's exploit copies a donor's checkpoints as hard links (no data copied on the driver's loop), and
    every write in a checkpoint directory renames a new file into place: the donor's files never change."""
    donor, child = tmp_path / "donor", tmp_path / "child"
    write_atomic(donor / "ckpt-00000002-r0.pt", b"donor state")
    write_atomic(donor / "sub" / "virtual.json", b'{"epoch": 2}')
    link_tree(donor, child)
    assert os.stat(child / "ckpt-00000002-r0.pt").st_ino == os.stat(donor / "ckpt-00000002-r0.pt").st_ino
    write_atomic(child / "sub" / "virtual.json", b'{"epoch": 4}')
    write_atomic(child / "ckpt-00000002-r0.pt", b"child state")
    assert (donor / "ckpt-00000002-r0.pt").read_bytes() == b"donor state"
    assert (donor / "sub" / "virtual.json").read_bytes() == b'{"epoch": 2}'


def test_a_pbt_owner_of_another_host_is_taken_over_once_its_beat_stood_still_for_its_lease(tmp_path: Path) -> None:
    """The owner of a PBT study ran on another host (its clock 5 h ahead) and stopped beating: a new
    driver waits until the owner's beat has not moved for its lease_s on this host's clock, then takes
    the next epoch and runs the study. A stop while it waits ends the wait at once, claiming nothing."""
    storage = open_storage(str(tmp_path / "shared.journal"), tmp_path)
    study = optuna.create_study(storage=storage, study_name="own", direction="maximize")
    _write_lease(study, "far", beat=3, wall=time.time() + 5 * 3600, lease_s=1.0)
    assert Claims(study).claim("pbt-owner:0", "far") == "far"
    spec = _spec(scheduler={"type": "pbt", "population": 2, "interval": 1})

    stopped = Driver(spec, study, ThreadEngine(lambda p, r: 1.0, slots=2), tmp_path / "stopped")
    stopped.request_stop()  # a signal came before it could tell whether "far" runs
    assert stopped.run().stopped_by == "signal" and not study.trials
    assert Claims(study).holders("pbt-owner:") == {"pbt-owner:0": "far"}

    driver = Driver(spec, study, ThreadEngine(lambda p, r: 1.0, slots=2), tmp_path / "next")
    t0 = time.monotonic()
    summary = driver.run()
    assert time.monotonic() - t0 >= 1.0 and summary.n_complete == 2
    assert Claims(study).holders("pbt-owner:") == {"pbt-owner:0": "far", "pbt-owner:1": driver.shared.lease.id}


def test_an_owner_whose_study_was_taken_over_stops_before_it_enqueues_again(tmp_path: Path) -> None:
    """While the owner's trials ran, another driver judged it dead (a partition outlasting its lease) and
    claimed the next epoch: the old owner stops (exit code 1) before it enqueues a member's next interval."""
    storage = open_storage(str(tmp_path / "shared.journal"), tmp_path)
    study = optuna.create_study(storage=storage, study_name="own", direction="maximize")
    spec = _spec(n_trials=4, scheduler={"type": "pbt", "population": 2, "interval": 1})

    def taken_over(params: dict[str, Any], reporter: Reporter) -> float:
        Claims(study).claim("pbt-owner:1", "newer")  # the other driver's claim, made meanwhile
        return params["x"]

    driver = Driver(spec, study, ThreadEngine(taken_over, slots=2), tmp_path / "old")
    with pytest.raises(OwnerLost, match="took this pbt study over") as e:
        driver.run()
    assert e.value.exit_code == 1 and "\n" not in str(e.value)
    assert len(study.trials) == 2  # the two roots; no next interval was enqueued
