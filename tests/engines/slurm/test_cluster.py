"""The slurm engine on a real SLURM cluster: slurmctld on a bridge, one slurmd per network namespace
(tests/infra/slurm.py). Every study here is started with the real CLI, the way a user would:
``hpoflow launch SPEC --engine slurm`` (steps mode: the driver in a batch job, its trials on node agents,
the default, or each trial a job step with ``engine_options.agents: off``) or ``hpoflow run`` on the
"login node" (jobs mode: each trial a batch job). tests/engines/slurm/test_agents.py has the agents' own.

Bounds on time are generous on purpose: SLURM polls its jobs every second or two, and the machine
these run on may be loaded; they bound a hang, not a speed.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from tests.conftest import ROOT
from tests.infra.slurm import SlurmCluster

pytestmark = pytest.mark.slow

JOB_WAIT_S = 600  # a whole study of a few short trials; bounds a hang


def _spec(path: Path, **extra: Any) -> Path:
    data: dict[str, Any] = {
        "study": {"name": "ddp2", "metric": "loss", "direction": "minimize"},
        "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
        "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 2, "seed": 0},
        "training": {"function": "trainfns:ddp_identical", "epochs": 1},
        "resources": {"processes": 2, "nodes": 2},
        "engine": "slurm",
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _env(cluster: SlurmCluster) -> dict[str, str]:
    return {**cluster.env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}


def launch(cluster: SlurmCluster, spec: Path, run_dir: Path, *args: str) -> str:
    """``hpoflow launch SPEC --engine slurm`` from the tests directory; the driver's job id."""
    r = cluster.run(["python", "-m", "hpoflow", "launch", str(spec), "--engine", "slurm", "--run-dir", str(run_dir),
                     "--time", "20", "--signal", "60", *args], env=_env(cluster), cwd=ROOT / "tests")
    found = re.search(r"submitted job (\d+)", r.stdout)
    assert found, r.stdout + r.stderr
    return found.group(1)


