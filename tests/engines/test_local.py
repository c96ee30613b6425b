"""The local engine with real processes: DDP, failures, timeouts, cancel, isolation, placement."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from hpoflow.engines import TrialRequest, TrialResult
from hpoflow.engines.local import LocalEngine, plan_placement
from hpoflow.engines.machine import check_fits
from hpoflow.errors import EngineError
from hpoflow.spec import TrainConfig
from tests.conftest import ROOT, descendants, pythonpath

PYPATH = (str(ROOT / "tests"),)


def request(tmp_path: Path, number: int, function: str | None = None, **kw: Any) -> TrialRequest:
    options = kw.pop("options", {})
    train = TrainConfig(function=function, options=options, epochs=kw.pop("epochs", 2),
                        model=kw.pop("model", "mlp")).model_dump(mode="json")
    return TrialRequest(number, {}, train, kw.pop("metric", "loss"), "minimize", str(tmp_path / str(number)),
                        python_path=PYPATH, **kw)


def run_all(engine: LocalEngine, requests: list[TrialRequest], limit: float = 120.0) -> dict[int, TrialResult]:
    for r in requests:
        engine.submit(r)
    out: dict[int, TrialResult] = {}
    t0 = time.monotonic()
    while len(out) < len(requests):
        if time.monotonic() - t0 > limit:
            raise TimeoutError(f"engine did not finish: {out}")
        for ev in engine.poll(1.0):
            if isinstance(ev, TrialResult):
                out[ev.number] = ev
    return out


@pytest.fixture
def engine() -> Any:
    eng = LocalEngine()
    yield eng
    eng.close()


def test_two_rank_ddp_trial_ends_with_identical_weights(engine: LocalEngine, tmp_path: Path) -> None:
    res = run_all(engine, [request(tmp_path, 0, "trainfns:ddp_identical", processes=2)])[0]
    assert res.status == "complete", res
    assert res.metrics["world"] == 2.0
    assert res.metrics["moved"] > 1e-3  # it trained
    assert res.metrics["weight_spread"] == 0.0  # both ranks hold identical weights
    assert (tmp_path / "0" / "rank0.log").exists() and (tmp_path / "0" / "rank1.log").exists()


def test_builtin_cnn_trial_with_two_ranks(engine: LocalEngine, tmp_path: Path) -> None:
    res = run_all(engine, [request(tmp_path, 0, processes=2, model="cnn", metric="val_accuracy", epochs=3)])[0]
    assert res.status == "complete", res
    assert res.value is not None and res.value > 0.8
    assert res.timings["duration_s"] > 0


def test_the_builtin_trainers_rank_0_logs_a_line_per_epoch(engine: LocalEngine, tmp_path: Path) -> None:
    """The built-in trainer's rank logs were empty: rank 0 now writes the epoch, its metrics and its time."""
    res = run_all(engine, [request(tmp_path, 0, processes=2, metric="val_accuracy", epochs=3)])[0]
    assert res.status == "complete", res
    lines = (tmp_path / "0" / "rank0.log").read_text().splitlines()
    epoch = re.compile(r"epoch (\d+)/3  val_accuracy=(\S+) val_loss=\S+ train_loss=\S+ train_accuracy=\S+ lr=\S+  "
                       r"\d+\.\d\d s")
    matches = [m for m in map(epoch.fullmatch, lines) if m]
    assert [int(m.group(1)) for m in matches] == [1, 2, 3], lines
    assert float(matches[-1].group(2)) == pytest.approx(res.value, rel=1e-3)  # the metric reported, to 4 digits
    assert "epoch" not in (tmp_path / "0" / "rank1.log").read_text()  # once per trial, not per rank


def test_what_prestart_found_running_is_not_discarded(engine: LocalEngine) -> None:
    """``hpoflow run`` stops what ``prestart`` started if no engine adopted it (a Ctrl-C before the
    engine existed), never a forkserver that was running already: an engine's workers die with it."""
    from multiprocessing import forkserver

    from hpoflow.engines.local import discard_prestarted, prestart

    assert engine.wait_warm(120)
    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    assert pid is not None
    prestart(light=0)  # the same preload: the running forkserver is kept
    discard_prestarted()
    assert getattr(forkserver._forkserver, "_forkserver_pid", None) == pid and psutil.pid_exists(pid)
    assert psutil.Process(pid).status() != psutil.STATUS_ZOMBIE


