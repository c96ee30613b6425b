"""The compss engine's protocol: result and report files, compss_wait_on mapping, cancel, pruning,
the sequential fallback and the missing-pycompss errors. The runtime API is faked where needed."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines import TrialReport, TrialResult, make_engine
from hpoflow.engines.compss import CompssEngine, TaskShape
from hpoflow.engines.compss import CompssOptions as Opts
from hpoflow.engines.compss import engine as compss_mod
from hpoflow.errors import EngineError
from hpoflow.fileio import write_atomic, write_json_atomic
from hpoflow.train.transport import FileChannel, ReportReader, TrialFiles
from tests.engines._fakes import make_request, rank_processes


class FakeFuture:
    def __init__(self, value: Any) -> None:
        self.value = value


class FakeApi:
    """The parts of pycompss.api.api the engine uses."""

    def __init__(self) -> None:
        self.waited: list[Any] = []
        self.cancelled: list[str] = []
        self.groups: list[str] = []
        self.wait_value: Any = None

    def TaskGroup(self, name: str, implicit_barrier: bool = True) -> Any:
        self.groups.append(name)
        assert implicit_barrier is False

        class _Ctx:
            def __enter__(self) -> None:
                return None

            def __exit__(self, *exc: object) -> None:
                return None

        return _Ctx()

    def compss_wait_on(self, fut: FakeFuture) -> Any:
        self.waited.append(fut)
        return self.wait_value

    def compss_cancel_group(self, name: str) -> None:
        self.cancelled.append(name)


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[CompssEngine, FakeApi]]:
    fake = FakeApi()
    monkeypatch.setattr(compss_mod, "runtime_active", lambda: True)
    monkeypatch.setattr(compss_mod, "api", lambda: fake)
    eng = CompssEngine(run_dir=tmp_path, sequential=False, poll_interval_s=0.02, heartbeat_timeout_s=1)
    monkeypatch.setattr(eng, "_task_for", lambda req, shape: (lambda *a: FakeFuture(a)))
    yield eng, fake
    eng._trials.clear()
    eng.close()


def test_write_atomic_and_partial_report_lines(tmp_path: Path) -> None:
    path = tmp_path / "d" / "x.json"
    write_atomic(path, '{"a": 1}')
    assert path.read_text() == '{"a": 1}' and [p.name for p in path.parent.iterdir()] == ["x.json"]
    reports = tmp_path / "r.jsonl"
    reader = ReportReader(reports)
    assert reader.read_new() == []  # no file yet
    reports.write_text('{"step": 1}\n{"step": 2, "metr')
    assert reader.read_new() == [{"step": 1}]  # the torn second line waits
    with open(reports, "a") as f:
        f.write('ics": {}}\n')
    assert reader.read_new() == [{"step": 2, "metrics": {}}]


def test_results_come_from_files_and_partial_files_are_ignored(runtime: tuple[CompssEngine, FakeApi],
                                                               tmp_path: Path) -> None:
    eng, fake = runtime
    req = make_request(tmp_path / "trials" / "0", 0)
    eng.submit(req)
    assert fake.groups == ["trial-0"] and eng.running() == [0]
    files = TrialFiles(Path(req.trial_dir), 0)
    (files.dir / ".result.json.abc.tmp").write_text('{"status": "comp')  # a write in progress
    with open(files.reports, "w") as f:
        f.write('{"seq": 0, "step": 1, "metrics": {"loss": 0.5}, "wants_answer": false}\n{"seq": 1, "st')
    events = eng.poll(0.2)
    assert events == [TrialReport(0, 1, {"loss": 0.5}, False)]
    assert eng.poll(0.1) == [] and fake.waited == []  # no result.json yet: nobody waits on the future
    fake.wait_value = {"number": 0, "status": "complete", "value": 0.1}
    with open(files.reports, "a") as f:
        f.write('ep": 2, "metrics": {"loss": 0.1}, "wants_answer": false}\n')
    write_json_atomic(files.result, {"number": 0, "status": "complete", "value": 0.1, "metrics": {"loss": 0.1}})
    events = eng.poll(1.0)
    assert isinstance(events[0], TrialReport) and events[0].step == 2  # reports before the result
    assert isinstance(events[1], TrialResult) and events[1].status == "complete" and events[1].value == 0.1
    assert len(fake.waited) == 1 and eng.running() == []


def test_wait_on_none_means_the_task_crashed(runtime: tuple[CompssEngine, FakeApi], tmp_path: Path) -> None:
    eng, fake = runtime
    req = make_request(tmp_path / "trials" / "3", 3)
    eng.submit(req)
    files = TrialFiles(Path(req.trial_dir), 0)
    files.heartbeat.write_text("x")
    old = time.time() - 60
    os.utime(files.heartbeat, (old, old))  # the task's heartbeat stopped long ago, no result file
    fake.wait_value = None
    (res,) = eng.poll(2.0)
    assert isinstance(res, TrialResult) and res.status == "failed" and res.retryable
    assert "crashed" in (res.error or "") and "heartbeat" in (res.error or "")


def test_on_failure_default_from_wait_on_is_a_failure_too(runtime: tuple[CompssEngine, FakeApi],
                                                          tmp_path: Path) -> None:
    eng, fake = runtime
    req = make_request(tmp_path / "trials" / "4", 4)
    eng.submit(req)
    files = TrialFiles(Path(req.trial_dir), 0)
    files.heartbeat.write_text("x")
    os.utime(files.heartbeat, (time.time() - 60, time.time() - 60))
    fake.wait_value = {"status": "failed", "compss_default": True, "error": "default"}
    (res,) = eng.poll(2.0)
    assert isinstance(res, TrialResult) and res.status == "failed" and "crashed" in (res.error or "")


def test_cancel_writes_stop_and_cancels_a_queued_group(runtime: tuple[CompssEngine, FakeApi],
                                                       tmp_path: Path) -> None:
    eng, fake = runtime
    req = make_request(tmp_path / "trials" / "5", 5, attempt=1)
    eng.submit(req)
    eng.cancel(5, "pruned by the driver")
    files = TrialFiles(Path(req.trial_dir), 1)
    assert files.stop.read_text().strip() == "pruned by the driver"
    assert fake.cancelled == ["trial-5.1"]  # not started (no heartbeat): COMPSs must not start it
    write_json_atomic(files.result, {"number": 5, "status": "cancelled", "error": "cancelled (STOP file)"})
    (res,) = eng.poll(1.0)
    assert isinstance(res, TrialResult) and res.status == "cancelled"


def test_pruning_answer_reaches_rank_zero_through_files(runtime: tuple[CompssEngine, FakeApi],
                                                        tmp_path: Path) -> None:
    eng, _ = runtime
    req = make_request(tmp_path / "trials" / "6", 6)
    eng.submit(req)
    channel = FileChannel(TrialFiles(Path(req.trial_dir), 0), answer_timeout_s=20)
    got: list[bool] = []
    th = threading.Thread(target=lambda: got.append(channel.report(3, {"loss": 0.7}, True)))
    th.start()
    events: list[Any] = []
    t0 = time.monotonic()
    while not events and time.monotonic() - t0 < 10:
        events = eng.poll(0.2)
    assert events == [TrialReport(6, 3, {"loss": 0.7}, True)]
    eng.answer(6, True)
    th.join(10)
    assert got == [True]


def test_one_shape_per_application(tmp_path: Path) -> None:
    req = make_request(tmp_path, 0, processes=8, nodes=2, cpus_per_process=3, gpus_per_process=1, timeout=100)
    opts = Opts()
    shape = opts.task_shape(req)
    assert shape == TaskShape(nodes=2, computing_units=12, gpus=4, time_out=220)
    eng = CompssEngine(run_dir=tmp_path, sequential=True, shape=shape)  # sequential: no task to build
    other = make_request(tmp_path, 1, processes=2)
    with pytest.raises(EngineError, match="one COMPSs application runs one shape"):
        eng._task_for(other, opts.task_shape(other))
    eng.close()


def test_options_are_validated() -> None:
    with pytest.raises(EngineError, match=r"compss.lancher: unknown option \(did you mean 'launcher'\?\)"):
        Opts.from_mapping({"lancher": "srun"})
    with pytest.raises(EngineError, match="must be one of mpirun, srun, ssh"):
        Opts.from_mapping({"launcher": "pdsh"})
    assert Opts.from_mapping({"srun_args": [], "env": {"A": 1}}).env == {"A": "1"}


def test_missing_pycompss_gives_install_steps_unless_sequential(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    for mod in ("pycompss", "pycompss.api", "pycompss.api.api", "pycompss.util", "pycompss.util.context"):
        monkeypatch.setitem(sys.modules, mod, None)
    with pytest.raises(EngineError, match=r"pip install -e '\.\[compss\]'"):
        make_engine("compss", run_dir=tmp_path)
    with pytest.raises(EngineError, match="needs the COMPSs runtime"):
        CompssEngine(run_dir=tmp_path, sequential=False)
    eng = CompssEngine(run_dir=tmp_path, sequential=True)
    assert eng.sequential and eng.capacity(make_request(tmp_path, 0)) == 1
    with pytest.raises(EngineError, match="needs the COMPSs runtime"):
        eng.submit(make_request(tmp_path / "0", 0, processes=2, nodes=2))
    eng.close()


def test_hpoflow_run_with_engine_compss_without_pycompss_exits_2(monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    for mod in ("pycompss", "pycompss.api", "pycompss.api.api", "pycompss.util", "pycompss.util.context"):
        monkeypatch.setitem(sys.modules, mod, None)
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "study: {name: c, metric: val_accuracy, direction: maximize}\n"
        "space: {lr: {type: float, low: 0.001, high: 0.01}}\n"
        "search: {algorithm: random, n_trials: 1}\n"
        "training: {model: mlp, epochs: 1, lr: '${lr}'}\n"
        "engine: compss\n"
    )
    from hpoflow.cli.main import main

    assert main(["run", str(spec), "--run-dir", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "PyCOMPSs" in err and "install" in err and "module load COMPSs" in err


def test_sequential_engine_runs_prunes_and_cancels_real_trials(tmp_path: Path) -> None:
    eng = CompssEngine(run_dir=tmp_path, sequential=True, poll_interval_s=0.05)
    try:
        req = make_request(tmp_path / "0", 0, "trainfns:report_epochs", metric="score", pruning=True)
        req = type(req)(**{**req.__dict__, "params": {"x": 1.0}})
        eng.submit(req)
        seen: list[Any] = []
        while not any(isinstance(e, TrialResult) for e in seen):
            for ev in eng.poll(5.0):
                seen.append(ev)
                if isinstance(ev, TrialReport) and ev.wants_answer:
                    eng.answer(0, ev.step >= 2)  # prune at the second report
        reports = [e for e in seen if isinstance(e, TrialReport)]
        assert [r.step for r in reports] == [1, 2]
        assert seen[-1].status == "pruned" and seen[-1].metrics["score"] == 2.0

        slow = make_request(tmp_path / "1", 1, "trainfns:spawn_child_and_sleep", processes=1)
        eng.submit(slow)
        pid_file = tmp_path / "1" / "grandchild.pid"
        t0 = time.monotonic()
        while not pid_file.exists() and time.monotonic() - t0 < 60:
            assert eng.poll(0.1) == []
        eng.cancel(1, "study stopped")
        (res,) = eng.poll(30.0)
        assert isinstance(res, TrialResult) and res.status == "cancelled"
        assert not rank_processes(str(tmp_path / "1" / "attempt-0" / "job.json"))
        import psutil

        pid = int(pid_file.read_text())
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    finally:
        eng.close()
