"""The slurm engine with node agents (``engine_options.agents: on``) on the real namespace cluster
(tests/infra/slurm.py): one ``srun`` step over the allocation runs an agent per node, and trials go to
the agents over TCP. A study here is started the way a user starts one, ``hpoflow launch``."""

from __future__ import annotations

import os
import re
import signal
from pathlib import Path

import optuna
import pytest

from hpoflow.engines.agent.protocol import AuthError, connect, new_secret
from tests.engines.slurm.test_cluster import (
    _checkpointed_epochs,
    _paced_spec,
    _rank_hosts,
    _reported_epochs,
    _spec,
    _study,
    _wait_for,
    launch,
    wait_job,
)
from tests.infra.slurm import SlurmCluster

pytestmark = pytest.mark.slow

AGENTS = {"agents": "on"}


def _steps_launched(cluster: SlurmCluster, job: str) -> dict[str, list[str]]:
    """Step id -> the nodes slurmd launched its tasks on, for job ``job`` (each slurmd logs ``launch task
    StepId=J.S`` once per step it runs: what ``sacct -j J`` would list, without accounting)."""
    out: dict[str, list[str]] = {}
    for log in sorted(cluster.log_dir.glob("slurmd-*.log")):
        node = log.stem.removeprefix("slurmd-")
        for step in re.findall(rf"launch task StepId={job}\.(\d+) ", log.read_text()):
            out.setdefault(step, []).append(node)
    return out