def test_exception_in_user_code_fails_with_stderr_tail(engine: LocalEngine, tmp_path: Path) -> None:
    res = run_all(engine, [request(tmp_path, 0, "trainfns:fail")])[0]
    assert res.status == "failed" and not res.retryable
    assert "ValueError: boom from user code" in (res.error or "")
    assert "about to fail" in res.stderr_tail and "Traceback" in res.stderr_tail


def test_killed_rank_fails_the_trial_without_hanging(engine: LocalEngine, tmp_path: Path) -> None:
    t0 = time.monotonic()
    res = run_all(engine, [request(tmp_path, 0, "trainfns:crash_rank1", processes=2)], limit=60)[0]
    assert time.monotonic() - t0 < 30
    assert res.status == "failed" and res.retryable
    assert "rank 1" in (res.error or "") and "SIGKILL" in (res.error or "")


def test_a_rank_that_died_before_its_peer_failed_is_the_trials_failure(engine: LocalEngine, tmp_path: Path) -> None:
    """Rank 1 killed, then rank 0's error (the collective rank 1 broke), both there to read when the engine
    next looks: the failure is rank 1's death, retryable, whichever end the engine reads first (rank 0's
    pipe comes first in its wait)."""
    engine.submit(request(tmp_path, 0, "trainfns:rank1_dies_rank0_errs", processes=2))
    erred = tmp_path / "0" / "erred"
    t0 = time.monotonic()
    while not erred.exists():  # no poll meanwhile: both ends wait for the one below
        assert time.monotonic() - t0 < 60, "rank 0 never saw rank 1 gone"
        time.sleep(0.05)
    time.sleep(1.0)  # rank 0 sends its error right after the file (generous on a loaded machine)
    results: list[TrialResult] = []
    while not results:
        results = [e for e in engine.poll(1.0) if isinstance(e, TrialResult)]
        assert time.monotonic() - t0 < 90
    (r,) = results
    assert r.status == "failed" and r.retryable, r
    assert (r.error or "").startswith("rank 1 killed by SIGKILL"), r.error


def test_a_killed_ranks_end_that_comes_after_its_peers_error_is_still_the_trials_failure(
        engine: LocalEngine, tmp_path: Path) -> None:
    """Rank 1 killed, rank 0's error first to reach the engine, rank 1's end 0.3 s after it (its pipe
    held by a child, the forkserver stopped meanwhile): the engine gives a peer's end up to a second,
    so the failure is rank 1's death, retryable, not rank 0's "Connection closed by peer"."""
    from multiprocessing import forkserver

    assert engine.wait_warm(120)  # rank 1 must be a forkserver's child
    t0 = time.monotonic()
    try:
        res = run_all(engine, [request(tmp_path, 0, "trainfns:rank1_ends_late_rank0_errs", processes=2)],
                      limit=90)[0]
    finally:  # should rank 1's child die before it resumed the forkserver, later tests still fork
        with contextlib.suppress(OSError, TypeError):
            os.kill(forkserver._forkserver._forkserver_pid, signal.SIGCONT)  # type: ignore[attr-defined]
    assert res.status == "failed" and res.retryable, res
    assert (res.error or "").startswith("rank 1 killed by SIGKILL"), res.error
    assert time.monotonic() - t0 < 60


def test_timeout_kills_the_trial(engine: LocalEngine, tmp_path: Path) -> None:
    t0 = time.monotonic()
    res = run_all(engine, [request(tmp_path, 0, "trainfns:sleepy", timeout=1.5)])[0]
    assert res.status == "failed" and "timed out after 1.5 s" in (res.error or "")
    assert time.monotonic() - t0 < 15


def test_cancel_kills_rank_and_its_children(engine: LocalEngine, tmp_path: Path) -> None:
    engine.submit(request(tmp_path, 0, "trainfns:spawn_child_and_sleep"))
    pid_file = tmp_path / "0" / "grandchild.pid"
    t0 = time.monotonic()
    while not pid_file.exists() and time.monotonic() - t0 < 30:
        engine.poll(0.1)
    grandchild = int(pid_file.read_text())
    assert psutil.pid_exists(grandchild)
    engine.cancel(0, "test")
    results: list[TrialResult] = []
    while not results:
        results = [e for e in engine.poll(1.0) if isinstance(e, TrialResult)]
    assert results[0].status == "cancelled"
    time.sleep(0.2)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE


