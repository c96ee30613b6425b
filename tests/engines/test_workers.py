"""The local engine's workers as processes: which modules they unload, that they never run the
caller's ``__main__``, that nothing a trial starts outlives it, bounded rank logs, and rendezvous
directories that do not outlive a killed driver. Real processes throughout; each test writes the
training functions it needs into its own directory."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from hpoflow.engines import TrialRequest, TrialResult
from hpoflow.engines.local import LocalEngine
from hpoflow.engines.local._modules import MARK, ModuleKeeper
from hpoflow.engines.local._worker import FULL_GC_AFTER_S
from hpoflow.engines.logcap import CAP_ENV, LogPump
from hpoflow.errors import EngineError
from hpoflow.spec import TrainConfig
from tests.conftest import ROOT, RUN_ENV, pythonpath

ENV = {**os.environ, "PYTHONPATH": pythonpath(ROOT)}

FNS = '''
import os, sys, time

def score(ctx):
    return {"score": float(ctx.params.get("x", 1.0))}

def daemonize(ctx):
    """Double fork with setsid: the sleeper is no child of the worker, nor in its process group."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setsid()
        child = os.fork()
        if child == 0:
            os.execvp("sleep", ["sleep", "1000"])
        os.write(w, str(child).encode())
        os._exit(0)
    os.waitpid(pid, 0)
    os.close(w)
    sleeper = int(os.read(r, 64))
    from hpoflow.fileio import write_atomic

    write_atomic(ctx.trial_dir / "sleeper.pid", str(sleeper), durable=False)  # never read half-written
    if ctx.options.get("hang"):
        time.sleep(600)
    gate = ctx.options.get("gate")
    while gate and not os.path.exists(gate):  # held until a test opens the gate
        time.sleep(0.05)
    return {"score": float(ctx.params.get("x", 1.0))}

def chatty(ctx):
    """Prints ``options.mib`` MiB of numbered lines between a first and a last marker, then fails."""
    print("FIRST-LINE-OF-OUTPUT", flush=True)
    line = "x" * 88
    for i in range(int(ctx.options["mib"] * (1 << 20) / 100)):
        print(f"{i:010d}", line)
    print("LAST-LINE-OF-OUTPUT", flush=True)
    os.write(2, b"written by the C layer\\n")
    raise ValueError("last words")