def test_agents_run_2_node_ddp_trials_in_one_step_per_node_whose_ranks_meet_across_the_veth(
        slurm_cluster: SlurmCluster) -> None:
    shared = slurm_cluster.shared_dir / "agents-ddp"
    spec = _spec(shared / "ddp.yaml", engine_options=AGENTS, search={"n_trials": 6, "max_concurrent": 2})
    run_dir = shared / "run"
    job = launch(slurm_cluster, spec, run_dir, "--nodes", "2")
    # a peer without the run's secret, on the driver's agents port, is dropped, and the study goes on
    _wait_for("the agents' step", lambda: (run_dir / "agents" / "srun.log").exists())
    port = int(re.findall(r"--port (\d+)", (run_dir / "agents" / "srun.log").read_text())[0])
    driver_node = slurm_cluster.job_info(job)["BatchHost"]
    with pytest.raises(AuthError):
        connect(slurm_cluster.node_addresses[driver_node], port, new_secret())
    # the listener is bound to the address the agents are told (the driver's node's), not to every address
    argv = (run_dir / "agents" / "srun.log").read_text().split()
    assert argv[argv.index("--host") + 1] == slurm_cluster.node_addresses[driver_node], argv
    info = wait_job(slurm_cluster, job)
    out = (run_dir / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    study = _study(run_dir)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 6, out
    addresses = set((slurm_cluster.fabric_addresses or slurm_cluster.node_addresses).values())
    for t in study.trials:
        hosts = _rank_hosts(run_dir / "trials" / str(t.number))
        assert sorted(h for h, _ in hosts.values()) == ["n1", "n2"], hosts  # one rank on each node
        assert {a for _, a in hosts.values()} == addresses  # the all-reduce crosses the veth, on the fabric
        metrics = t.user_attrs["metrics"]
        assert metrics["world"] == 2.0 and metrics["weight_spread"] == 0.0 and metrics["moved"] > 0  # DDP in sync
    # the ranks ran in the agents' warm workers (torch imported once per agent, by its forkserver), not in
    # a fresh interpreter per trial: 12 ranks (6 trials, a rank on each node) in fewer worker processes (4 per
    # agent at most: a worker per CPU slot)
    pids = [re.findall(r"in its node agent's worker \(pid (\d+)\)", p.read_text())[-1]
            for p in run_dir.glob("trials/*/rank*.log")]
    assert len(pids) == 12 and len(set(pids)) <= 8, pids
    assert "dropped a connection to the agents' port" in out, out
    # one step for the whole study: the agents', one task on each node; no step per trial
    assert _steps_launched(slurm_cluster, job) == {"0": ["n1", "n2"]}, out
    assert "Traceback" not in out


def test_an_agent_killed_mid_trial_reruns_its_trial_from_its_checkpoint_and_its_node_gets_a_new_agent(
        slurm_cluster: SlurmCluster) -> None:
    shared = slurm_cluster.shared_dir / "agents-kill"
    spec = _paced_spec(shared / "paced.yaml", n_trials=2, epochs=12, engine_options=AGENTS, processes=2,
                       nodes=1)  # a node each
    run_dir = shared / "run"
    job = launch(slurm_cluster, spec, run_dir, "--nodes", "2")

    def on_n2() -> int | None:
        for t, epochs in _reported_epochs(run_dir).items():
            hosts = _rank_hosts(run_dir / "trials" / str(t))
            # a checkpoint of epoch 2 or later for both ranks, and epochs still to train
            saved = _checkpointed_epochs(run_dir / "trials" / str(t))
            if 2 <= epochs < 12 and min(saved.get(0, 0), saved.get(1, 0)) >= 2 and hosts \
                    and {h for h, _ in hosts.values()} == {"n2"}:
                return t
        return None

    _wait_for("a trial on n2 with two epochs checkpointed", lambda: on_n2() is not None)
    victim = on_n2()
    logs = "".join(p.read_text() for p in (run_dir / "agents").glob("agent-*.out"))
    agent_pid = int(re.findall(r"hpoflow-agent\[(\d+)\]: serving .* on n2 ", logs)[0])
    os.kill(agent_pid, signal.SIGKILL)
    info = wait_job(slurm_cluster, job)
    out = (run_dir / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    study = _study(run_dir)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2, out  # exactly n_trials
    t = study.trials[victim]  # type: ignore[index]
    assert t.user_attrs.get("attempts") == 2, t.user_attrs  # retried once, as the same trial
    assert t.user_attrs["metrics"]["resumed_from_epoch"] >= 2  # from its checkpoint, not from scratch
    assert "node agent on n2 lost" in out, out
    # the node was up, only its agent gone: the driver started a new agent step there (n1 was busy with the
    # other trial, so the rerun went to n2's new agent)
    assert "node agent on n2 is back" in out, out
    assert {h for h, _ in _rank_hosts(run_dir / "trials" / str(victim)).values()} <= {"n1", "n2"}
    assert _steps_launched(slurm_cluster, job) == {"0": ["n1", "n2"], "1": ["n2"]}, out


def _one_failed_trial(cluster: SlurmCluster, spec: Path, run_dir: Path) -> tuple[optuna.trial.FrozenTrial, str, str]:
    """Launch a study of one trial on 2 nodes, wait for the job; its trial (which must have failed), the
    trial's error and the driver's output."""
    job = launch(cluster, spec, run_dir, "--nodes", "2")
    wait_job(cluster, job)
    out = (run_dir / "launch" / f"slurm-{job}.out").read_text()
    (trial,) = _study(run_dir).trials
    assert trial.state == optuna.trial.TrialState.FAIL, out
    return trial, str(trial.user_attrs.get("error", "")), out


def test_a_rank_that_dies_in_a_2_node_trial_fails_its_trial_only_and_the_agents_stay(
        slurm_cluster: SlurmCluster) -> None:
    """Rank 1 (on the second node) SIGKILLs itself while rank 0 waits in an all-reduce: the trial fails
    with rank 1's death, on its node, at once (its rank 0 on the other agent is cancelled, not left to
    its process-group timeout), and neither agent is lost."""
    shared = slurm_cluster.shared_dir / "agents-crash"
    spec = _spec(shared / "crash.yaml", engine_options=AGENTS, training={"function": "trainfns:crash_rank1"},
                 search={"n_trials": 1, "max_concurrent": 1}, resources={"processes": 2, "nodes": 2, "max_retries": 0})
    trial, error, out = _one_failed_trial(slurm_cluster, spec, shared / "run")
    assert re.search(r"rank 1 .*SIGKILL.* before it finished \(on n\d\)", error), (error, out)
    assert "node agent on" not in out, out  # the agents outlived the rank
    assert trial.user_attrs["timings"]["duration_s"] < 60, trial.user_attrs  # not the 120 s pg timeout


def test_a_rank_over_its_memory_share_fails_its_trial_and_its_agent_goes_on(slurm_cluster: SlurmCluster) -> None:
    """The agent's memory watchdog stands in for the cgroup a step of its own would have had: a rank
    holding 400 MB where its trial may hold 256 MB per rank (``resources.memory_gb: 0.25``) is stopped
    within its 20 s hold, its trial fails with one line, and the agent is not lost."""
    shared = slurm_cluster.shared_dir / "agents-memory"
    spec = _spec(shared / "mem.yaml", engine_options=AGENTS,
                 training={"function": "trainfns:hog_memory", "options": {"mb": 400, "hold_s": 20}},
                 search={"n_trials": 1, "max_concurrent": 1},
                 resources={"processes": 1, "nodes": 1, "memory_gb": 0.25, "max_retries": 0})
    trial, error, out = _one_failed_trial(slurm_cluster, spec, shared / "run")
    assert re.search(r"rank 0 on n\d held \d+ MB of memory, more than the 256 MB", error), (error, out)
    assert trial.user_attrs["timings"]["duration_s"] < 20, trial.user_attrs  # stopped, not left to finish
    assert "node agent on" not in out, out


def test_an_agent_step_that_cannot_start_stops_the_study_with_one_line_and_no_trial_spent(
        slurm_cluster: SlurmCluster) -> None:
    """The agents' interpreter cannot run (``engine_options.python: /bin/false``): the agents' step ends at
    once. Before, every trial failed at once, not as retryable, and the study exited 3 having spent 4
    trials, with no line saying that the fleet never came up. Now the driver waits for its first agent
    before it asks the study for a trial, and stops with exit 1 and one line."""
    shared = slurm_cluster.shared_dir / "agents-false"
    spec = _spec(shared / "false.yaml", engine_options={**AGENTS, "python": "/bin/false"},
                 search={"n_trials": 4, "max_concurrent": 2})
    run_dir = shared / "run"
    job = launch(slurm_cluster, spec, run_dir, "--nodes", "2")
    info = wait_job(slurm_cluster, job)
    out = (run_dir / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"].startswith("1:"), (info, out)
    errors = [line for line in out.splitlines() if line.startswith("hpoflow: error:")]
    assert len(errors) == 1 and "node agents' step ended (srun exit" in errors[0], out
    assert "Traceback" not in out, out
    assert _study(run_dir).trials == [], out  # no trial asked, none spent