def wait_job(cluster: SlurmCluster, job: str, timeout: float = JOB_WAIT_S) -> dict[str, str]:
    """Wait until job ``job`` (every task of an array) has ended; its ``scontrol show job`` fields."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ids = cluster.run(["squeue", "-h", "-j", job, "-o", "%i"], check=False).stdout.split()
        if not ids:
            return cluster.job_info(job)
        time.sleep(1.0)
    raise AssertionError(f"job {job} did not end within {timeout} s: {cluster.job_info(job)}")


def _study(run_dir: Path) -> optuna.Study:
    from hpoflow.run.open import load_run

    return load_run(run_dir)[0]


def _rank_hosts(trial_dir: Path) -> dict[int, tuple[str, str]]:
    """rank -> (node, address) of its latest attempt, from the rank logs (steps mode: each attempt's
    rank says where it runs as its first line; the logs of a retried trial hold both attempts)."""
    out = {}
    for log in sorted(trial_dir.glob("rank*.log")):
        found = re.findall(r"rank (\d+) of \d+ .*? on node (\S+) \(([\d.]+)", log.read_text())
        if found:
            rank, node, address = found[-1]
            out[int(rank)] = (node, address)
    return out


def test_steps_mode_runs_each_2_node_trial_as_a_step_whose_ranks_meet_across_the_veth(
        slurm_cluster: SlurmCluster) -> None:
    shared = slurm_cluster.shared_dir / "steps-ddp"
    spec, run_dir = _spec(shared / "ddp.yaml", engine_options={"agents": "off"}), shared / "run"
    job = launch(slurm_cluster, spec, run_dir, "--nodes", "2")
    info = wait_job(slurm_cluster, job)
    out = (run_dir / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    study = _study(run_dir)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2, out
    # the ranks meet over the fabric where the nodes have one (the site profile), else the one network
    addresses = set((slurm_cluster.fabric_addresses or slurm_cluster.node_addresses).values())
    for t in study.trials:
        hosts = _rank_hosts(run_dir / "trials" / str(t.number))
        assert sorted(h for h, _ in hosts.values()) == ["n1", "n2"], hosts  # one rank on each node
        assert {a for _, a in hosts.values()} == addresses
        metrics = t.user_attrs["metrics"]
        assert metrics["world"] == 2.0 and metrics["weight_spread"] == 0.0 and metrics["moved"] > 0  # DDP in sync
    assert "Traceback" not in out


def test_jobs_mode_runs_each_trial_as_its_own_batch_job_from_the_login_node(
        slurm_cluster: SlurmCluster, tmp_path: Path) -> None:
    shared = slurm_cluster.shared_dir / "jobs-ddp"
    spec = _spec(shared / "ddp.yaml", engine_options={"mode": "jobs", "poll_interval_s": 0.2})
    run_dir = shared / "run"
    r = slurm_cluster.run(["python", "-m", "hpoflow", "run", str(spec), "--run-dir", str(run_dir)],
                          env=_env(slurm_cluster), cwd=ROOT / "tests", timeout=JOB_WAIT_S, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    study = _study(run_dir)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    for t in study.trials:
        trial_dir = run_dir / "trials" / str(t.number)
        nodes = sorted(re.search(r"node \d+ on (\S+):", p.read_text()).group(1)  # type: ignore[union-attr]
                       for p in trial_dir.glob("node*.log"))
        assert nodes == ["n1", "n2"]  # a node launcher on each node of the trial's job
        assert t.user_attrs["metrics"]["weight_spread"] == 0.0
        assert (trial_dir / "attempt-0" / "job.sh").read_text().startswith("#!/bin/sh")
        # the ranks met at rank 0's announced TCP store, with no file store (no lock) on the shared disk
        assert len((trial_dir / "attempt-0" / "rendezvous.addr").read_text().split()) == 2
        assert not list(trial_dir.rglob("*.store"))


def _launched_study(cluster: SlurmCluster, spec: Path, data: dict[str, Any]) -> tuple[optuna.Study, str]:
    """Write ``data`` to ``spec``, run it with ``hpoflow launch --nodes 2`` into ``run`` beside it, and
    wait for the job, which must complete: the study and the job's output."""
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = spec.parent / "run"
    job = launch(cluster, spec, run_dir, "--nodes", "2")
    info = wait_job(cluster, job)
    out = (run_dir / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    return _study(run_dir), out


def test_the_digits_example_runs_in_steps_mode(slurm_cluster: SlurmCluster) -> None:
    shared = slurm_cluster.shared_dir / "digits"
    data = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    data["engine"] = "slurm"
    data["search"]["n_trials"] = 4
    data["training"]["epochs"] = 3
    study, out = _launched_study(slurm_cluster, shared / "digits.yaml", data)
    assert sum(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials) == 4, out
    assert all(t.value is not None and t.value > 0.5 for t in study.trials)  # it learnt
    assert (shared / "run" / "trials.csv").exists() and (shared / "run" / "best.yaml").exists()


def test_the_plain_torchrun_script_runs_as_a_2_node_command_trial_in_steps_mode(slurm_cluster: SlurmCluster) -> None:
    """examples/scripts/train_ddp.py, as it is, one rank on each node: its ranks meet at MASTER_ADDR,
    rank 0's address on the network gloo uses, which rank 0's rank process chose and told the other."""
    shared = slurm_cluster.shared_dir / "command"
    data = yaml.safe_load((ROOT / "examples" / "scripts" / "ddp.yaml").read_text())
    data["engine"] = "slurm"
    data["search"].update(n_trials=1)
    data["training"]["command"][1] = str(ROOT / "examples" / "scripts" / "train_ddp.py")
    data["training"]["command"][-1] = "2"  # --epochs
    data["resources"]["nodes"] = 2
    study, out = _launched_study(slurm_cluster, shared / "ddp.yaml", data)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE], out
    trial_dir = shared / "run" / "trials" / "0"
    hosts = _rank_hosts(trial_dir)
    assert sorted(h for h, _ in hosts.values()) == ["n1", "n2"], hosts  # one rank on each node
    masters = {re.findall(r"MASTER_ADDR=(\S+) MASTER_PORT=(\d+)", (trial_dir / f"rank{r}.log").read_text())[-1]
               for r in (0, 1)}
    assert len(masters) == 1 and next(iter(masters))[0] == hosts[0][1], (masters, hosts)  # rank 0's address
    assert re.findall(r"^epoch=(\d) val_loss=", (trial_dir / "rank0.log").read_text(), re.M) == ["1", "2"]


