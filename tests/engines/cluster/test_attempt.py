"""The compss task body with real rank processes: failure mapping, STOP-file cancellation, no orphans."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil

from hpoflow.engines.cluster.attempt import _plan, run_trial
from hpoflow.fileio import write_json_atomic
from hpoflow.train.transport import TrialFiles
from tests.engines._fakes import make_request, rank_processes


def _wait_for(path: Path, limit: float = 60.0) -> None:
    t0 = time.monotonic()
    while not path.exists():
        if time.monotonic() - t0 > limit:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def _gone(pids: list[int], limit: float = 10.0) -> bool:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_exception_killed_rank_and_timeout_become_failed_results(tmp_path: Path) -> None:
    boom = make_request(tmp_path / "0", 0, "trainfns_light:fail", processes=1, timeout=120)
    crash = make_request(tmp_path / "1", 1, "trainfns:crash_rank1", processes=2, timeout=120)
    slow = make_request(tmp_path / "2", 2, "trainfns_light:sleepy", processes=1, timeout=4, options={"seconds": 60})
    t0 = time.monotonic()
    with ThreadPoolExecutor(3) as pool:  # independent trials, run at once to keep the suite short
        futures = [pool.submit(run_trial, r.to_json(), "{}") for r in (boom, crash, slow)]
        r_boom, r_crash, r_slow = (f.result() for f in futures)
    assert r_boom["status"] == "failed" and not r_boom["retryable"]
    assert "ValueError: boom from user code" in r_boom["error"] and "rank 0" in r_boom["error"]
    assert "about to fail" in r_boom["stderr_tail"] and "Traceback" in r_boom["stderr_tail"]
    assert r_crash["status"] == "failed" and r_crash["retryable"], r_crash
    assert "rank" in r_crash["error"]
    assert r_slow["status"] == "failed" and not r_slow["retryable"] and "timed out after 4 s" in r_slow["error"]
    assert time.monotonic() - t0 < 60
    # the result file is the same result, written atomically next to the rank logs
    on_disk = json.loads((tmp_path / "0" / "attempt-0" / "result.json").read_text())
    assert on_disk["status"] == "failed" and on_disk["error"] == r_boom["error"]
    for n in (0, 1, 2):
        assert not rank_processes(str(tmp_path / str(n) / "attempt-0" / "job.json"))


def test_stop_file_kills_ranks_and_their_children_without_the_task(tmp_path: Path) -> None:
    """A cancelled COMPSs task's children survive it: the node launcher and its ranks must die by
    themselves when STOP appears, grandchildren included. Nobody else kills them here."""
    req = make_request(tmp_path / "0", 0, "trainfns:spawn_child_and_sleep", processes=2, timeout=120)
    files = TrialFiles(Path(req.trial_dir), 0)
    files.dir.mkdir(parents=True)
    cmds, job = _plan(req, files, {}, dict(os.environ))
    write_json_atomic(files.job, job)
    launcher = subprocess.Popen(cmds[0], start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    try:
        _wait_for(Path(req.trial_dir) / "grandchild.pid")
        grandchild = int((Path(req.trial_dir) / "grandchild.pid").read_text())
        # the node launcher and two ranks; a rank forking its child shows the rank's command line until
        # the child execs, so a count taken at that moment is one more: count again (30 s bounds a hang)
        deadline = time.monotonic() + 30
        while len(ranks := rank_processes(str(files.job))) != 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(ranks) == 3, ranks
        files.stop.write_text("stop\n")
        assert launcher.wait(10) != 0
        assert _gone([*ranks, grandchild]), "a rank or its child survived STOP"
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, 9)
            launcher.wait()
        else:
            try:
                os.killpg(launcher.pid, 9)
            except ProcessLookupError:
                pass


def test_stop_before_start_gives_a_cancelled_result_at_once(tmp_path: Path) -> None:
    req = make_request(tmp_path / "0", 0, processes=1)
    files = TrialFiles(Path(req.trial_dir), 0)
    files.dir.mkdir(parents=True)
    files.stop.write_text("stop\n")
    res = run_trial(req.to_json(), "{}")
    assert res["status"] == "cancelled"
    assert not files.job.exists()


def test_bad_arguments_never_raise() -> None:
    res = run_trial("{not json", "{}")
    assert res["status"] == "failed" and "bad task arguments" in res["error"]


def test_heartbeat_is_written_while_the_task_runs(tmp_path: Path) -> None:
    req = make_request(tmp_path / "0", 0, "trainfns_light:sleepy", processes=1, options={"seconds": 60})
    files = TrialFiles(Path(req.trial_dir), 0)
    th = threading.Thread(target=run_trial, args=(req.to_json(), "{}"))
    th.start()
    try:
        _wait_for(files.heartbeat, 10)
        assert files.heartbeat.read_text().split()[2] == str(os.getpid())
    finally:
        files.stop.write_text("stop\n")
        th.join(30)
    assert not th.is_alive()
    assert json.loads(files.result.read_text())["status"] == "cancelled"
