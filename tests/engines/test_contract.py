"""The engine contract (hpoflow/engines/base.py), one suite for every engine that runs here.

Each engine runs the same trials, described by their params (tests/trainfns.py:behave): the
threads engine calls the behaviour in a thread, the local engine in warm worker processes, the
compss engine in its sequential mode (the task body and rank processes, without the runtime), the
slurm engine in jobs mode on the real namespace cluster (tests/infra/slurm.py: each trial a batch job).
Assertions are on events and their order, never on wall-clock bounds. One meaning of
``resources.timeout`` for elastic trials: the whole trial, from its first start over every size (the
simulated engine's check, on its virtual clock, is the last test here).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines import Engine, TrialReport, TrialRequest, TrialResult
from hpoflow.engines.compss import CompssEngine
from hpoflow.engines.local import LocalEngine
from hpoflow.engines.threads import Reporter, ThreadEngine
from hpoflow.errors import EngineError
from hpoflow.spec import TrainConfig
from tests.conftest import ROOT
from tests.infra.fixtures import USES_SLURM_CLUSTER

ENGINES = ["threads", "local", "compss", pytest.param("slurm", marks=[pytest.mark.slow, USES_SLURM_CLUSTER])]
PYPATH = (str(ROOT / "tests"),)
# The trial of every test (the engine fixture sets it): trainfns_light:behave is torch-free, so the
# compss and slurm engines' rank processes start without importing torch (~2 CPU-s each); the local
# engine runs its torch-importing twin, trainfns:behave (the same function), on warm workers, forked
# from the preloaded forkserver (a torch-free one could go to a light worker, whichever is idle first).
TRIAL_FUNCTION = "trainfns_light:behave"
if PYPATH[0] not in sys.path:  # the threads engine imports trainfns in this process
    sys.path.insert(0, PYPATH[0])


def _thread_objective(params: dict[str, Any], reporter: Reporter) -> Any:
    from tests.trainfns_light import behave_params

    return behave_params(params, lambda step, **m: reporter.report(step, **m))


@pytest.fixture(params=ENGINES)
def engine(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    name = request.param
    eng: Engine
    if name == "threads":
        eng = ThreadEngine(_thread_objective, slots=2)
    elif name == "local":
        eng = LocalEngine()
        monkeypatch.setitem(globals(), "TRIAL_FUNCTION", "trainfns:behave")
    elif name == "slurm":
        from hpoflow.engines.slurm.engine import SlurmEngine
        from hpoflow.engines.slurm.options import SlurmOptions

        cluster = request.getfixturevalue("slurm_cluster")
        cluster.wait_idle()
        for key in [k for k in os.environ if k.startswith("SLURM_")]:
            monkeypatch.delenv(key)
        monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        eng = SlurmEngine(SlurmOptions(mode="jobs", poll_interval_s=0.1), tmp_path / "slurm-run")
    else:
        eng = CompssEngine(tmp_path / "compss-run", sequential=True, poll_interval_s=0.05, slots=2)
    try:
        yield eng
    finally:
        eng.close()


def req(tmp_path: Path, number: int, metric: str = "value", **params: Any) -> TrialRequest:
    shape = {k: params.pop(k) for k in ("processes", "cpus_per_process", "gpus_per_process", "timeout",
                                         "attempt", "pruning") if k in params}
    train = TrainConfig(function=TRIAL_FUNCTION, epochs=1).model_dump(mode="json")
    return TrialRequest(number, params, train, metric, "maximize", str(tmp_path / "trials" / str(number)),
                        python_path=PYPATH, **shape)


def drain(engine: Engine, n_results: int, limit_s: float = 180.0) -> list[TrialReport | TrialResult]:
    """Every event until ``n_results`` results came (a generous limit only guards against a hang)."""
    events: list[TrialReport | TrialResult] = []
    end = time.monotonic() + limit_s
    while sum(isinstance(e, TrialResult) for e in events) < n_results:
        if time.monotonic() > end:
            raise TimeoutError(f"no {n_results} results; events so far: {events}")
        for ev in engine.poll(0.5):
            events.append(ev)
            if isinstance(ev, TrialReport) and ev.wants_answer:
                engine.answer(ev.number, False)
    return events


def results(events: list[TrialReport | TrialResult]) -> dict[int, TrialResult]:
    return {e.number: e for e in events if isinstance(e, TrialResult)}


def test_a_trial_completes_with_its_value(engine: Engine, tmp_path: Path) -> None:
    engine.submit(req(tmp_path, 0, value=0.75))
    assert engine.running() == [0]
    res = results(drain(engine, 1))[0]
    assert (res.status, res.value) == ("complete", 0.75)
    assert engine.running() == []


def test_reports_come_before_the_one_result(engine: Engine, tmp_path: Path) -> None:
    engine.submit(req(tmp_path, 0, reports=3, pruning=True))
    events = drain(engine, 1)
    kinds = [(type(e).__name__, getattr(e, "step", None)) for e in events]
    assert kinds == [("TrialReport", 0), ("TrialReport", 1), ("TrialReport", 2), ("TrialResult", None)]
    assert all(e.wants_answer for e in events if isinstance(e, TrialReport))


def test_results_arrive_in_completion_order(engine: Engine, tmp_path: Path) -> None:
    if engine.capacity(req(tmp_path, 0)) < 2:
        pytest.skip("the engine runs one trial at a time here (compss sequential mode)")
    engine.submit(req(tmp_path, 0, sleep=3.0, value=0.0))
    engine.submit(req(tmp_path, 1, value=1.0))
    order = [e.number for e in drain(engine, 2) if isinstance(e, TrialResult)]
    assert order == [1, 0]


def test_an_exception_in_user_code_fails_the_trial_and_is_not_retryable(engine: Engine, tmp_path: Path) -> None:
    engine.submit(req(tmp_path, 0, mode="raise"))
    res = results(drain(engine, 1))[0]
    assert res.status == "failed" and not res.retryable
    assert "boom from user code" in (res.error or "")


def test_a_killed_rank_fails_the_trial_as_retryable(engine: Engine, tmp_path: Path) -> None:
    if isinstance(engine, ThreadEngine):
        pytest.skip("a thread has no process to kill")
    engine.submit(req(tmp_path, 0, mode="crash"))
    res = results(drain(engine, 1))[0]
    assert res.status == "failed" and res.retryable, res


def test_a_trial_past_its_timeout_is_stopped_and_not_retryable(engine: Engine, tmp_path: Path) -> None:
    if isinstance(engine, ThreadEngine):
        pytest.skip("a thread cannot be stopped from outside")
    engine.submit(req(tmp_path, 0, sleep=120.0, timeout=1.0))
    res = results(drain(engine, 1))[0]
    assert res.status == "failed" and not res.retryable, res  # it would run as long again
    assert "timeout" in (res.error or "").lower() or "time" in (res.error or "").lower()


def test_cancel_ends_a_running_trial_with_status_cancelled(engine: Engine, tmp_path: Path) -> None:
    if isinstance(engine, ThreadEngine):
        pytest.skip("a thread cannot be stopped from outside")
    engine.submit(req(tmp_path, 0, sleep=120.0, reports=1, pruning=True))
    events: list[Any] = []
    while not events:  # the trial is running once its first report arrives
        events = [e for e in engine.poll(0.5) if isinstance(e, TrialReport)]
    engine.answer(0, False)
    engine.cancel(0, "test")
    res = results(drain(engine, 1))[0]
    assert res.status == "cancelled", res


def test_a_retry_runs_as_a_new_attempt_in_the_same_trial_directory(engine: Engine, tmp_path: Path) -> None:
    engine.submit(req(tmp_path, 0, mode="raise"))
    assert results(drain(engine, 1))[0].status == "failed"
    engine.submit(req(tmp_path, 0, attempt=1, value=2.0))
    res = results(drain(engine, 1))[0]
    assert (res.status, res.value) == ("complete", 2.0)


def test_capacity_says_what_fits(engine: Engine, tmp_path: Path) -> None:
    assert engine.capacity(req(tmp_path, 0)) >= 1
    if isinstance(engine, LocalEngine):
        huge = req(tmp_path, 1, processes=64, cpus_per_process=4)
        assert engine.capacity(huge) == 0
        with pytest.raises(EngineError, match="cores"):
            engine.submit(huge)


def test_a_rank_gets_the_cores_it_asked_for(engine: Engine, tmp_path: Path) -> None:
    if isinstance(engine, ThreadEngine):
        pytest.skip("threads share the driver's process: no placement")
    engine.submit(req(tmp_path, 0, metric="threads", cpus_per_process=2 if isinstance(engine, LocalEngine) else 1))
    res = results(drain(engine, 1))[0]
    assert res.status == "complete", res
    assert res.metrics["threads"] == (2.0 if isinstance(engine, LocalEngine) else 1.0)


def test_an_elastic_trials_timeout_bounds_the_whole_trial_over_its_resizes(engine: Engine, tmp_path: Path) -> None:
    """Every size of an elastic trial is a restart (a new process group; on compss a new task), but the
    timeout is not: it runs from the trial's first start. The trial grows after two 5-s epochs, the grow
    does not pay (``split: false``: two ranks take twice as long), so it shrinks back after two 10-s
    epochs, then runs two more 5-s ones: 40 s of work, over the 35-s timeout, while each run is under it
    by a margin for rank start-up on a loaded machine (the first, 10 s of work, leaves 25 s: fresh ranks
    importing torch took over 15 s at load 14 on 2 cores). With a timeout per size, the compss engine
    would complete this trial."""
    if isinstance(engine, ThreadEngine):
        pytest.skip("the threads engine has no elastic trials")
    train = TrainConfig(function="trainfns:elastic_epochs", epochs=6,
                        options={"epochs": 6, "work_s": 5.0, "split": False}).model_dump(mode="json")
    request = TrialRequest(0, {}, train, "loss", "minimize", str(tmp_path / "trials" / "0"), python_path=PYPATH,
                           elastic_sizes=(1, 2), timeout=35.0)
    if not isinstance(engine, LocalEngine | CompssEngine):  # the slurm engine does not resize trials
        with pytest.raises(EngineError, match="elastic"):
            engine.submit(request)
        return
    engine.submit(request)
    res = results(drain(engine, 1))[0]
    resizes = tmp_path / "trials" / "0" / "elastic.jsonl"
    assert resizes.exists() and resizes.read_text().splitlines(), res  # it did run on more than one size
    assert res.status == "failed" and not res.retryable, res
    assert "timed out after 35 s (resources.timeout" in (res.error or ""), res.error


def test_the_simulated_engine_times_an_elastic_trial_out_over_its_whole_run() -> None:
    """On the virtual clock: a trial of 100 s on one slot grows onto the idle second one (1.8x faster),
    and still fails at exactly 40 s, its resources.timeout."""
    from hpoflow.engines.simulated import SimulatedEngine
    from hpoflow.engines.simulated.costs import TrialCost
    from hpoflow.engines.simulated.options import ElasticOptions, SimulatedOptions

    curve = [{"loss": 1.0 / (k + 1)} for k in range(10)]
    engine = SimulatedEngine(SimulatedOptions(slots=2, lognormal={}, elastic=ElasticOptions(max_slots=2)),
                             cost=lambda r: TrialCost(100.0, {"loss": 0.1}, curve))
    engine.submit(TrialRequest(0, {}, {}, "loss", "minimize", "/nowhere", elastic_sizes=(1, 2), timeout=40.0))
    events = []
    while engine.running():
        events += engine.poll(None)
    res = results(events)[0]
    assert res.status == "failed" and not res.retryable and res.error == "timed out after 40 s (resources.timeout)"
    assert engine.clock == 40.0 and engine.stats()["resizes"] >= 1