def _paced_spec(path: Path, n_trials: int, epochs: int, engine_options: dict[str, Any] | None = None,
                **resources: Any) -> Path:
    """A study of ``n_trials`` trials at once, of one rank each unless ``resources`` say otherwise, that
    train ``trainfns:paced_epochs``: epochs of 0.7 s of sleep, each ended as the built-in trainer ends
    one (an all-reduce, a report, a checkpoint on every rank, ``should_stop()``), checkpoints kept 2 and
    written in the background. For the tests of where and when trials stop, rerun and resume (a node or
    an agent lost, a walltime warning, a job array of drivers): they need epochs that last and a
    checkpoint to resume from, not the CPU of the digits CNN they trained before (about 0.7 CPU-s an
    epoch here). The digits example test trains the built-in CNN."""
    data: dict[str, Any] = {
        "study": {"name": "paced", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
        "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": n_trials, "seed": 42},
        "training": {"function": "trainfns:paced_epochs", "epochs": epochs,
                     "checkpoint": {"every": 1, "keep": 2, "async": True}},
        "resources": {"processes": 1, "cpus_per_process": 1, **resources},
        "engine": "slurm",
    }
    if engine_options:
        data["engine_options"] = engine_options
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def _wait_for(what: str, ok: Any, timeout: float = JOB_WAIT_S, every: float = 0.5) -> None:
    end = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {timeout} s")
        time.sleep(every)


def _reported_epochs(run_dir: Path) -> dict[int, int]:
    """trial number -> epochs it reported so far (read from the study while it runs)."""
    try:
        study = _study(run_dir)
    except Exception:  # not started yet
        return {}
    return {t.number: max(t.intermediate_values, default=0) for t in study.get_trials(deepcopy=False)}


def _start_the_requeued_job_soon(cluster: SlurmCluster, job: str) -> None:
    """Once ``job`` is back in the queue after a requeue and its first run has left every node, let it
    start: SLURM holds a requeued job until ``cred_expire`` + 1 s (121 s by default) have passed, a wait
    that tests nothing here. Not in the second of the requeue: slurmd refuses a credential made in the
    second the job's old one was revoked ("Job credential revoked"), which the hold exists to avoid;
    2 s later is past it (and ``StartTime=now`` schedules it at once, a later start only at the
    scheduler's next periodic pass)."""
    def requeued() -> bool:
        info = cluster.job_info(job)
        return info.get("JobState") == "PENDING" and int(info.get("Restarts", "0")) >= 1

    _wait_for("the job to be requeued", requeued)
    cluster.wait_idle()  # no node still completing the first run
    time.sleep(2.0)  # past the second of the revocation (slurmd compares whole seconds)
    cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])