'''


def write_fns(directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "fns.py").write_text(FNS)
    return directory


def request(tmp_path: Path, number: int, function: str, **kw: Any) -> TrialRequest:
    train = TrainConfig(function=function, options=kw.pop("options", {})).model_dump(mode="json")
    return TrialRequest(number, {"x": 0.5}, train, "score", "maximize", str(tmp_path / "trials" / str(number)),
                        python_path=(str(tmp_path),), **kw)


def run_one(engine: LocalEngine, req: TrialRequest, limit: float = 120.0) -> TrialResult:
    engine.submit(req)
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        for ev in engine.poll(1.0):
            if isinstance(ev, TrialResult):
                return ev
    raise TimeoutError(f"trial {req.number} did not finish in {limit} s")


def gone(pid: int, limit: float = 10.0) -> bool:
    """``pid`` ended (or is a zombie nobody reaps: init in some containers) within ``limit`` s."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


# -- which modules a worker unloads ----------------------------------------------------------------
def test_a_worker_unloads_the_trials_own_modules_and_never_a_library(tmp_path: Path) -> None:
    proj, libdir = tmp_path / "proj", tmp_path / "libdir"
    vendored = proj / ".venv" / "lib" / "python3.11" / "site-packages"
    for d in (proj / "userpkg", proj / "extpkg", libdir / "libfn_pkg", vendored):
        d.mkdir(parents=True)
    (proj / "usercode.py").write_text("import userpkg.sub\nSTATE = []\n")
    (proj / "userpkg" / "__init__.py").write_text("")
    (proj / "userpkg" / "sub.py").write_text("")
    (proj / "extpkg" / "__init__.py").write_text("")
    (proj / "extpkg" / "pure.py").write_text("")
    (libdir / "libmod.py").write_text("")
    (libdir / "libfn_pkg" / "__init__.py").write_text("")
    (libdir / "libfn_pkg" / "train.py").write_text("import libmod\n")
    (vendored / "vendored.py").write_text("")
    names = ["usercode", "userpkg", "userpkg.sub", "extpkg", "extpkg.pure", "extpkg._fast", "libmod", "libfn_pkg",
             "libfn_pkg.train", "vendored"]
    # the worker's sys.path before any trial: PYTHONPATH-like dirs (a library dir, a venv inside the project)
    keeper = ModuleKeeper([*sys.path, str(libdir), str(vendored)])
    keeper.start_trial()
    sys.path[:0] = [str(proj), str(libdir), str(vendored)]
    try:
        import importlib

        for name in ("usercode", "extpkg.pure", "libfn_pkg.train", "vendored"):
            importlib.import_module(name)
        fake_ext = types.ModuleType("extpkg._fast")  # an extension module of a package in the project
        fake_ext.__file__ = str(proj / "extpkg" / "_fast.cpython-311-x86_64-linux-gnu.so")
        sys.modules["extpkg._fast"] = fake_ext
        # a trial of usercode:train with the project as its python_path
        assert sorted(keeper.trial_modules((str(proj),), "usercode:train")) == [
            "usercode", "userpkg", "userpkg.sub"]
        # a trial whose function lives in a package on a library path: that package is its own code,
        # the library module it imports is not
        assert sorted(keeper.trial_modules((str(proj),), "libfn_pkg.train:fit")) == [
            "libfn_pkg", "libfn_pkg.train", "usercode", "userpkg", "userpkg.sub"]
    finally:
        for name in (*names, MARK):
            sys.modules.pop(name, None)
        for p in (str(proj), str(libdir), str(vendored)):
            sys.path.remove(p)


def test_torch_imported_by_a_trial_stays_loaded_and_user_globals_start_fresh(tmp_path: Path) -> None:
    """The module globals of the trial's code start anew in every trial (a counter reads 1 each time),
    while torch, imported by the first trial on a light worker, stays (a second import would crash)."""
    (tmp_path / "counting.py").write_text(textwrap.dedent("""
        import importlib
        import sys
        CALLS = 0

        def count(ctx):
            global CALLS
            CALLS += 1
            loaded = "torch" in sys.modules
            torch = importlib.import_module("torch")  # a name no source shows: a light worker runs it
            F = importlib.import_module("torch.nn.functional")
            x = F.relu(torch.ones(2)).sum()
            return {"score": float(CALLS), "torch_was_loaded": float(loaded), "x": float(x)}

        again = count  # another name: the engine learnt that count imports torch, not this one
    """))
    from hpoflow.engines.local import prestart

    prestart(light=1)
    eng = LocalEngine(cores=[0], prestart=False)  # the light worker only: no forkserver
    try:
        names = ["count", "again", "again"]
        results = [run_one(eng, request(tmp_path, n, f"counting:{fn}")) for n, fn in enumerate(names)]
    finally:
        eng.close()
    assert [r.status for r in results] == ["complete"] * 3, results
    assert [r.metrics["score"] for r in results] == [1.0, 1.0, 1.0]
    assert [r.metrics["torch_was_loaded"] for r in results] == [0.0, 1.0, 1.0]  # the same worker kept it


# -- workers never run the caller's __main__ ---------------------------------------------------------
TUNE = '''
import os, sys
print(f"MAIN-RAN {os.getpid()}", file=sys.stderr, flush=True)
import hpoflow
from hpoflow.engines.local import LocalEngine

RUNS = os.path.join(os.getcwd(), "runs")