def test_no_state_leaks_between_trials(engine: LocalEngine, tmp_path: Path) -> None:
    first = run_all(engine, [request(tmp_path, 0, "trainfns:counter", metric="calls")])[0]
    second = run_all(engine, [request(tmp_path, 1, "trainfns:counter", metric="calls")])[1]
    assert first.metrics["calls"] == second.metrics["calls"] == 1.0  # module globals fresh
    assert first.metrics["seed_draw"] == second.metrics["seed_draw"]  # RNG seeded the same
    assert first.metrics["threads"] == 1.0


def test_close_leaves_no_process_behind(tmp_path: Path) -> None:
    before = descendants()  # another engine of this process (a module's, in the same worker) is not this one's
    eng = LocalEngine()
    eng.submit(request(tmp_path, 0, "trainfns:sleepy", processes=2))
    t0 = time.monotonic()
    while len(descendants() - before) < 2 and time.monotonic() - t0 < 30:
        eng.poll(0.1)
    assert len(descendants() - before) >= 2
    eng.close()
    time.sleep(0.3)
    assert descendants() - before == set()


def test_gpu_placement_with_faked_devices(tmp_path: Path) -> None:
    # Four fake GPUs, four fake core slots (ids reused: affinity to them is still valid here).
    eng = LocalEngine(cores=[0, 1, 0, 1], gpus=[0, 1, 2, 3])
    try:
        reqs = [request(tmp_path, n, "trainfns:env_probe", metric="ok", processes=2, gpus_per_process=1)
                for n in (0, 1)]
        assert eng.capacity(reqs[0]) == 2
        res = run_all(eng, reqs)
    finally:
        eng.close()
    assert all(r.status == "complete" for r in res.values()), res
    seen = sorted((tmp_path / str(n) / f"env{r}.txt").read_text().split("\n")[0] for n in (0, 1) for r in (0, 1))
    assert seen == ["0", "1", "2", "3"]  # each rank its own GPU, no GPU shared between trials


def test_placement_plan_and_limits(tmp_path: Path) -> None:
    req = request(tmp_path, 0, processes=2, cpus_per_process=2, gpus_per_process=1)
    plan = plan_placement(req, [0, 1, 2, 3, 4], [5, 6, 7])
    assert plan is not None
    assert [p.cores for p in plan] == [(0, 1), (2, 3)] and [p.gpus for p in plan] == [(5,), (6,)]
    assert plan_placement(req, [0, 1, 2], [5, 6]) is None
    with pytest.raises(EngineError, match="4 cores, but this machine gives 2"):
        check_fits(req, 2, 8)
    with pytest.raises(EngineError, match="2 GPUs, but 0 are visible"):
        check_fits(req, 8, 0)


def test_a_cpu_trial_is_pinned_and_leaves_cuda_visible_devices_as_it_was(engine: LocalEngine,
                                                                         tmp_path: Path) -> None:
    res = run_all(engine, [request(tmp_path, 0, "trainfns:env_probe", metric="ok")])[0]
    assert res.status == "complete"
    lines = (tmp_path / "0" / "env0.txt").read_text().split("\n")
    assert lines[0] == os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")  # no GPU asked: not rewritten
    assert lines[2] == "1"  # OMP_NUM_THREADS from cpus_per_process
    assert len(ast.literal_eval(lines[1])) == 1  # pinned to one core


def test_pruning_decision_reaches_every_rank_at_the_same_step(engine: LocalEngine, tmp_path: Path) -> None:
    req = request(tmp_path, 0, "trainfns:prune_probe", metric="score", processes=2, pruning=True)
    engine.submit(req)
    result = None
    asked = []
    while result is None:
        for ev in engine.poll(5.0):
            if isinstance(ev, TrialResult):
                result = ev
            elif ev.wants_answer:
                asked.append(ev.step)
                engine.answer(0, ev.step == 3)
    assert result.status == "pruned", result
    assert asked == [1, 2, 3]  # rank 0 waited for each decision; nothing ran past the prune
    assert [(tmp_path / "0" / f"stopped{r}.txt").read_text() for r in (0, 1)] == ["3", "3"]


