"""Distinct hosts for multi-node trials: the shape that cannot fit twice on one worker, and the recovery
when COMPSs puts two nodes of a task on one host anyway (docs/cluster.md, "Where a multi-node trial's
nodes land").

COMPSs schedules the actions of a ``@multinode`` task independently, so ``COMPSS_HOSTNAMES`` may name a
host twice. With ``compss.cpus_per_node`` known, every node of a multi-node trial asks for a whole
worker, and that cannot happen. Without it, the task gives the duplicate share back at once (an
infrastructure result, before any rank starts), and the engine submits the same attempt again,
without counting it against ``resources.max_retries``, at most ``compss.placement_retries`` times.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines import TrialResult
from hpoflow.engines.cluster.layout import ordered_hosts, repeated_hosts
from hpoflow.engines.compss import CompssEngine, TaskShape
from hpoflow.engines.compss import CompssOptions as Opts
from hpoflow.engines.compss import engine as compss_mod
from hpoflow.engines.compss.placement import INFRASTRUCTURE, REPEATED_HOST, placement_problem, run_task
from hpoflow.errors import EngineError
from hpoflow.fileio import write_json_atomic
from hpoflow.train.transport import TrialFiles
from tests.engines._compss_slurm import task_job
from tests.engines._fakes import ROOT, make_request
from tests.engines.test_compss_engine import FakeApi


def test_a_multi_node_trial_asks_for_whole_workers_when_their_size_is_known(tmp_path: Path) -> None:
    req = make_request(tmp_path, 0, processes=4, cpus_per_process=2, gpus_per_process=1, nodes=2)
    # 2 ranks per node: 4 computing units and 2 GPUs fit twice on a 48-core 4-GPU worker...
    assert Opts().task_shape(req) == TaskShape(2, 4, 2)
    # ...so with the worker's size known, each node asks for all its 48 units: never two on one worker
    shape = Opts(cpus_per_node=48, gpus_per_node=4).task_shape(req)
    assert shape == TaskShape(2, 48, 2)
    assert shape.registration().constraints == \
        "computing_units:48;processors:[{processorType: GPU, computingUnits: 2}];"
    # a one-node trial keeps its own size (two of them may share a worker: they are different trials)
    one = make_request(tmp_path, 1, processes=2, cpus_per_process=2)
    assert Opts(cpus_per_node=48).task_shape(one) == TaskShape(1, 4)
    # a node's share that no worker holds is refused with the numbers and the fix
    with pytest.raises(EngineError, match=r"needs 6 GPUs per node .* has 4 \(compss.gpus_per_node.*Fix: raise "
                       r"--gpus-per-node"):
        Opts(cpus_per_node=48, gpus_per_node=4).task_shape(make_request(tmp_path, 2, processes=12, nodes=2,
                                                                         gpus_per_process=1))


def test_a_repeated_host_is_named(tmp_path: Path) -> None:
    env = {"COMPSS_HOSTNAMES": "n7,n7"}
    assert repeated_hosts(env) == ["n7"] and repeated_hosts({"COMPSS_HOSTNAMES": "n1,n2"}) == []
    assert repeated_hosts({}) == []
    with pytest.raises(ValueError, match=r"COMPSs placed several of its nodes on one host: COMPSS_HOSTNAMES='n7,n7' "
                       r"names n7 more than once\. Fix: give compss.cpus_per_node"):
        ordered_hosts(env, 2)
    assert placement_problem(make_request(tmp_path, 0, processes=2, nodes=2), env) is not None
    assert placement_problem(make_request(tmp_path, 0, processes=2, nodes=1), env) is None  # not multi-node


def test_the_task_gives_a_repeated_host_back_at_once_before_any_rank_starts(tmp_path: Path, fake_bin: Path) -> None:
    req = make_request(tmp_path / "trials" / "3", 3, processes=2, nodes=2, attempt=1)
    t0 = time.monotonic()
    data = run_task(req.to_json(), json.dumps(Opts().for_task()), env={"COMPSS_HOSTNAMES": "n7,n7"})
    took = time.monotonic() - t0
    assert data[INFRASTRUCTURE] == REPEATED_HOST and data["status"] == "failed" and data["retryable"] is True
    assert "names n7 more than once" in data["error"] and data["number"] == 3
    files = TrialFiles(Path(req.trial_dir), 1)
    assert json.loads(files.result.read_text()) == data  # the engine finds it where it finds every result
    assert not (tmp_path / "srun.log").exists()  # no launcher ran: nothing of the trial started
    assert not files.job.exists() and not list(Path(req.trial_dir).glob("rank*.log"))
    assert took < 5.0  # no rank, no interpreter: milliseconds (generous for a loaded machine)


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[tuple[CompssEngine, FakeApi, list[str]]]:
    """The engine in runtime mode with a fake PyCOMPSs API; its 'task' writes, for each call, the next
    placement in ``hosts`` (a task placed twice on one host gives it back, as ``run_task`` does)."""
    fake = FakeApi()
    monkeypatch.setattr(compss_mod, "runtime_active", lambda: True)
    monkeypatch.setattr(compss_mod, "api", lambda: fake)
    hosts: list[str] = []

    def task(request_json: str, options_json: str) -> Any:
        from hpoflow.trial import TrialRequest

        env = {"COMPSS_HOSTNAMES": hosts.pop(0)}
        req = TrialRequest.from_json(request_json)
        data = run_task(request_json, options_json, env=env) if placement_problem(req, env) else {
            "number": req.number, "status": "complete", "value": 0.5, "metrics": {"loss": 0.5}}
        write_json_atomic(TrialFiles(Path(req.trial_dir), req.attempt).result, data)
        return data

    eng = CompssEngine(run_dir=tmp_path, sequential=False, poll_interval_s=0.02, placement_retries=2)
    monkeypatch.setattr(eng, "_task_for", lambda req, shape: task)
    yield eng, fake, hosts
    eng._trials.clear()
    eng.close()


def _result(eng: CompssEngine) -> TrialResult:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for ev in eng.poll(0.2):
            if isinstance(ev, TrialResult):
                return ev
    raise AssertionError("no result")


def test_the_engine_submits_a_given_back_placement_again_without_a_trial_retry(
        runtime: tuple[CompssEngine, FakeApi, list[str]], tmp_path: Path) -> None:
    eng, fake, hosts = runtime
    hosts += ["n1,n1", "n2,n1"]  # first on one host twice, then on two
    eng.submit(make_request(tmp_path / "trials" / "0", 0, processes=2, nodes=2))
    res = _result(eng)
    assert res.status == "complete" and res.value == 0.5  # one result: the driver never saw the first placement
    assert res.timings["placement_retries"] == 1.0
    assert fake.groups == ["trial-0", "trial-0.p1"]  # the same attempt, as a new task in its own group
    assert eng.running() == [] and hosts == []


def test_placement_retries_are_bounded_then_the_trial_fails_retryable(
        runtime: tuple[CompssEngine, FakeApi, list[str]], tmp_path: Path) -> None:
    eng, fake, hosts = runtime
    hosts += ["n1,n1"] * 3
    eng.submit(make_request(tmp_path / "trials" / "0", 0, processes=2, nodes=2))
    res = _result(eng)
    assert res.status == "failed" and res.retryable  # now resources.max_retries counts it
    assert "given back 3 time(s) in a row; compss.placement_retries=2" in (res.error or "")
    assert "Fix: give compss.cpus_per_node" in (res.error or "")
    assert fake.groups == ["trial-0", "trial-0.p1", "trial-0.p2"]


def test_the_driver_counts_no_retry_for_a_placement_given_back(runtime: tuple[CompssEngine, FakeApi, list[str]],
                                                                tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole study through the real driver with max_retries 0: each trial's first placement is given
    back, and both trials still complete on their first attempt."""
    from hpoflow.api import optimize

    eng, fake, hosts = runtime
    hosts += ["n1,n1", "n1,n2", "n2,n2", "n1,n2"]
    spec = {"study": {"name": "placed", "metric": "loss", "direction": "minimize"},
            "space": {"x": {"type": "categorical", "choices": [1, 2]}},
            "search": {"algorithm": "grid", "max_concurrent": 1}, "engine": "compss",
            "training": {"function": "trainfns:behave", "epochs": 1},
            "resources": {"processes": 2, "nodes": 2, "max_retries": 0}}
    monkeypatch.chdir(ROOT / "tests")
    result = optimize(spec, tmp_path / "run", engine=eng, handle_signals=False)
    assert result.summary.n_complete == 2 and result.summary.n_failed == 0
    for trial in result.study.trials:
        assert "attempts" not in trial.user_attrs  # never retried as a trial
        assert trial.user_attrs["timings"]["placement_retries"] == 1.0
    assert fake.groups == ["trial-0", "trial-0.p1", "trial-1", "trial-1.p1"]