def spec(name):
    return {"study": {"name": name, "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0, "high": 1}},
            "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 1, "seed": 0},
            "training": {"function": "fns:score"}}


def run():
    # the default engine (torch-free trials go to light workers, spawned) and warm workers, forked
    # from the forkserver: both start methods prepare a child from the parent's __main__ by default
    light = hpoflow.optimize(spec("light"), run_dir=os.path.join(RUNS, "light"))
    engine = LocalEngine(cores=[0])
    engine.wait_warm()
    try:
        warm = hpoflow.optimize(spec("warm"), run_dir=os.path.join(RUNS, "warm"), engine=engine)
    finally:
        engine.close()
    print("COMPLETE", light.summary.n_complete, warm.summary.n_complete, flush=True)
'''

NOTEBOOK = '''
import sys, types
main = types.ModuleType("__main__")  # a fresh __main__ without __file__, as a notebook kernel has
sys.modules["__main__"] = main
exec(compile(open(sys.argv[1]).read(), "<cell>", "exec"), main.__dict__)
'''

THREAD = '''
import threading
t = threading.Thread(target=run)
t.start()
t.join()
'''


def _invocation(mode: str, tmp_path: Path) -> tuple[list[str], str | None]:
    body = {"script": TUNE + '\nif __name__ == "__main__":\n    run()\n', "thread": TUNE + THREAD}.get(
        mode, TUNE + "\nrun()\n")
    script = tmp_path / "tune.py"
    script.write_text(body)
    if mode in ("script", "unguarded", "thread"):
        return [sys.executable, str(script)], None
    if mode == "c":
        return [sys.executable, "-c", body], None
    if mode == "stdin":
        return [sys.executable, "-"], body
    (tmp_path / "notebook.py").write_text(NOTEBOOK)
    return [sys.executable, str(tmp_path / "notebook.py"), str(script)], None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["script", "unguarded", "c", "stdin", "notebook", "thread"])
def test_the_api_runs_its_trials_however_the_caller_was_started(tmp_path: Path, mode: str) -> None:
    write_fns(tmp_path)
    argv, stdin = _invocation(mode, tmp_path)
    p = subprocess.run(argv, input=stdin, capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "COMPLETE 2 2" in p.stdout, p.stderr[-3000:]
    assert p.stderr.count("MAIN-RAN") == 1, p.stderr[-3000:]  # the caller's process only: no worker ran it


API_LIGHT = '''
import json, sys
import hpoflow

spec = {"study": {"name": "light", "metric": "value", "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0, "high": 1}},
        "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 1, "seed": 0},
        "training": {"function": "trainfns_light:forkservers_seen"}}
res = hpoflow.optimize(spec, run_dir=sys.argv[1])
metrics = [t.user_attrs["metrics"] for t in res.study.trials]

# an engine that leaves its forkserver preloaded (closed after its preload): the next study forks from it
import psutil
from hpoflow.api import prepare_spec
from hpoflow.engines.local import LocalEngine, discard_prestarted, prestart_for

engine = LocalEngine(cores=[0])
engine.wait_warm()
engine.close()
before = {p.pid for p in psutil.Process().children()}
prestart_for(prepare_spec(spec)[0])
spawned = len({p.pid for p in psutil.Process().children()} - before)
discard_prestarted()
print(json.dumps({"metrics": metrics, "spawned": spawned}))
'''


def test_the_api_runs_torch_free_trials_on_light_workers_without_starting_a_forkserver(tmp_path: Path) -> None:
    """``optimize`` boots what its study needs, as ``hpoflow run`` does (``prestart_for``): for trials whose
    code imports no torch, light workers and no forkserver, whose torch import would cost seconds of CPU
    for nothing; but where an earlier engine of the process left its forkserver preloaded, no light
    worker: the workers fork from it. A fresh interpreter: no forkserver of an earlier test is about."""
    p = subprocess.run([sys.executable, "-c", API_LIGHT, str(tmp_path / "run")], capture_output=True, text=True,
                       cwd=tmp_path, env=RUN_ENV, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["metrics"] == [{"value": 0.0, "torch_was_loaded": 0.0}] * 2, out
    assert out["spawned"] == 0, out


@pytest.mark.parametrize("case", ["main_function", "unguarded_self_import"])
def test_a_study_that_workers_cannot_run_is_refused_before_any_trial(tmp_path: Path, case: str) -> None:
    write_fns(tmp_path)
    fn = "__main__:train" if case == "main_function" else "tune:train"
    body = textwrap.dedent(f"""
        import hpoflow

        def train(ctx):
            return 1.0

        def main():
            hpoflow.optimize({{"study": {{"name": "s", "metric": "score", "direction": "maximize"}},
                              "space": {{"x": {{"type": "float", "low": 0, "high": 1}}}},
                              "search": {{"n_trials": 1}}, "training": {{"function": "{fn}"}}}},
                             run_dir="runs/s")

        main()
    """)
    (tmp_path / "tune.py").write_text(body)
    p = subprocess.run([sys.executable, "tune.py"], capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=120)
    assert p.returncode != 0
    assert "training.function" in p.stderr
    fix = "move train() into a module" if case == "main_function" else 'if __name__ == "__main__"'
    assert fix in p.stderr, p.stderr[-2000:]
    assert not list(tmp_path.glob("runs/s/trials/*"))  # no trial ran


# -- nothing a trial starts outlives it -------------------------------------------------------------
def test_a_daemonised_grandchild_dies_with_its_trial_and_the_worker_is_reused(tmp_path: Path) -> None:
    write_fns(tmp_path)
    eng = LocalEngine(cores=[0])
    try:
        first = run_one(eng, request(tmp_path, 0, "fns:daemonize"))
        assert first.status == "complete", first
        sleeper = int((tmp_path / "trials" / "0" / "sleeper.pid").read_text())
        assert gone(sleeper), f"the daemonised sleeper {sleeper} outlived its trial"
        second = run_one(eng, request(tmp_path, 1, "fns:daemonize"))  # on the same (reused) worker
        assert second.status == "complete", second
        assert gone(int((tmp_path / "trials" / "1" / "sleeper.pid").read_text()))
    finally:
        eng.close()


def test_a_daemonised_grandchild_of_a_timed_out_trial_dies_with_its_worker(tmp_path: Path) -> None:
    write_fns(tmp_path)
    eng = LocalEngine(cores=[0])
    try:
        # the timeout must fall after the trial wrote the sleeper's pid. From a cold engine, the worker's
        # start counts against it (3 s was too short at load 19); so a first trial starts the worker, and
        # the timed trial's clock runs from its dispatch to that idle worker (the pid is written ~20 ms later)
        assert run_one(eng, request(tmp_path, 1, "fns:score")).status == "complete"
        res = run_one(eng, request(tmp_path, 0, "fns:daemonize", options={"hang": True}, timeout=6.0))
    finally:
        eng.close()
    assert res.status == "failed" and "timed out" in (res.error or "")
    assert gone(int((tmp_path / "trials" / "0" / "sleeper.pid").read_text()))


def _running(p: psutil.Process) -> bool:
    """``p`` (the very process: psutil checks its start time) runs, and is no zombie."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:  # gone meanwhile
        return False


@pytest.mark.parametrize("kind", ["light", pytest.param("warm", marks=pytest.mark.slow)])
def test_a_driver_killed_alone_leaves_nothing_of_its_trials_running(tmp_path: Path, kind: str) -> None:
    """Issue 38, item 12: SIGKILL of the driver's pid alone (not its group) during trials that started a
    ``setsid`` daemon. The workers died with the driver, the daemons lived on (adopted by init), and the
    resume did not reap them. Now no process of the old run remains, and the resume completes the
    budget exactly. ``warm``: the workers are forked from the forkserver (torch preloaded), ``light``:
    spawned by the driver."""
    write_fns(tmp_path)
    function = "fns:daemonize"
    if kind == "warm":  # a module that imports torch runs on warm workers
        (tmp_path / "fns_warm.py").write_text("import torch  # noqa: F401\nfrom fns import daemonize\n")
        function = "fns_warm:daemonize"
    gate = tmp_path / "gate"
    spec = {"study": {"name": "d", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0, "high": 1}},
            "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 2, "seed": 0},
            "training": {"function": function, "options": {"gate": str(gate)}},
            "resources": {"processes": 1, "cpus_per_process": 1}, "oracle": {"enabled": False}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    args = [sys.executable, "-m", "hpoflow", "run", "spec.yaml", "--run-dir", "run"]
    driver = subprocess.Popen(args, cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    old: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240  # a bound for a hang only (torch's preload on a loaded machine)
        while len(list((tmp_path / "run" / "trials").glob("*/sleeper.pid"))) < 2:
            assert driver.poll() is None and time.monotonic() < deadline, "the trials never started their daemons"
            time.sleep(0.05)
        sleepers = {int(f.read_text()) for f in (tmp_path / "run" / "trials").glob("*/sleeper.pid")}
        old = psutil.Process(driver.pid).children(recursive=True)
        assert sleepers <= {p.pid for p in old}  # below the driver: each worker is its trials' subreaper
        os.kill(driver.pid, signal.SIGKILL)  # the driver alone: not its workers, not their daemons
        driver.wait(timeout=30)
        deadline = time.monotonic() + 30  # (they go within milliseconds; the bound tells that from never)
        while left := [p for p in old if _running(p)]:
            assert time.monotonic() < deadline, [(p.pid, p.cmdline()) for p in left]
            time.sleep(0.05)
        gate.touch()  # the resumed trials return at once
        # the resume's own final status (--json), not a third interpreter running `hpoflow status`
        r = subprocess.run([*args, "--json"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=240)
        assert r.returncode == 0, r.stderr[-2000:]
        assert json.loads(r.stdout)["n_complete"] == 2, r.stdout + r.stderr
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
        for p in old:
            with contextlib.suppress(psutil.Error):
                p.kill()


@pytest.mark.slow
def test_hpoflow_run_into_a_pipe_returns_when_the_study_ends(tmp_path: Path) -> None:
    """A daemon holding the workers' pipes kept ``hpoflow run ... | cat`` open for as long as it lived
    (here 1000 s); the pipeline must end with the study. The 240 s bound only tells "ended with the
    study" (a few seconds) from "waited for the daemon" (1000 s) on a loaded machine."""
    write_fns(tmp_path)
    spec = {"study": {"name": "d", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0, "high": 1}},
            "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 1, "seed": 0},
            "training": {"function": "fns:daemonize"}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    cmd = f"'{sys.executable}' -m hpoflow run spec.yaml --run-dir run | cat"
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=tmp_path, env=ENV, timeout=240)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "2 complete" in p.stdout, p.stdout[-2000:]
    for n in (0, 1):
        assert gone(int((tmp_path / "run" / "trials" / str(n) / "sleeper.pid").read_text()), limit=1.0)


# -- rank logs are bounded -------------------------------------------------------------------------
def _pump_through(pump: LogPump, path: Path, data: bytes) -> None:
    """Write ``data`` into a new stream of ``pump`` to ``path``, 8 kB at a time, close it and wait until the
    pump has moved it all."""
    w, stream = pump.open(str(path))
    view = memoryview(data)
    while view:
        view = view[os.write(w, view[:8192]):]
    os.close(w)
    assert pump.wait([stream], 30)


def test_a_capped_log_keeps_its_head_and_tail_and_says_what_it_dropped(tmp_path: Path) -> None:
    cap = 64 * 1024
    data = b"".join(f"{i:07d} {'y' * 92}\n".encode() for i in range(20000))  # 2 000 000 bytes
    path = tmp_path / "rank0.log"
    path.write_bytes(b"")
    pump = LogPump(cap)
    _pump_through(pump, path, data)
    pump.close()
    text = path.read_bytes()
    assert len(text) <= cap + 200
    assert text.startswith(data[: cap // 2])
    kept_tail = text[text.index(b"\n", text.index(b"bytes of output dropped")) + 1:]
    assert data.endswith(kept_tail) and len(kept_tail) > cap // 2 - 200  # whole lines, the last ones
    dropped = int(text.split(b"[hpoflow: ")[1].split()[0])
    assert cap // 2 + dropped + len(kept_tail) == len(data)


def test_no_cap_keeps_everything_and_a_log_is_appended_to(tmp_path: Path) -> None:
    path = tmp_path / "rank0.log"
    path.write_bytes(b"earlier segment\n")
    pump = LogPump(0)
    w, stream = pump.open(str(path))
    os.write(w, b"x" * 300000)
    os.close(w)
    assert pump.wait([stream], 30)
    pump.close()
    assert path.read_bytes() == b"earlier segment\n" + b"x" * 300000


def test_a_trial_printing_past_the_cap_leaves_a_bounded_log_and_its_last_words(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_fns(tmp_path)
    monkeypatch.setenv(CAP_ENV, "1")
    eng = LocalEngine(cores=[0])
    try:
        res = run_one(eng, request(tmp_path, 0, "fns:chatty", options={"mib": 6}))
    finally:
        eng.close()
    log = (tmp_path / "trials" / "0" / "rank0.log").read_bytes()
    assert len(log) <= (1 << 20) + 200
    assert log.startswith(b"FIRST-LINE-OF-OUTPUT\n")
    assert b"bytes of output dropped here" in log
    assert b"LAST-LINE-OF-OUTPUT" in log[-(1 << 19):] and b"ValueError: last words" in log[-4000:]
    assert res.status == "failed" and "last words" in (res.error or "")
    assert "ValueError: last words" in res.stderr_tail and "written by the C layer" in res.stderr_tail


def test_the_cap_holds_for_a_log_over_all_its_attempts_with_what_each_dropped(tmp_path: Path) -> None:
    """Issue 38, item 12: the cap held per attempt, and a rerun appends to the same log, so reruns
    grew it past the cap (by half the cap each). Over all attempts it keeps the first attempt's head,
    one note counting everything dropped, and the last attempt's tail."""
    cap = 64 * 1024
    path = tmp_path / "rank0.log"
    written = b""
    pump = LogPump(cap)
    try:
        for attempt in range(4):
            data = b"".join(f"{attempt} {i:07d} {'y' * 90}\n".encode() for i in range(3000))  # 300 000 bytes
            _pump_through(pump, path, data)
            written += data
            text = path.read_bytes()
            assert len(text) <= cap + 200, (attempt, len(text))
            assert text.startswith(written[: cap // 2])
            assert text.count(b"bytes of output dropped") == 1
            kept_tail = text[text.index(b"\n", text.index(b"bytes of output dropped")) + 1:]
            assert data.endswith(kept_tail) and len(kept_tail) > cap // 2 - 200  # this attempt's last lines
            dropped = int(text.split(b"[hpoflow: ")[1].split()[0])
            assert cap // 2 + dropped + len(kept_tail) == len(written), attempt
    finally:
        pump.close()


def test_a_rerun_trial_that_prints_past_the_cap_keeps_its_log_within_it(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    write_fns(tmp_path)
    monkeypatch.setenv(CAP_ENV, "1")
    eng = LocalEngine(cores=[0])
    try:
        for attempt in range(3):  # a trial rerun after a failure or an interrupt appends to its rank log
            res = run_one(eng, request(tmp_path, 0, "fns:chatty", options={"mib": 2}, attempt=attempt))
            assert res.status == "failed"
            log = (tmp_path / "trials" / "0" / "rank0.log").read_bytes()
            assert len(log) <= (1 << 20) + 200, (attempt, len(log))
            assert log.startswith(b"FIRST-LINE-OF-OUTPUT\n") and b"ValueError: last words" in log[-4000:]
    finally:
        eng.close()


def test_a_cluster_rank_log_is_capped_by_its_node_launcher(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hpoflow.engines.cluster.attempt import run_trial

    write_fns(tmp_path)
    monkeypatch.setenv(CAP_ENV, "1")
    monkeypatch.setenv("PYTHONPATH", pythonpath(ROOT))
    req = request(tmp_path, 0, "fns:chatty", options={"mib": 4})
    res = run_trial(req.to_json(), "{}")
    logs = list((tmp_path / "trials" / "0").rglob("rank0.log"))
    assert len(logs) == 1
    log = logs[0].read_bytes()
    assert len(log) <= (1 << 20) + 200 and log.startswith(b"FIRST-LINE-OF-OUTPUT\n")
    assert b"ValueError: last words" in log[-4000:] and b"bytes of output dropped here" in log
    assert res["status"] == "failed" and "ValueError: last words" in res["stderr_tail"]


def test_a_rank_log_cap_that_is_not_a_number_is_refused_before_any_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpoflow.engines import check_fit

    monkeypatch.setenv(CAP_ENV, "lots")
    with pytest.raises(EngineError, match=f"{CAP_ENV} must be a whole number of MiB.*'lots'.*Fix"):
        check_fit("local", {}, TrialRequest.shape(1, 1, 0))  # what validate checks
    with pytest.raises(EngineError, match=f"{CAP_ENV} must be a whole number of MiB.*'lots'.*Fix"):
        LocalEngine(cores=[0], prestart=False)


# -- rendezvous directories ------------------------------------------------------------------------
def _rdzv_dirs() -> set[str]:
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    import tempfile

    base = base or tempfile.gettempdir()
    return {os.path.join(base, n) for n in os.listdir(base) if n.startswith("hpoflow-rdzv-flock-")}


def _locked_in_session(dirs: set[str], session: int) -> set[str]:
    """Those of ``dirs`` whose flock (``/proc/locks``) a process of session ``session`` holds: the
    rendezvous directories of one driver, though other test processes make theirs meanwhile."""
    holders: dict[int, int] = {}  # inode -> pid holding its flock
    for line in Path("/proc/locks").read_text().splitlines():
        parts = line.split()
        if len(parts) > 5 and parts[1] == "FLOCK" and parts[4].isdigit():
            holders[int(parts[5].rsplit(":", 1)[-1])] = int(parts[4])
    out = set()
    for d in dirs:
        with contextlib.suppress(OSError):
            pid = holders.get(os.stat(d).st_ino)
            if pid is not None and os.getsid(pid) == session:
                out.add(d)
    return out


@pytest.mark.slow
def test_a_driver_killed_with_sigkill_leaves_no_rendezvous_directory_behind(tmp_path: Path) -> None:
    from hpoflow.train.rendezvous import private_dir, remove_private_dir, sweep_private_dirs

    write_fns(tmp_path)
    (tmp_path / "fns.py").write_text(FNS + "\ndef hold(ctx):\n    time.sleep(600)\n    return 1.0\n")
    spec = {"study": {"name": "k", "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0, "high": 1}},
            "search": {"n_trials": 1}, "training": {"function": "fns:hold"},
            "resources": {"processes": 2, "cpus_per_process": 1}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))
    before = _rdzv_dirs()
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow", "run", "spec.yaml", "--run-dir", "run", "--quiet"],
                            cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        t0 = time.monotonic()
        while not (tmp_path / "run" / "trials" / "0" / "rank1.log").exists():
            assert time.monotonic() - t0 < 180 and proc.poll() is None, "the trial never started"
            time.sleep(0.05)
        mine = _locked_in_session(_rdzv_dirs() - before, proc.pid)
        assert len(mine) == 1  # made (and locked) by this driver for the two-rank trial
        os.kill(proc.pid, signal.SIGKILL)  # the driver alone: its workers follow it (parent-death signal)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the forkserver, in the driver's group
    assert mine <= _rdzv_dirs()  # left behind by the kill...
    held = private_dir()  # ...while a live process's own directory is never taken
    try:
        removed = sweep_private_dirs(min_age_s=0)  # what the next engine (or compss attempt) does first
        assert set(removed) >= mine and held not in removed
        assert not (mine & _rdzv_dirs()) and os.path.isdir(held)
    finally:
        remove_private_dir(held)


BYTECODE = '''
import json, sys
import hpoflow

spec = {"study": {"name": "bytecode", "metric": "value", "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0, "high": 1}},
        "search": {"algorithm": "random", "n_trials": 3, "max_concurrent": 1, "seed": 0},
        "training": {"function": "bytecode_fns:probe"}}
res = hpoflow.optimize(spec, run_dir=sys.argv[1])
print(json.dumps(sorted(([t.number, t.user_attrs["metrics"]] for t in res.study.trials))))
'''

BYTECODE_FNS = '''
import os, sys

FROM_CACHE = float(os.path.exists(__cached__))  # at import: was this module's bytecode there already?


def probe(ctx):
    return {"value": 1.0, "from_cache": FROM_CACHE, "writes": float(not sys.dont_write_bytecode)}
'''


def test_with_bytecode_writing_off_a_trials_module_is_compiled_once_into_a_private_cache(tmp_path: Path) -> None:
    """``PYTHONDONTWRITEBYTECODE`` (set in many container images): each trial imports the user's module anew,
    which compiled its source every time. Workers keep its bytecode in a cache of this user's (under the
    temporary directory, mode 0700) instead, and nothing is written beside the user's code."""
    (tmp_path / "bytecode_fns.py").write_text(BYTECODE_FNS)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**RUN_ENV, "PYTHONDONTWRITEBYTECODE": "1", "TMPDIR": str(tmp)}
    p = subprocess.run([sys.executable, "-c", BYTECODE, str(tmp_path / "run")], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    metrics = [m for _, m in json.loads(p.stdout.strip().splitlines()[-1])]
    # compiled once (by the first trial, or by the check that the workers can import it) and read back since
    assert [m["from_cache"] for m in metrics[1:]] == [1.0, 1.0] and {m["writes"] for m in metrics} == {1.0}, metrics
    cache = tmp / f"hpoflow-pycache-{os.getuid()}"
    assert (cache.stat().st_mode & 0o777) == 0o700
    assert list(cache.rglob("bytecode_fns.*.pyc")) and not (tmp_path / "__pycache__").exists()


def test_the_bytecode_cache_is_used_only_where_it_is_this_users_alone(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from hpoflow.engines.local._modules import cache_bytecode

    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    monkeypatch.setattr(sys, "pycache_prefix", None)
    name = f"hpoflow-pycache-{os.getuid()}"
    loose = tmp_path / "loose"
    (loose / name).mkdir(parents=True, mode=0o755)
    os.chmod(loose / name, 0o755)  # (the umask may have kept it from 0755)
    assert cache_bytecode(str(loose)) is None and sys.dont_write_bytecode  # others may write there: not used
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / name).symlink_to(tmp_path)
    assert cache_bytecode(str(linked)) is None and sys.pycache_prefix is None
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert cache_bytecode(str(fresh)) == str(fresh / name) == sys.pycache_prefix and not sys.dont_write_bytecode
    assert (fresh / name).stat().st_mode & 0o777 == 0o700
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert cache_bytecode(str(fresh)) is None  # an interpreter's own prefix (set above) is kept


GC_FNS = '''
import gc, os, time


def collections(ctx):
    """How many collections of each generation this worker (its pid) has made so far; sleeps
    ``options.sleep`` s."""
    time.sleep(float(ctx.options.get("sleep", 0.0)))
    stats = gc.get_stats()
    return {"value": 0.0, "young": float(stats[1]["collections"]), "full": float(stats[2]["collections"]),
            "pid": float(os.getpid())}
'''


def test_a_short_cpu_trial_is_followed_by_a_young_collection_and_a_long_one_by_a_full_one(tmp_path: Path) -> None:
    """The collection after each trial is on the path to the next one in the worker: a full one costs
    0.3-0.7 ms however little the trial left (``_worker.FULL_GC_AFTER_S``), so after a short CPU trial only
    the young generations are collected; a trial of a second or more gets a full collection."""
    (tmp_path / "gc_fns.py").write_text(GC_FNS)
    engine = LocalEngine(cores=[0])
    engine.wait_warm()  # one warm worker from here on (a light one would retire when it came up)
    try:
        def run(n: int, sleep: float) -> dict[str, float]:
            train = TrainConfig(function="gc_fns:collections", options={"sleep": sleep}).model_dump(mode="json")
            req = TrialRequest(n, {}, train, "value", "minimize", str(tmp_path / str(n)), python_path=(str(tmp_path),))
            engine.submit(req)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                for ev in engine.poll(1.0):
                    if isinstance(ev, TrialResult):
                        assert ev.status == "complete", ev
                        return ev.metrics
            raise AssertionError("no result in 120 s")

        # one core, one warm worker: every trial runs in it (each worker counts its own collections, so the
        # last four on one pid are compared)
        seen = [run(n, 0.0) for n in range(8)]
        same = [m for m in seen if m["pid"] == seen[-1]["pid"]][-4:]
        assert len(same) == 4, seen
        full, young = [m["full"] for m in same], [m["young"] for m in same]
        assert full[-1] - full[0] <= 1 and young[-1] - young[0] >= 3, same  # (1: the interpreter's own, maybe)
        after_long = run(10, FULL_GC_AFTER_S)  # the trial after it sees its full collection
        later = run(11, 0.0)
        assert later["pid"] == after_long["pid"] and later["full"] >= after_long["full"] + 1, (after_long, later)
    finally:
        engine.close()
