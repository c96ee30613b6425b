"""Trials start processes as a program does (``hpoflow.train.processes``): a training function and a warm
command trial that use ``DataLoader(num_workers=2)``, ``torch.multiprocessing.spawn``, a ``Pool`` and
``mp.Process`` complete on the local engine, and none of the processes they started outlives the trial,
also when the driver is SIGKILLed. The code is ``tests/procprog.py``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from optuna.trial import TrialState

from hpoflow.api import optimize
from tests.conftest import ROOT, RUN_ENV

pytestmark = pytest.mark.slow  # real torch processes: DataLoader workers, spawned interpreters, pools

SCORE = 2016.0 + 3.0 + 30.0  # procprog's DataLoader sum, spawned ranks, pool (see its docstring)


def _spec(name: str, training: dict[str, Any], n: int = 1, hold: float = 0.0) -> dict[str, Any]:
    # one slot: a second trial runs in the worker the first ran in (what the first started is reset between)
    return {"study": {"name": name, "metric": "score", "direction": "maximize"},
            "space": {"hold": {"type": "categorical", "choices": [hold]}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": 1, "seed": 0},
            "training": training, "resources": {"processes": 1, "cpus_per_process": 1}}


def _started(run_dir: Path) -> list[int]:
    return [int(p.read_text()) for p in run_dir.glob("trials/*/pids/*")]


def _alive(pids: list[int]) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def _wait_all_gone(pids: list[int], bound_s: float) -> list[int]:
    """The pids still alive after ``bound_s`` (generous: the kill is at once, the bound is for a loaded machine)."""
    end = time.monotonic() + bound_s
    while (alive := _alive(pids)) and time.monotonic() < end:
        time.sleep(0.1)
    return alive


def _kinds(run_dir: Path, number: int) -> set[str]:
    return {p.name.split("-")[0] for p in (run_dir / "trials" / str(number) / "pids").iterdir()}


def test_a_function_trial_starts_dataloader_workers_spawned_ranks_and_a_pool(tmp_path: Path) -> None:
    study = optimize(_spec("fn-procs", {"function": "procprog:trial", "epochs": 1}, n=2), tmp_path / "run").study
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2, [t.user_attrs for t in study.trials]
    assert [t.value for t in study.trials] == [SCORE, SCORE]
    for t in study.trials:
        assert _kinds(tmp_path / "run", t.number) == {"dataloader", "spawn", "pool"}
    assert _wait_all_gone(_started(tmp_path / "run"), 30.0) == []


def test_a_warm_command_trial_starts_them_and_no_stale_descriptor_is_written(tmp_path: Path) -> None:
    # the program runs warm (forked from a worker with torch imported); it holds 16 files open when it makes its
    # first spawn-context primitive: multiprocessing must start a resource tracker of its own, not write to
    # the descriptor number the worker's tracker had (procprog prints score=-1 if anything was written)
    data = _spec("cmd-procs", {"command": ["python", "tests/procprog.py", "--hold", "${hold}"]}, hold=0.5)
    study = optimize(data, tmp_path / "run").study
    assert [t.state for t in study.trials] == [TrialState.COMPLETE]
    assert [t.value for t in study.trials] == [SCORE]
    log = (tmp_path / "run" / "trials" / "0" / "rank0.log").read_text()
    assert "warm (runpy in a process forked with torch imported)" in log
    assert '{"written_into_open_files": 0}' in log
    for t in study.trials:  # and what it left running at its end (a daemonic mp.Process, a sleeper) is gone
        assert _kinds(tmp_path / "run", t.number) == {"dataloader", "spawn", "pool", "process", "subprocess"}
    assert _wait_all_gone(_started(tmp_path / "run"), 30.0) == []


def test_what_a_trial_started_dies_with_a_sigkilled_driver(tmp_path: Path) -> None:
    # the trial holds DataLoader workers, a non-daemonic mp.Process and a subprocess sleeper, and sleeps; the
    # driver is SIGKILLed alone (not its group): the worker's engine watch kills everything below it
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(_spec("kill-procs", {"function": "procprog:trial", "epochs": 1}, hold=300.0)))
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "run", str(f), "--run-dir", str(run_dir)],
                            env=RUN_ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        end = time.monotonic() + 240  # bound on a hang: the trial holds within seconds on an idle machine
        while not (run_dir / "trials" / "0" / "holding").exists():
            assert proc.poll() is None and time.monotonic() < end, "the trial never started holding its processes"
            time.sleep(0.1)
        pids = _started(run_dir)
        assert _kinds(run_dir, 0) >= {"dataloader", "spawn", "pool", "process", "subprocess"}
        assert len(_alive(pids)) >= 4  # 2 persistent DataLoader workers, the mp.Process, the sleeper
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        assert _wait_all_gone(pids, 60.0) == []
    finally:
        with_group = psutil.pid_exists(proc.pid)
        if with_group:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_a_warm_program_ends_as_an_interpreter_ends(tmp_path: Path) -> None:
    # tests/warmprog.py: 2-rank DDP that keeps its wrapper past destroy_process_group(), an atexit handler, a
    # non-daemon thread that ends 0.3 s after the main code. Each trial bounded (a hang fails it, not the test
    # run); bench/warm_exit.py runs 30 of them
    data = {"study": {"name": "warm-end", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 4, "max_concurrent": 1, "seed": 0},
            "training": {"command": ["python", "tests/warmprog.py"]},
            "resources": {"processes": 2, "timeout": 120, "max_retries": 0}}
    study = optimize(data, tmp_path / "run").study
    assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 4, [t.user_attrs.get("error")
                                                                          for t in study.trials]
    for t in study.trials:
        d = tmp_path / "run" / "trials" / str(t.number)
        assert "warm (runpy" in (d / "rank0.log").read_text()
        assert sorted(p.name for p in d.glob("atexit_rank*")) == ["atexit_rank0", "atexit_rank1"]
        assert sorted(p.name for p in d.glob("thread_rank*")) == ["thread_rank0", "thread_rank1"]


def test_a_torch_free_function_on_a_light_worker_starts_a_pool(tmp_path: Path) -> None:
    # a light worker is a spawned interpreter, daemonic to multiprocessing like a warm one; a fresh hpoflow run
    # starts light workers for torch-free trials (in this process a preloaded forkserver would be used instead)
    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(_spec("light-pool", {"function": "trainfns_light:pool_without_torch", "epochs": 1})))
    r = subprocess.run([sys.executable, "-m", "hpoflow", "run", str(f), "--run-dir", str(tmp_path / "run"), "--json"],
                       env=RUN_ENV, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = (tmp_path / "run" / "trials.csv").read_text().splitlines()
    header, row = rows[0].split(","), rows[1].split(",")
    got = dict(zip(header, row, strict=False))
    assert got["state"] == "COMPLETE" and float(got["value"]) == 60.0, got
    assert float(got["metric_torch_loaded"]) == 0.0, got  # it ran on a light worker


HANGS_AT_ITS_END = """
import os, sys, time
print("score=1.0", flush=True)
if os.environ["RANK"] == "1":  # as a rank whose interpreter's teardown hangs (a gloo thread waiting for the GIL)
    time.sleep(600)
"""


@pytest.mark.parametrize("isolate", [False, True])
def test_a_peer_whose_program_hangs_after_rank_0s_ended_is_stopped(tmp_path: Path, isolate: bool) -> None:
    prog = tmp_path / "hangs.py"
    prog.write_text(HANGS_AT_ITS_END)
    data = {"study": {"name": "peer-hang", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 1, "max_concurrent": 1, "seed": 0},
            "training": {"command": ["python", str(prog)], "isolate": isolate, "stop_grace_s": 1.0},
            "resources": {"processes": 2, "timeout": 240, "max_retries": 0}}  # (the bound a hang would meet)
    (t,) = optimize(data, tmp_path / "run").study.trials
    assert t.state == TrialState.COMPLETE and t.value == 1.0, t.user_attrs.get("error")
    log = (tmp_path / "run" / "trials" / "0" / "rank1.log").read_text()
    assert "rank 0's program has ended" in log and "SIGTERM" in log, log
