"""Command trials (``training.command``, ``hpoflow.train.command``) on the local engine with real
processes: torchrun's environment per rank, the three ways to report, a failing program's stderr in
the error, a metric never reported, a stop decided by the driver (should_stop, then SIGTERM after the
grace period), and a cancel that leaves no program behind. The programs are ``tests/commandprog.py``
(standard library only: a trial costs an interpreter start)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hpoflow.engines import TrialRequest, TrialResult
from hpoflow.engines.local import LocalEngine
from hpoflow.spec import TrainConfig
from hpoflow.train.command import LineReports
from hpoflow.trial import TrialReport
from tests.conftest import ROOT

PROG = [sys.executable, "tests/commandprog.py"]  # a program path: a fresh process, as for any program
WARM = ["python", "tests/commandprog.py"]  # python SCRIPT: run warm (runpy in a process forked from the worker)
WAIT_S = 120.0  # bounds a hang on a loaded machine


def request(tmp_path: Path, number: int, args: list[str], **kw: Any) -> TrialRequest:
    train = TrainConfig(command=[*kw.pop("prog", PROG), *args], stop_grace_s=kw.pop("grace", 30.0),
                        isolate=kw.pop("isolate", False),
                        **({"epochs": kw.pop("epochs")} if "epochs" in kw else {})).model_dump(mode="json")
    return TrialRequest(number, kw.pop("params", {"x": 0.5}), train, kw.pop("metric", "val_loss"), "minimize",
                        str(tmp_path / str(number)), workdir=str(ROOT), **kw)


def events(engine: LocalEngine, requests: list[TrialRequest], on_report: Any = None) -> dict[int, TrialResult]:
    for r in requests:
        engine.submit(r)
    out: dict[int, TrialResult] = {}
    t0 = time.monotonic()
    while len(out) < len(requests):
        assert time.monotonic() - t0 < WAIT_S, f"the engine did not finish: {out}"
        for ev in engine.poll(1.0):
            if isinstance(ev, TrialResult):
                out[ev.number] = ev
            elif on_report is not None:
                on_report(ev)
    return out


@pytest.fixture
def engine() -> Any:
    eng = LocalEngine(cores=[0, 1] if len(os.sched_getaffinity(0)) > 1 else None)
    yield eng
    eng.close()


def test_a_line_reports_the_study_metrics_with_its_step() -> None:
    lines = LineReports(("val_loss",))
    assert lines.parse("epoch=3 val_loss=0.41 val_accuracy: 0.9") == (3, {"val_loss": 0.41, "val_accuracy": 0.9})
    assert lines.parse("Step: 12, val_loss: 1e-3") == (12, {"val_loss": 0.001})
    assert lines.parse("val_loss = 2") == (None, {"val_loss": 2.0})  # step: the count of reports
    assert lines.parse("epoch=3 loss=0.41") is None  # no metric of the study: not a report
    assert lines.parse("my_val_loss=0.4 val_loss=3.5x") is None  # whole names and numbers only


@pytest.mark.parametrize("how", ["print", "file", "client"])
def test_a_one_rank_program_reports_each_way_and_completes_with_its_last_value(engine: LocalEngine, tmp_path: Path,
                                                                               how: str) -> None:
    seen: list[tuple[int, dict[str, float]]] = []
    res = events(engine, [request(tmp_path, 0, ["--x", "0.5", "--epochs", "3", "--report", how])],
                 lambda ev: seen.append((ev.step, ev.metrics)))[0]
    assert res.status == "complete", res
    assert [s for s, _ in seen] == [1, 2, 3]
    assert res.value == pytest.approx((0.5 - 0.3) ** 2 + 1 / 3, abs=1e-6)


@pytest.mark.parametrize("how", ["warm", "isolated"])
def test_every_rank_gets_torchruns_environment_and_rank_0s_master(engine: LocalEngine, tmp_path: Path,
                                                                  how: str) -> None:
    env_file = str(tmp_path / "env_RANK.json")
    res = events(engine, [request(tmp_path, 0, ["--env", env_file], processes=2, params={"x": 0.25}, prog=WARM,
                                  isolate=how == "isolated")])[0]
    assert res.status == "complete", res
    seen = [json.loads((tmp_path / f"env_{r}.json").read_text()) for r in (0, 1)]
    for s in seen:  # as `python tests/commandprog.py` starts it, warm or not; warm: torch is there already
        # in its trial directory (training.workdir), the script's path anchored to where hpoflow runs
        assert s["argv"] == [str(ROOT / "tests" / "commandprog.py"), "--env", env_file]
        assert (s["path0"], s["cwd"]) == (str(ROOT / "tests"), str(tmp_path / "0"))
        assert s["torch_imported"] == (how == "warm")
        assert s["pgid"] == s["pid"]  # a process group of its own
    envs = [s["environ"] for s in seen]
    for r, env in enumerate(envs):
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"]) == \
            (str(r), str(r), "2", "2", "0")
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["TORCHELASTIC_RUN_ID"] == "hpoflow-0-0"
        assert json.loads(env["HPOFLOW_PARAMS"]) == {"x": 0.25}
        assert env["HPOFLOW_TRIAL_DIR"] == str(tmp_path / "0")
        assert env["HPOFLOW_CHECKPOINT_DIR"] == str(tmp_path / "0" / "checkpoints")
    assert envs[0]["MASTER_ADDR"] == envs[1]["MASTER_ADDR"] == "127.0.0.1"
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]  # rank 0's, told the others through the store
    assert envs[0]["HPOFLOW_CONTROL"] != envs[1]["HPOFLOW_CONTROL"]  # each rank its supervisor


@pytest.mark.parametrize("prog", [PROG, WARM], ids=["isolated", "warm"])
def test_a_program_that_exits_non_zero_fails_the_trial_with_its_stderr(engine: LocalEngine, tmp_path: Path,
                                                                       prog: list[str]) -> None:
    res = events(engine, [request(tmp_path, 0, ["--fail", "3"], prog=prog)])[0]
    assert res.status == "failed" and not res.retryable
    assert "exited with code 3" in (res.error or "")
    assert "something went wrong on purpose" in (res.error or "")


@pytest.mark.parametrize("prog", [PROG, WARM], ids=["isolated", "warm"])
def test_a_program_killed_by_a_signal_hpoflow_did_not_send_fails_the_trial_as_retryable(
        engine: LocalEngine, tmp_path: Path, prog: list[str]) -> None:
    # the program kills itself with SIGKILL after its first epoch, as the OOM killer would: the attempt fails
    # as retryable (the driver reruns it up to resources.max_retries), not as an error in the user's code
    res = events(engine, [request(tmp_path, 0, ["--epochs", "3", "--kill-attempts", "1"], prog=prog)])[0]
    assert res.status == "failed" and res.retryable, res
    assert "killed by SIGKILL" in (res.error or "") and "resources.max_retries" in (res.error or ""), res.error


def test_a_metric_printed_in_colour_is_read(engine: LocalEngine, tmp_path: Path) -> None:
    # "\x1b[1mepoch\x1b[0m=1 \x1b[1;32mval_loss=0.29\x1b[0m", as rich or colorama print where forced to
    seen: list[int] = []
    res = events(engine, [request(tmp_path, 0, ["--x", "0.5", "--epochs", "3", "--color"])],
                 lambda ev: seen.append(ev.step))[0]
    assert res.status == "complete", res
    assert seen == [1, 2, 3]
    assert res.value == pytest.approx((0.5 - 0.3) ** 2 + 1 / 3, abs=1e-6)


def test_a_backlog_of_reports_keeps_every_value_and_is_judged_at_its_last(engine: LocalEngine,
                                                                         tmp_path: Path) -> None:
    # 2,000 lines appended to HPOFLOW_METRICS_FILE at once: each reaches the study (the pruner's study keeps
    # every intermediate value), but the rank waits for a decision only on the last report of what it read
    # at once, not on each (before: 2,000 round trips to the driver, each a storage write and a judgement)
    judged: list[int] = []
    steps: list[int] = []

    def answer(ev: TrialReport) -> None:
        steps.append(ev.step)
        if ev.wants_answer:
            judged.append(ev.step)
            engine.answer(ev.number, False)

    res = events(engine, [request(tmp_path, 0, ["--epochs", "2000", "--report", "file"], pruning=True)], answer)[0]
    assert res.status == "complete", res
    assert steps == list(range(1, 2001))
    assert judged and judged[-1] == 2000 and len(judged) < 200, judged


def test_a_metric_never_reported_is_a_clear_trial_error(engine: LocalEngine, tmp_path: Path) -> None:
    res = events(engine, [request(tmp_path, 0, ["--metric", "loss"])])[0]
    assert res.status == "failed"
    assert "never reported 'val_loss' (study.metric)" in (res.error or ""), res.error


def test_a_pruned_program_is_told_and_one_that_does_not_listen_is_stopped_after_the_grace(
        engine: LocalEngine, tmp_path: Path) -> None:
    # trial 0 asks should_stop() after each epoch: it stops at once; trial 1 never asks: SIGTERM after 1 s
    listens = request(tmp_path, 0, ["--epochs", "1000", "--sleep", "0.05", "--ask"], pruning=True, grace=1.0)
    deaf = request(tmp_path, 1, ["--epochs", "1000", "--sleep", "0.05"], pruning=True, grace=1.0, prog=WARM)
    # the deaf trial runs warm: its submit waits for the forkserver's preload, during which no report of the
    # listening trial (already started on a light worker) is answered. Warm first, so the test measures the
    # answer's way to the program, not the preload (seconds in a fresh pytest process, none after other tests)
    assert engine.wait_warm(120.0)
    decided: dict[int, float] = {}

    def prune_at_step_2(ev: TrialReport) -> None:
        if ev.wants_answer:
            prune = ev.step >= 2
            if prune:
                decided.setdefault(ev.number, time.monotonic())
            engine.answer(ev.number, prune)

    results = events(engine, [listens, deaf], prune_at_step_2)
    ended = time.monotonic()
    assert {n: r.status for n, r in results.items()} == {0: "pruned", 1: "pruned"}
    trained = [len((tmp_path / str(n) / "trained_rank0.txt").read_text().split()) for n in (0, 1)]
    assert trained[0] <= 3  # it stopped at the epoch it was told (one more if the answer came late)
    log = (tmp_path / "1" / "rank0.log").read_text()
    assert "SIGTERM" in log and "SIGKILL" not in log
    assert ended - decided[1] < 1.0 + 10.0  # the grace, and what a loaded machine adds to end a trial
    assert trained[1] < 200  # it did not train on to its 1000th epoch


def test_the_engines_pause_reaches_every_rank_and_pauses_the_trial_with_its_checkpoint(
        engine: LocalEngine, tmp_path: Path) -> None:
    # a pause (SIGUSR1 to the rank processes, as before a walltime) tells the program pausing() on both
    # ranks; it saves and stops, and the trial is interrupted as paused, to resume from its checkpoint
    engine.submit(request(tmp_path, 0, ["--epochs", "100000", "--sleep", "0.05", "--ask"], processes=2,
                          prog=WARM))
    t0 = time.monotonic()
    while not all((tmp_path / "0" / f"trained_rank{r}.txt").exists() for r in (0, 1)):
        assert time.monotonic() - t0 < WAIT_S, "the programs did not start"
        time.sleep(0.05)
    engine.pause(0, "test")
    result: list[TrialResult] = []
    while not result:
        assert time.monotonic() - t0 < WAIT_S
        result = [ev for ev in engine.poll(1.0) if isinstance(ev, TrialResult)]
    assert result[0].status == "cancelled" and "paused" in (result[0].error or ""), result[0]
    for rank in (0, 1):
        assert "(pausing: True)" in (tmp_path / "0" / f"rank{rank}.log").read_text()
    assert (tmp_path / "0" / "checkpoints" / "prog.json").exists()


def test_a_cancelled_command_trial_leaves_no_program_behind(engine: LocalEngine, tmp_path: Path) -> None:
    marker = str(tmp_path / "env_RANK.json")  # in the programs' command lines: how the test finds them
    engine.submit(request(tmp_path, 0, ["--epochs", "100000", "--sleep", "0.05", "--env", marker], processes=2))
    t0 = time.monotonic()
    while not (tmp_path / "0" / "trained_rank1.txt").exists() or not (tmp_path / "0" / "trained_rank0.txt").exists():
        assert time.monotonic() - t0 < WAIT_S, "the programs did not start"
        time.sleep(0.05)
    programs = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    assert len(programs) == 2
    engine.cancel(0, "test")
    result: list[TrialResult] = []
    while not result:
        assert time.monotonic() - t0 < WAIT_S
        result = [ev for ev in engine.poll(1.0) if isinstance(ev, TrialResult)]
    assert result[0].status == "cancelled"
    _, alive = psutil.wait_procs(programs, timeout=30)
    assert not alive, alive


def test_the_client_does_nothing_outside_a_trial(tmp_path: Path) -> None:
    code = ("import sys; from hpoflow import client; client.report(1, val_loss=0.5); "
            "assert not client.should_stop() and not client.pausing() and client.checkpoint_dir() is None; "
            "assert not client.in_trial(); "
            "assert not any(m.split('.')[0] in ('torch', 'numpy', 'pydantic', 'optuna') for m in sys.modules), "
            "sorted(sys.modules)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HPOFLOW_")}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