def test_a_torch_free_trial_runs_on_a_light_worker_and_torch_is_seeded_when_it_is_imported(
        tmp_path: Path) -> None:
    import numpy as np
    import torch

    from hpoflow.engines.local import prestart

    prestart(light=1)  # as `hpoflow run` does first thing for a study of torch-free trials
    eng = LocalEngine(cores=[0], prestart=False)  # adopts the light worker; no forkserver until a trial needs it
    try:
        res = run_all(eng, [request(tmp_path, 0, "trainfns_light:torch_probe", metric="value", seed=123)])[0]
        again = run_all(eng, [request(tmp_path, 1, "trainfns_light:torch_probe", metric="value", seed=123)])[1]
    finally:
        eng.close()
    torch.manual_seed(123)
    expected = float(torch.rand(1).item())
    assert res.status == "complete" and again.status == "complete", (res, again)
    assert res.metrics["torch_was_loaded"] == 0.0  # the light worker had not imported torch
    assert again.metrics["torch_was_loaded"] == 1.0  # learnt: the function runs on a warm worker now
    assert res.metrics["draw"] == again.metrics["draw"] == expected  # seeded alike either way
    # NumPy too: not imported by the light worker, seeded when the function imports it; already
    # imported (and seeded again) on the warm worker
    assert res.metrics["numpy_was_loaded"] == 0.0 and again.metrics["numpy_was_loaded"] == 1.0
    assert res.metrics["np_draw"] == again.metrics["np_draw"] == np.random.RandomState(123).rand()
    assert res.metrics["threads"] == 1.0
    # the cold import is a timing of its own, left out of the trial's duration and run time
    assert res.timings["cold_start_s"] > 0 and "cold_start_s" not in again.timings
    assert res.timings["duration_s"] <= res.timings["engine_duration_s"] - res.timings["cold_start_s"]


def test_a_function_that_imports_torch_runs_on_a_warm_worker_from_its_first_trial(
        engine: LocalEngine, tmp_path: Path) -> None:
    (tmp_path / "lazy.py").write_text("import sys\n\ndef f(ctx):\n    loaded = 'torch' in sys.modules\n"
                                      "    import torch\n    return {'value': float(loaded)}\n")
    req = dataclasses.replace(request(tmp_path, 0, "lazy:f", metric="value"), python_path=(str(tmp_path),))
    res = run_all(engine, [req])[0]
    assert res.status == "complete", res
    assert res.metrics["value"] == 1.0 and "cold_start_s" not in res.timings


FORKSERVER_FIRST = """
import json, multiprocessing as mp, sys, time
from hpoflow.engines import TrialResult
from hpoflow.engines.local import LocalEngine
sys.path.insert(0, sys.argv[1])
if __name__ == "__main__":
    p = mp.get_context("forkserver").Process(target=print)  # this process's forkserver, multiprocessing's preload
    p.start()
    p.join()
    from tests.engines.test_local import request
    engine = LocalEngine()
    engine.submit(request(__import__("pathlib").Path(sys.argv[1]), 0, "lazy:f", metric="value"))
    result = None
    while result is None:
        result = next((e for e in engine.poll(1.0) if isinstance(e, TrialResult)), None)
    engine.close()
    print(json.dumps({"status": result.status, "value": result.metrics.get("value")}))
"""


def test_warm_workers_have_torch_though_the_process_started_a_forkserver_of_its_own_first(tmp_path: Path) -> None:
    """multiprocessing's forkserver is one per process: one another part of the program started first
    (a notebook's, a test's; without the engine's preload) is replaced, so warm workers hold torch."""
    (tmp_path / "lazy.py").write_text("import sys\nPRELOADED = 'torch' in sys.modules\nimport torch\n\n"
                                      "def f(ctx):\n    return {'value': float(PRELOADED)}\n")
    (tmp_path / "main.py").write_text(FORKSERVER_FIRST)
    env = {**os.environ, "PYTHONPATH": pythonpath(ROOT, ROOT / "tests", tmp_path)}
    p = subprocess.run([sys.executable, str(tmp_path / "main.py"), str(tmp_path)], capture_output=True, text=True,
                       env=env, cwd=tmp_path, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) == {"status": "complete", "value": 1.0}


def test_a_torch_trial_submitted_before_the_preload_ends_waits_for_the_workers_being_forked(tmp_path: Path) -> None:
    """One worker per core, never more (each holds memory of its own): the first trial does not fork
    one of its own beside those the pool is forking."""
    eng = LocalEngine(cores=[0])  # the forkserver starts preloading now
    try:
        res = run_all(eng, [request(tmp_path, 0, "trainfns:behave", metric="value")])[0]
        assert res.status == "complete", res
        assert len(eng._pool.workers) == 1
    finally:
        eng.close()