def test_a_walltime_warning_pauses_the_trials_with_a_checkpoint_and_the_requeued_job_finishes_the_study(
        slurm_cluster: SlurmCluster) -> None:
    from hpoflow.run.ledger import ATTR_REPLACES, count_finished

    shared = slurm_cluster.shared_dir / "walltime"
    spec, run_dir = _paced_spec(shared / "paced.yaml", n_trials=3, epochs=8), shared / "run"
    job = launch(slurm_cluster, spec, run_dir, "--nodes", "2", "--requeue")
    _wait_for("a trial's second epoch", lambda: max(_reported_epochs(run_dir).values(), default=0) >= 2)
    slurm_cluster.run(["scancel", "--batch", "--signal=USR1", job])  # what --signal=B:USR1@S does
    _start_the_requeued_job_soon(slurm_cluster, job)
    info = wait_job(slurm_cluster, job)
    out = "\n".join(p.read_text() for p in (run_dir / "launch").glob("slurm-*.out"))
    assert info["JobState"] == "COMPLETED", (info, out, slurm_cluster.logs())
    # the first run paused, then requeued itself (the line before scontrol: the run ends as SLURM takes it)
    assert "walltime warning" in out and "requeueing job" in out, out
    study = _study(run_dir)
    assert count_finished(study) == 3, out
    reruns = [t for t in study.trials if ATTR_REPLACES in t.user_attrs]
    assert reruns, "no trial was running when the warning came"
    for t in reruns:
        paused = study.trials[int(t.user_attrs[ATTR_REPLACES])]
        assert "paused" in paused.user_attrs.get("error", ""), paused.user_attrs
        done_before = max(paused.intermediate_values, default=0)
        # no epoch that had been checkpointed is rerun: it resumes where the paused trial stood
        assert t.user_attrs["metrics"]["resumed_from_epoch"] == done_before, (done_before, t.user_attrs)
        assert t.state == optuna.trial.TrialState.COMPLETE


def _checkpointed_epochs(trial_dir: Path) -> dict[int, int]:
    """rank -> the latest epoch whose checkpoint file is on disk (with ``keep: 2`` epoch 2's is gone by
    epoch 4: a poller slowed by load must look for any epoch past the one it needs)."""
    from hpoflow.train.checkpoint import parse_name

    out: dict[int, int] = {}
    for f in (trial_dir / "checkpoints").glob("ckpt-*"):
        step_rank = parse_name(f.name)
        if step_rank is not None:
            out[step_rank[1]] = max(out.get(step_rank[1], 0), step_rank[0])
    return out