# --- on the namespace SLURM cluster (tests/infra/slurm.py) ----------------------------------------

@pytest.mark.slow
def test_on_slurm_a_task_placed_twice_on_one_host_starts_no_srun_step(slurm_cluster: Any) -> None:
    shared = slurm_cluster.shared_dir / "compss-placement-repeated"
    result = task_job(slurm_cluster, shared, "$SLURMD_NODENAME,$SLURMD_NODENAME")
    assert result[INFRASTRUCTURE] == REPEATED_HOST and result["retryable"] is True, result
    assert "names n1 more than once" in result["error"]
    trial_dir = shared / "trials" / "0"
    assert not list(trial_dir.glob("node*.log")) and not list(trial_dir.glob("rank*.log"))  # no launcher ran


@pytest.mark.slow
def test_on_slurm_the_task_body_starts_its_node_launchers_with_srun_on_distinct_hosts(
        slurm_cluster: Any, compss_task_on_distinct_slurm_hosts: tuple[dict[str, Any], Path]) -> None:
    result, shared = compss_task_on_distinct_slurm_hosts  # the job test_cluster.py's compss test checks too
    assert result["status"] == "complete" and INFRASTRUCTURE not in result, result
    assert result["metrics"]["world"] == 2.0 and result["metrics"]["weight_spread"] == 0.0
    logs = {p.name: p.read_text() for p in (shared / "trials" / "0").glob("node*.log")}
    assert "node 0 on n1:" in logs["node0.log"] and "node 1 on n2:" in logs["node1.log"], logs