def test_which_functions_import_torch_is_read_from_their_source(tmp_path: Path) -> None:
    from hpoflow.trial import imports_torch

    (tmp_path / "helpers.py").write_text("import torch\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "nets.py").write_text("from . import layers\n")
    (tmp_path / "pkg" / "layers.py").write_text("def make():\n    from torch import nn\n    return nn\n")
    (tmp_path / "fns.py").write_text(
        "import json\nfrom typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n\n"
        "def plain(ctx):\n    return json.dumps(1)\n\n"
        "def _helper():\n    import torch\n    return torch\n\n"
        "def via_helper(ctx):\n    return _helper()\n\n"
        "def via_module(ctx):\n    import helpers\n\n"
        "def via_package(ctx):\n    from pkg import nets\n\n"
        "def via_library(ctx):\n    import optuna\n")
    path = (str(tmp_path),)
    assert not imports_torch("fns:plain", path)  # TYPE_CHECKING imports and other functions do not count
    assert imports_torch("fns:via_helper", path)
    assert imports_torch("fns:via_module", path)
    assert imports_torch("fns:via_package", path)  # relative imports of the user's package, transitively
    assert not imports_torch("fns:via_library", path)  # a library's own imports are not followed
    assert not imports_torch("nosuch:f", path)  # the trial reports the import error itself


def test_only_torch_free_single_cpu_rank_trials_may_skip_the_torch_preload() -> None:
    from hpoflow.trial import needs_torch

    assert not needs_torch("m:f", 1, 0)
    assert needs_torch(None, 1, 0)  # the built-in trainer
    assert needs_torch("m:f", 2, 0)  # a process group
    assert needs_torch("m:f", 1, 1)  # a GPU


def test_system_usage_counts_a_ddp_trials_network_volume(engine: LocalEngine, tmp_path: Path) -> None:
    floats, steps = 262144, 20  # 1 MiB per all-reduce
    res = run_all(engine, [request(tmp_path, 0, "trainfns:allreduce_volume", processes=2,
                                   options={"floats": floats, "steps": steps})])[0]
    assert res.status == "complete", res
    # A 2-rank ring all-reduce sends and receives 2 (p - 1) / p = 1 x the tensor per rank and step.
    theory_mb = 2 * steps * floats * 4 * 2 * (2 - 1) / 2 / 2**20
    assert res.system["net_sent_mb"] == pytest.approx(theory_mb, rel=0.10)
    assert res.system["net_recv_mb"] == pytest.approx(theory_mb, rel=0.10)
    assert res.system["rss_peak_mb"] > 50 and res.system["cpu_percent"] > 0
    for rank in (0, 1):
        per_rank = json.loads((tmp_path / "0" / f"usage_rank{rank}.json").read_text())
        assert per_rank["net_sent_mb"] == pytest.approx(theory_mb / 2, rel=0.10)


def test_a_prepared_trial_starts_in_its_prepared_directory_and_close_removes_what_never_started(
        engine: LocalEngine, tmp_path: Path) -> None:
    """``prepare`` (the driver's trial asked ahead) makes the trial directory and its ranks' logs before the
    slot frees; the trial then runs there as any other, and ``close`` removes only what was made for a trial
    that never started, and only while it is empty."""
    ran, never = request(tmp_path, 0, "trainfns_light:fail"), request(tmp_path, 1, "trainfns_light:fail")
    kept = tmp_path / "2"
    kept.mkdir()
    (kept / "notes.txt").write_text("the user's")
    other = request(tmp_path, 2, "trainfns_light:fail")
    for r in (ran, never, other):
        engine.prepare(r)
    assert (tmp_path / "0" / "rank0.log").read_text() == "" and (tmp_path / "1" / "rank0.log").exists()
    res = run_all(engine, [ran])[0]
    assert res.status == "failed" and "about to fail" in (tmp_path / "0" / "rank0.log").read_text()
    engine.close()
    assert not (tmp_path / "1").exists()  # prepared, never started: its empty log and directory gone
    assert (kept / "notes.txt").exists() and not (kept / "rank0.log").exists()  # a directory it did not make stays
    assert "about to fail" in (tmp_path / "0" / "rank0.log").read_text()  # a trial that ran keeps everything