@pytest.mark.parametrize("agents", ["off", "on"])
def test_a_node_taken_down_mid_trial_reruns_its_trial_on_the_other_node_from_its_checkpoint(
        slurm_cluster: SlurmCluster, agents: str) -> None:
    """Each trial a step (agents off), or the trials of node agents (on: the agents' step outlives the
    node, ``srun --no-kill``, and the agent on the node left runs the rerun). 10 paced epochs: the node
    goes down once the trial on it has checkpointed epoch 2 and 4 or more epochs are left, with the other
    trial as far from its end, so the rerun waits for n1."""
    n_epochs = 10
    shared = slurm_cluster.shared_dir / f"nodefail-{agents}"
    spec = _paced_spec(shared / "paced.yaml", n_trials=2, epochs=n_epochs, processes=2, nodes=1,  # a node each
                       engine_options={"agents": agents})
    run_dir = shared / "run"
    _checkpointed_epochs(run_dir)  # its first call imports torch (seconds on a loaded machine): not in the window
    job = launch(slurm_cluster, spec, run_dir, "--nodes", "2")
    victims: list[int] = []

    def on_n2() -> bool:
        """A trial whose ranks run on n2, each with a checkpoint of epoch 2 to ``n_epochs - 4`` on disk (the
        newest: the writes are async) and so epochs still to train (a finished trial has nothing left to
        rerun). Read from the trial's own files, as the ranks write them: on a loaded machine the study's
        reports lagged the ranks by seconds, and a trial first seen there near its end was missed."""
        for trial_dir in sorted((run_dir / "trials").glob("[0-9]*")):
            hosts = _rank_hosts(trial_dir)
            saved = _checkpointed_epochs(trial_dir)
            if hosts and {h for h, _ in hosts.values()} == {"n2"} and \
                    2 <= min(saved.get(0, 0), saved.get(1, 0)) <= n_epochs - 4:
                victims.append(int(trial_dir.name))
                return True
        return False

    _wait_for("a trial on n2 with two epochs checkpointed", on_n2, every=0.3)
    victim = victims[-1]
    try:
        slurm_cluster.down_node("n2")
        info = wait_job(slurm_cluster, job)
    finally:
        slurm_cluster.resume_node("n2")
    out = (run_dir / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    study = _study(run_dir)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2, out
    t = study.trials[victim]
    assert t.user_attrs.get("attempts") == 2, t.user_attrs  # retried once, as the same trial
    assert t.user_attrs["metrics"]["resumed_from_epoch"] >= 2  # from its checkpoint, not from scratch
    second = _rank_hosts(run_dir / "trials" / str(victim))
    assert {h for h, _ in second.values()} == {"n1"}, second  # the rerun ran on the node that was left
    if agents == "on":
        assert "node agent on n2 lost" in out, out
        return
    # ...once n1 had room: it waited in the engine, not in srun (which SLURM 22.05 wakes only a minute later)
    rerun_srun = (run_dir / "trials" / str(victim) / "attempt-1" / "srun.log").read_text()
    assert "Requested nodes are busy" not in rerun_srun, rerun_srun
    assert "left the allocation" in out, out


def test_the_compss_engines_multi_node_trial_starts_its_node_launchers_with_srun_on_the_hosts_compss_names(
        slurm_cluster: SlurmCluster, compss_task_on_distinct_slurm_hosts: tuple[dict[str, Any], Path]) -> None:
    """The compss engine's task body (``run_task``), as a COMPSs worker runs it on the executing node of a
    @multinode task: COMPSS_HOSTNAMES lists the other node first and the executing node last, and the
    launchers go out through srun (compss.launcher's default). COMPSs itself cannot run here; everything
    after it placed the task does. The job runs once per session (tests/engines/conftest.py);
    test_compss_placement.py checks its placement."""
    result, shared = compss_task_on_distinct_slurm_hosts
    trial_dir = shared / "trials" / "0"
    returncode, stderr, output = result["_job"]
    assert returncode == 0 and result["status"] == "complete", (stderr, result, output)
    assert result["metrics"]["weight_spread"] == 0.0 and result["metrics"]["world"] == 2.0
    nodes = {int(m.group(1)): m.group(2) for p in trial_dir.glob("node*.log")
             if (m := re.search(r"node (\d+) on (\S+):", p.read_text()))}
    assert nodes == {0: "n1", 1: "n2"}, nodes  # rank 0 and the rendezvous on the executing node
    assert "gloo interface eth0" in (trial_dir / "node0.log").read_text()
    host, _port = (trial_dir / "attempt-0" / "rendezvous.addr").read_text().split()
    assert host == slurm_cluster.node_addresses["n1"]  # rank 0's store (on n1), on the interface gloo uses
    assert not list(trial_dir.rglob("*.store"))  # no file store on the shared disk


def test_a_job_array_of_two_drivers_finishes_one_study_with_exactly_n_trials(slurm_cluster: SlurmCluster) -> None:
    """``hpoflow launch --drivers 2``: two array tasks, each a driver in its own allocation and run
    directory, on one journal in the shared directory."""
    from hpoflow.run.ledger import ATTR_DRIVER, count_finished
    from hpoflow.run.open import load_run

    shared = slurm_cluster.shared_dir / "array"
    spec = _paced_spec(shared / "paced.yaml", n_trials=6, epochs=2)
    data = yaml.safe_load(spec.read_text())
    data["storage"] = str(shared / "study.journal")  # one study every driver reaches
    data["search"]["max_concurrent"] = 2
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    run_dir = shared / "run"
    job = launch(slurm_cluster, spec, run_dir, "--nodes", "1", "--drivers", "2")
    assert "#SBATCH --array=0-1" in (run_dir / "launch" / "driver.sbatch").read_text()
    wait_job(slurm_cluster, job)
    outs = {p.name: p.read_text() for p in (run_dir / "launch").glob("slurm-*.out")}
    assert len(outs) == 2, outs  # one output per array task
    for name in ("driver-0", "driver-1"):
        assert (run_dir / name / "run.json").exists(), outs
    study, _ = load_run(run_dir / "driver-0")
    assert count_finished(study) == 6, outs
    drivers = {t.user_attrs.get(ATTR_DRIVER) for t in study.trials if t.state.is_finished()}
    assert len(drivers) == 2, drivers  # both drivers ran trials of the one study
    for text in outs.values():
        assert "Traceback" not in text


def test_a_batch_script_without_a_signal_still_pauses_its_trials_before_the_walltime(
        slurm_cluster: SlurmCluster) -> None:
    """A hand-written batch script (no --signal): the driver reads its job's end from SLURM and warns
    itself HPOFLOW_WALLTIME_WARNING_S before it, also when the limit changes while the job runs. The job
    starts with 10 minutes; once its trials train, ``scontrol update TimeLimit=3`` puts its end 3 minutes
    after its start, so the 170-s warning is due at once: the driver's next look at squeue (every
    second here) pauses the trials, long before SLURM would kill them."""
    shared = slurm_cluster.shared_dir / "no-signal"
    spec = _paced_spec(shared / "paced.yaml", n_trials=2, epochs=100_000)  # runs until paused, on any machine
    run_dir = shared / "run"
    script = shared / "job.sh"
    script.write_text("#!/bin/bash\n"
                      f"export PYTHONPATH={ROOT}:{ROOT / 'tests'}\n"
                      "export HPOFLOW_WALLTIME_WARNING_S=170 HPOFLOW_WALLTIME_POLL_S=1\n"
                      f"exec python -m hpoflow run {spec} --run-dir {run_dir}\n")
    r = slurm_cluster.run(["sbatch", "--parsable", "-N2", "--exclusive", "--time=10", f"--chdir={shared}",
                           f"--output={shared}/job.out", str(script)])
    job = r.stdout.strip()
    _wait_for("a trial's first epoch", lambda: max(_reported_epochs(run_dir).values(), default=0) >= 1)
    assert "walltime warning" not in (shared / "job.out").read_text()  # 10 minutes: not due yet
    slurm_cluster.run(["scontrol", "update", f"JobId={job}", "TimeLimit=3"])
    info = wait_job(slurm_cluster, job)
    out = (shared / "job.out").read_text()
    assert "walltime warning" in out, out  # paused by its own timer, not killed at the limit
    assert info["JobState"] in ("FAILED", "COMPLETED") and info["ExitCode"].startswith("130"), (info, out)
    study = _study(run_dir)
    paused = [t for t in study.trials if "paused" in t.user_attrs.get("error", "")]
    assert paused, [t.user_attrs for t in study.trials]


def _scheduler_spec(path: Path, scheduler: dict[str, Any], n_trials: int, epochs: int,
                    roots: list[dict[str, float]], slots: int = 2) -> Path:
    """A small built-in study (an MLP on digits, sgd) run as job steps with ``search.scheduler``; ``roots``
    are its first configurations (``search.enqueue``), so which trial leads is known."""
    data = {
        "study": {"name": f"sched-{scheduler['type']}", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 1e-4, "high": 0.2, "log": True},
                  "momentum": {"type": "float", "low": 0.0, "high": 0.95}},
        "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": slots, "seed": 1, "enqueue": roots,
                   "scheduler": scheduler},
        "training": {"model": "mlp", "dataset": "digits", "epochs": epochs, "batch_size": 32, "optimizer": "sgd",
                     "lr": "${lr}", "momentum": "${momentum}", "seed": 5, "checkpoint": {"every": 1, "keep": 2}},
        "resources": {"processes": 1, "cpus_per_process": 1},
        "engine": "slurm",
        "oracle": {"enabled": False},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# search.scheduler on the slurm engine (docs/schedulers.md), one test per scheduler
LEAD = {"lr": 0.05, "momentum": 0.5}  # learns fastest: trial 0 leads its rungs, member 0 its population
SLOW = [{"lr": 0.0005, "momentum": 0.0}, {"lr": 0.001, "momentum": 0.0}, {"lr": 0.0008, "momentum": 0.0}]


def test_promotion_asha_runs_its_trials_as_job_steps(slurm_cluster: SlurmCluster) -> None:
    """Promotion ASHA pauses a trial at its rung through the answer file and resumes it from its
    checkpoint in a later step."""
    from hpoflow.run.ledger import ATTR_SEGMENTS, count_finished

    shared = slurm_cluster.shared_dir / "schedulers"
    lead, slow = LEAD, SLOW
    # One slot: trial 0 reaches its first rung before another trial starts, so it is alone there and
    # pauses. With two, trial 1 got there first now and then, and trial 0 was promoted at once.
    asha = _scheduler_spec(shared / "asha.yaml", {"type": "asha", "min_resource": 1, "reduction_factor": 2},
                           n_trials=4, epochs=3, roots=[lead, *slow], slots=1)
    job = launch(slurm_cluster, asha, shared / "asha-run", "--nodes", "2")
    info = wait_job(slurm_cluster, job)
    out = (shared / "asha-run" / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    study = _study(shared / "asha-run")
    assert count_finished(study) == 4, out
    paused = {t.number: t for t in study.trials if t.user_attrs.get(ATTR_SEGMENTS)}
    assert 0 in paused, out  # alone at its first rung when it reached it: it paused there
    first_pause = paused[0].user_attrs[ATTR_SEGMENTS][0]["step"]
    assert max(paused[0].intermediate_values) > first_pause, out  # promoted: a later step trained past it


def test_pbt_starts_an_interval_from_its_parents_checkpoint_as_a_job_step(slurm_cluster: SlurmCluster) -> None:
    """PBT starts an interval from a copy of its parent's checkpoint on the shared file system."""
    from hpoflow.run.ledger import ATTR_LINEAGE, is_counted

    shared = slurm_cluster.shared_dir / "schedulers"
    lead, slow = LEAD, SLOW
    pbt = _scheduler_spec(shared / "pbt.yaml", {"type": "pbt", "population": 2, "interval": 1, "quantile": 0.5,
                                               "resample_probability": 0.0, "perturb": [2.0]},
                          n_trials=100, epochs=3, roots=[lead, slow[0]], slots=1)
    # One slot: the leader's interval always ends before the slow member's next decision, so the slow
    # member has a donor that is not behind it. With two, whichever ends an interval first decides
    # alone, and the exploit the test looks for happens only when the leader wins that race.
    job = launch(slurm_cluster, pbt, shared / "pbt-run", "--nodes", "2")
    info = wait_job(slurm_cluster, job)
    out = (shared / "pbt-run" / "launch" / f"slurm-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    study = _study(shared / "pbt-run")
    trials = study.get_trials(deepcopy=False)
    counted = is_counted(trials)
    done = [t for t in trials if counted(t) and t.state == optuna.trial.TrialState.COMPLETE]
    lineage = [t.user_attrs[ATTR_LINEAGE] for t in done]
    pairs = sorted((lin["member"], lin["interval"]) for lin in lineage)
    assert len(pairs) == len(set(pairs)) and all(lin["end"] <= 3 for lin in lineage), pairs  # each interval once
    assert any(lin["donor"] is not None for lin in lineage), lineage  # the slow member copied the leader
    for t in done:
        parent = t.user_attrs[ATTR_LINEAGE]["parent"]
        if parent is not None:  # resumed from the checkpoint copied from its parent, at the parent's end
            assert t.user_attrs["metrics"]["resumed_from_epoch"] == study.trials[parent].user_attrs[ATTR_LINEAGE]["end"]
