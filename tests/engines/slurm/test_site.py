"""The slurm engine on the "site" profile of the test cluster (tests/infra/slurm.py): memory is a
consumable resource (CR_Core_Memory, no DefMemPerCPU), nodes have 2 cores x 2 threads, and 4 GRES
GPUs each (stand-in device files). Each study runs as a user at a GPU site runs one: ``hpoflow run``
inside ``salloc`` with the flags such users pass, its trials job steps of that allocation.

The trials train with ``trainfns_light:site_probe``: each rank writes what it saw (CUDA_VISIBLE_DEVICES, its
node, the interval it ran in) beside its rank log. Bounds on time bound a hang, not a speed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

from tests.conftest import ROOT
from tests.engines.slurm.test_cluster import _checkpointed_epochs, _paced_spec, _wait_for
from tests.infra.slurm import SlurmCluster

pytestmark = pytest.mark.slow

STUDY_WAIT_S = 600  # a whole study of a few short trials; bounds a hang
WAITED = ("Requested nodes are busy", "step creation temporarily disabled", "Memory required by task is not available")


def _spec(path: Path, **extra: Any) -> Path:
    data: dict[str, Any] = {
        "study": {"name": "site", "metric": "ok", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1}},
        "search": {"algorithm": "random", "n_trials": 2, "max_concurrent": 2, "seed": 0},
        "training": {"function": "trainfns_light:site_probe", "epochs": 1},
        "resources": {"processes": 1},
        "engine": "slurm",
        # each trial a job step: these tests are about how SLURM places a step (its CPUs, GPUs, memory)
        "engine_options": {"poll_interval_s": 0.1, "agents": "off"},
    }
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def run_in_salloc(cluster: SlurmCluster, salloc: list[str], spec: Path, run_dir: Path,
                  probe_s: float = 3.0, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``salloc FLAGS python -m hpoflow run SPEC``, as a user types it on a login node (here: the host)."""
    env = {"PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "SITE_PROBE_S": str(probe_s), **(env or {})}
    return cluster.run(["salloc", *salloc, sys.executable, "-m", "hpoflow", "run", str(spec), "--run-dir",
                        str(run_dir)], env=env, cwd=ROOT / "tests", timeout=STUDY_WAIT_S, check=False,
                       stdin=subprocess.DEVNULL)


def start_in_salloc(cluster: SlurmCluster, salloc: list[str], spec: Path, run_dir: Path,
                    log: Path) -> subprocess.Popen[str]:
    """``run_in_salloc`` in the background, its output into ``log``."""
    env = {**cluster.env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"}
    with open(log, "w") as out:
        return subprocess.Popen(["salloc", *salloc, sys.executable, "-m", "hpoflow", "run", str(spec), "--run-dir",
                                 str(run_dir)], env=env, cwd=ROOT / "tests", stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, text=True)


def _nodes_of(trial_dir: Path) -> dict[int, str]:
    """rank -> the node its latest attempt runs on, from the rank logs' first lines."""
    out = {}
    for log in sorted(trial_dir.glob("rank*.log")):
        found = re.findall(r"rank (\d+) of \d+ .*? on node (\S+) ", log.read_text(errors="replace"))
        if found:
            out[int(found[-1][0])] = found[-1][1]
    return out


def _down_a_node_of_the_trial_after_epoch_2(cluster: SlurmCluster, run_dir: Path,
                                            proc: subprocess.Popen[str], crash: bool = False) -> str:
    """Once trial 0 (8 epochs) has a checkpoint of epoch 2 or later on disk for both ranks and 3 epochs
    or more still to train, take its rank 1's node down (``crash``: SIGKILL its slurmd, slurmstepd, the
    ranks, everything in the node's namespace, a power cut as SLURM sees it: the node stops answering and
    is marked down ``SlurmdTimeout`` s later); its name. (With ``keep: 2`` epoch 2's file is gone by epoch
    4, and the paced epochs do not slow down with the machine's load: a poller slowed by load looks for
    any epoch from 2 to 5.)"""
    trial_dir = run_dir / "trials" / "0"

    def saved() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"the study ended before its node could be taken down (exit {proc.returncode})")
        newest = _checkpointed_epochs(trial_dir)
        return 2 <= min(newest.get(0, 0), newest.get(1, 0)) <= 5

    _wait_for("trial 0's checkpoint of epoch 2 to 5", saved, STUDY_WAIT_S, every=0.3)
    victim = _nodes_of(trial_dir)[1]
    if crash:
        cluster.kill_node(victim)
    else:
        cluster.down_node(victim)
    return victim


def _study_losing_a_node(cluster: SlurmCluster, salloc: list[str], spec: Path, run_dir: Path,
                         log: Path) -> tuple[subprocess.Popen[str], str, str]:
    """Run the study in ``salloc SALLOC --no-kill`` (the allocation outlives a node), take a node of its
    trial down after epoch 2, and wait for the study's end; every node is resumed afterwards, also after
    a failure. The finished process, the node taken down, and the study's output."""
    proc = start_in_salloc(cluster, [*salloc, "--no-kill"], spec, run_dir, log)
    try:
        victim = _down_a_node_of_the_trial_after_epoch_2(cluster, run_dir, proc)
        proc.wait(STUDY_WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
        for name in cluster.node_names:
            cluster.resume_node(name, check=False)
    return proc, victim, log.read_text()


def _study(run_dir: Path) -> optuna.Study:
    from hpoflow.run.open import load_run

    return load_run(run_dir)[0]


def _probes(trial_dir: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem.removeprefix("probe")): json.loads(p.read_text()) for p in trial_dir.glob("probe*.json")}


def _srun_logs(run_dir: Path) -> str:
    return "\n".join(p.read_text(errors="replace") for p in sorted(run_dir.glob("trials/*/*/srun.log")))


def _completed(r: subprocess.CompletedProcess[str], run_dir: Path, n: int) -> optuna.Study:
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    study = _study(run_dir)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * n, (
        out + _srun_logs(run_dir) + "".join(p.read_text() for p in run_dir.glob("trials/*/*/rank*.log")))
    assert "Traceback" not in out
    return study


def test_two_one_rank_trials_run_side_by_side_in_an_allocation_of_4_gpus_and_3000_mb(
        slurm_site_cluster: SlurmCluster) -> None:
    shared = slurm_site_cluster.shared_dir / "site-memory"
    spec, run_dir = _spec(shared / "s.yaml"), shared / "run"
    r = run_in_salloc(slurm_site_cluster, ["-N1", "-c4", "--gpus-per-node=4", "--mem=3000"], spec, run_dir,
                      probe_s=4)
    study = _completed(r, run_dir, 2)
    a, b = (_probes(run_dir / "trials" / str(t.number))[0] for t in study.trials)
    assert a["start"] < b["end"] and b["start"] < a["end"], (a, b)  # their running intervals overlap
    logs = _srun_logs(run_dir)
    assert not any(w in logs for w in WAITED), logs  # no step waited for memory (or anything else)
    # each step asked for its share of the job's memory: a core (2 of 4 CPUs) -> 1500 of 3000 MB
    assert logs.count("--mem=1500M") == 2 and "--mpi=none" in logs, logs


@pytest.mark.parametrize(("salloc", "srun_args", "nodes"), [
    (["-N1", "--gres=gpu:4"], [], 1),
    (["-N1", "--gpus-per-node=4"], [], 1),
    (["-N1", "--gres=gpu:4"], ["--gpu-bind=none"], 1),
    (["-N2", "--gpus-per-node=4"], [], 2),
], ids=["gres", "gpus-per-node", "gpu-bind-none", "2-nodes"])
def test_each_rank_of_a_2_rank_trial_gets_its_own_gpu(slurm_site_cluster: SlurmCluster, salloc: list[str],
                                                       srun_args: list[str], nodes: int) -> None:
    shared = slurm_site_cluster.shared_dir / f"site-gpus-{'-'.join(salloc + srun_args).replace('=', '')}"
    spec = _spec(shared / "s.yaml", search={"n_trials": 1, "max_concurrent": 1},
                 resources={"processes": 2, "nodes": nodes, "gpus_per_process": 1},
                 engine_options={"srun_args": srun_args})
    run_dir = shared / "run"
    r = run_in_salloc(slurm_site_cluster, [*salloc, "-c4", "--mem=3000"], spec, run_dir, probe_s=0.5)
    study = _completed(r, run_dir, 1)
    trial_dir = run_dir / "trials" / str(study.trials[0].number)
    probes = _probes(trial_dir)
    assert sorted(probes) == [0, 1]
    seen = {rank: p["cuda_visible_devices"] for rank, p in probes.items()}
    assert all(v is not None and len(v.split(",")) == 1 for v in seen.values()), seen  # exactly one GPU each
    # the GPUs differ: by the node's numbering the rank logs name (gpuN of node X)
    named = {}
    for rank in (0, 1):
        log = (trial_dir / f"rank{rank}.log").read_text()
        found = re.findall(r"rank \d+ GPUs: CUDA_VISIBLE_DEVICES=(\S+) \((gpu\d+) of node (\S+);", log)
        assert found, log
        named[rank] = found[-1]
        assert named[rank][0] == seen[rank]  # what the training process saw is what the rank chose
    assert (named[0][1], named[0][2]) != (named[1][1], named[1][2]), named
    if nodes == 2:
        assert {named[0][2], named[1][2]} == {"n1", "n2"}, named
    else:
        assert named[0][2] == named[1][2] and seen[0] != seen[1], named


def test_a_rank_given_another_ranks_gpu_fails_at_once_with_one_line(slurm_site_cluster: SlurmCluster) -> None:
    """``--gpu-bind=map_gpu:0`` binds both tasks of the step to the same GPU, as a site that binds
    wrongly would: one rank holds the GPU, the other stops before its process group forms."""
    shared = slurm_site_cluster.shared_dir / "site-gpu-clash"
    spec = _spec(shared / "s.yaml", search={"n_trials": 1, "max_concurrent": 1},
                 resources={"processes": 2, "gpus_per_process": 1, "max_retries": 2},
                 engine_options={"srun_args": ["--gpu-bind=map_gpu:0"]})
    run_dir = shared / "run"
    r = run_in_salloc(slurm_site_cluster, ["-N1", "-c4", "--gres=gpu:4", "--mem=3000"], spec, run_dir)
    study = _study(run_dir)
    (trial,) = study.trials
    assert trial.state == optuna.trial.TrialState.FAIL, r.stdout + r.stderr
    error = str(trial.user_attrs.get("error", ""))
    assert "SLURM gave one GPU to two ranks" in error and "Fix:" in error, (error, r.stdout + r.stderr)
    attempts = sorted(p.name for p in (run_dir / "trials" / str(trial.number)).iterdir() if p.is_dir())
    assert attempts == ["attempt-0"] or len([a for a in attempts if a.startswith("attempt")]) == 1, attempts
    assert not _probes(run_dir / "trials" / str(trial.number))  # neither rank trained


def test_a_share_of_a_gpu_is_refused_in_one_line_where_the_site_has_gres_shard(
        slurm_site_cluster: SlurmCluster) -> None:
    """The nodes declare 16 ``gres/shard`` each; the engine does not ask SLURM for shards, so ``hpoflow
    run`` of a spec with ``gpus_per_process: 0.25`` in an allocation, a step per trial (``agents: off``),
    stops before its first step: exit 2, one line that says the site has shards and what to set instead
    (node agents, whole GPUs or the local engine), no step, no trial directory."""
    nodes = slurm_site_cluster.run(["scontrol", "show", "node", "-o"]).stdout.splitlines()
    assert len(nodes) == len(slurm_site_cluster.node_names)
    assert all(re.search(r"\bGres=gpu:4,shard:16\b", line) for line in nodes), nodes
    shared = slurm_site_cluster.shared_dir / "site-share"
    spec = _spec(shared / "s.yaml", search={"n_trials": 1, "max_concurrent": 1},
                 resources={"processes": 1, "gpus_per_process": 0.25})
    run_dir = shared / "run"
    r = run_in_salloc(slurm_site_cluster, ["-N1", "-c4", "--gres=gpu:4", "--mem=3000"], spec, run_dir)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if not line.startswith("salloc:")]
    assert r.returncode == 2 and len(lines) == 1, r.stdout + r.stderr
    (line,) = lines
    assert line.startswith("hpoflow: error: resources.gpus_per_process: 0.25 shares a GPU"), line
    assert "this cluster has gres/shard (GresTypes=gpu,shard)" in line and "does not ask SLURM for shards" in line
    assert "engine_options.agents: auto or on" in line, line
    assert "gpus_per_process: 1" in line and "local engine" in line, line
    granted = re.search(r"Granted job allocation (\d+)", r.stderr)
    assert granted, r.stderr
    # a slurmd logs "launch task StepId=J.S" for every step it starts: none of the allocation's
    slurmd_logs = "".join(p.read_text(errors="replace") for p in slurm_site_cluster.log_dir.glob("slurmd-*.log"))
    assert f"launch task StepId={granted.group(1)}." not in slurmd_logs
    assert not run_dir.exists()  # refused before the run directory (and any trial's) was made


def test_node_agents_share_one_gpu_of_the_allocation_between_trials(slurm_site_cluster: SlurmCluster) -> None:
    """``gpus_per_process: 0.25`` on node agents (``agents: on``): the allocation holds whole GPUs (here 4
    stand-in ones), the node's agent packs the trials' shares onto one of them. Two trials (a 1-CPU rank
    takes a whole core of 2 threads: 2 at once in ``-c4``) run at the same time (each waits for the other
    to arrive) on the same GPU, each capped to its quarter, and the study made one job step: the agents'."""
    shared = slurm_site_cluster.shared_dir / "site-share-agents"
    meet = shared / "meet"
    meet.mkdir(parents=True, exist_ok=True)
    spec = _spec(shared / "s.yaml", search={"n_trials": 2, "max_concurrent": 2},
                 training={"function": "trainfns:share_probe", "epochs": 1,
                           "options": {"meet": str(meet), "trials": 2, "wait_s": 120}},
                 resources={"processes": 1, "gpus_per_process": 0.25},
                 engine_options={"poll_interval_s": 0.1, "agents": "on"})
    run_dir = shared / "run"
    r = run_in_salloc(slurm_site_cluster, ["-N1", "-c4", "--gres=gpu:4", "--mem=3000"], spec, run_dir)
    study = _completed(r, run_dir, 2)
    seen = [json.loads((run_dir / "trials" / str(t.number) / "share.json").read_text()) for t in study.trials]
    assert all(s["arrived"] == 2 and s["HPOFLOW_GPU_SHARE"] == "0.25" for s in seen), seen
    gpus = {s["CUDA_VISIBLE_DEVICES"] for s in seen}
    assert len(gpus) == 1 and gpus <= {"0", "1", "2", "3"}, seen  # one GPU of the 4, shared
    granted = re.search(r"Granted job allocation (\d+)", r.stderr)
    assert granted, r.stderr
    slurmd_logs = "".join(p.read_text(errors="replace") for p in slurm_site_cluster.log_dir.glob("slurmd-*.log"))
    assert len(re.findall(rf"launch task StepId={granted.group(1)}\.\d+\b", slurmd_logs)) == 1, slurmd_logs[-2000:]


def test_on_nodes_of_two_threads_per_core_the_engine_runs_what_slurm_can_place(
        slurm_site_cluster: SlurmCluster) -> None:
    """``-c4`` is 4 hardware threads: 2 cores. A 1-CPU rank takes a whole core, so 2 trials run at
    once, not 4, and no step waits in srun for a core."""
    shared = slurm_site_cluster.shared_dir / "site-threads"
    spec = _spec(shared / "s.yaml", search={"n_trials": 4, "max_concurrent": 4})
    run_dir = shared / "run"
    r = run_in_salloc(slurm_site_cluster, ["-N1", "-c4", "--mem=3000"], spec, run_dir, probe_s=3)
    study = _completed(r, run_dir, 4)
    spans = [(p["start"], p["end"]) for t in study.trials for p in _probes(run_dir / "trials" / str(t.number)).values()]
    most = max(sum(1 for s, e in spans if s <= t < e) for t, _ in spans)
    assert most == 2, spans  # two at once: never more (no room), and not fewer (the room is used)
    logs = _srun_logs(run_dir)
    assert not any(w in logs for w in WAITED), logs


@pytest.mark.parametrize("site_env", [{"NCCL_SOCKET_IFNAME": "fab0"}, {}], ids=["the-site-names-it", "nothing-named"])
def test_the_ranks_of_a_2_node_trial_meet_without_a_file_store_over_the_fabric(
        slurm_site_cluster: SlurmCluster, site_env: dict[str, str]) -> None:
    """Each node has a rate-limited management network (eth0: SLURM's addresses, the launch node's
    route) and a fabric (fab0). Whether a site's module names the fabric (NCCL_SOCKET_IFNAME) or
    nothing does, the trial's store and its all-reduces travel the fabric."""
    cluster = slurm_site_cluster
    assert cluster.net is not None
    shared = cluster.shared_dir / f"site-fabric-{'-'.join(site_env) or 'none'}"
    floats, steps = 1_000_000, 10  # 4 MB all-reduced 10 times: each rank sends about 40 MB
    spec = _spec(shared / "s.yaml", search={"n_trials": 1, "max_concurrent": 1},
                 training={"function": "trainfns:allreduce_volume", "epochs": 1,
                           "options": {"floats": floats, "steps": steps}},
                 resources={"processes": 2, "nodes": 2}, study={"name": "fabric", "metric": "loss",
                                                                "direction": "minimize"})
    run_dir = shared / "run"

    def counters() -> dict[tuple[int, str], int]:  # bytes each node sent on each network
        assert cluster.net is not None
        return {(i, ifname): cluster.net.byte_counters(i, ifname)[1] for i in range(2) for ifname in ("eth0", "fab0")}

    before = counters()
    r = run_in_salloc(cluster, ["-N2", "-c2", "--mem=2000"], spec, run_dir, env=site_env)
    sent = {k: v - before[k] for k, v in counters().items()}
    study = _completed(r, run_dir, 1)
    trial_dir = run_dir / "trials" / str(study.trials[0].number)
    attempt = trial_dir / "attempt-0"
    assert not list(trial_dir.rglob("*.store")), list(trial_dir.rglob("*"))  # no file store on the shared disk
    host, _port = (attempt / "rendezvous.addr").read_text().split()
    assert host in cluster.fabric_addresses.values(), (host, cluster.fabric_addresses)  # the store on the fabric
    logs = {rank: (trial_dir / f"rank{rank}.log").read_text() for rank in (0, 1)}
    for log in logs.values():
        assert "gloo interface fab0" in log, log
    assert f"rank 0 holds the trial's TCP store at {host}:" in logs[0], logs[0]
    volume = 4 * floats * steps
    for i in range(2):
        assert sent[(i, "fab0")] >= 0.8 * volume, sent  # the all-reduces went over the fabric...
        assert sent[(i, "eth0")] < 0.1 * volume, sent  # ...and not over management (SLURM's own traffic only)


@pytest.mark.parametrize("agents", ["off", "on"])
def test_a_2_node_trial_whose_node_goes_down_resumes_from_its_checkpoint_on_the_two_nodes_left(
        slurm_site_cluster: SlurmCluster, agents: str) -> None:
    """Each trial a step (agents off), or on node agents (on: the agent of the node taken down is lost,
    the rerun's two shares go to the agents of the two nodes left)."""
    cluster = slurm_site_cluster
    shared = cluster.shared_dir / f"site-node-loss-3-{agents}"
    spec = _paced_spec(shared / "s.yaml", 1, 8, engine_options={"agents": agents}, processes=2, nodes=2)
    run_dir = shared / "run"
    # 4 CPUs a node: SLURM 22.05 keeps the failed step's CPUs (2 on each node left) for the job's life,
    # and the rerun takes the other 2 of the node that is left of the failed step's
    proc, victim, out = _study_losing_a_node(cluster, ["-N3", "-c4", "--mem=2000"], spec, run_dir, shared / "out.txt")
    assert proc.returncode == 0, out
    (trial,) = _study(run_dir).trials
    assert trial.state == optuna.trial.TrialState.COMPLETE, out
    assert trial.user_attrs.get("attempts") == 2, trial.user_attrs  # rerun once, as the same trial
    assert trial.user_attrs["metrics"]["resumed_from_epoch"] >= 2, trial.user_attrs  # from its checkpoint
    rerun = _nodes_of(run_dir / "trials" / "0")
    assert len(set(rerun.values())) == 2 and victim not in rerun.values(), (victim, rerun)  # the two nodes left
    if agents == "on":
        assert f"node agent on {victim} lost" in out, out
        return
    assert f"node(s) {victim} left the allocation" in out, out
    # SLURM 22.05 keeps the failed step's CPUs on the node left: the engine plans around them, and no step
    # asks for --overlap (which would stop SLURM keeping the study's steps apart)
    assert "--overlap" not in (run_dir / "trials" / "0" / "attempt-1" / "srun.log").read_text()


def test_with_one_node_left_a_2_node_trial_stops_as_interrupted_keeps_its_retries_and_resumes_later(
        slurm_site_cluster: SlurmCluster) -> None:
    cluster = slurm_site_cluster
    shared = cluster.shared_dir / "site-node-loss-2"
    spec = _paced_spec(shared / "s.yaml", 1, 8, engine_options={"agents": "off"}, processes=2, nodes=2)
    run_dir = shared / "run"
    proc, _victim, out = _study_losing_a_node(cluster, ["-N2", "-c2", "--mem=2000"], spec, run_dir, shared / "out.txt")
    assert proc.returncode == 1 and "Traceback" not in out, out
    stopped = [line for line in out.splitlines() if line.startswith("hpoflow: stopped:")]
    assert len(stopped) == 1 and "can no longer run a trial of 2 node(s)" in stopped[0], out  # one line
    first = _study(run_dir).trials[0]
    assert first.user_attrs.get("attempts", 1) == 1, first.user_attrs  # no retry spent
    assert str(first.user_attrs.get("error", "")).startswith("interrupted:"), first.user_attrs
    # where it fits again (both nodes up), the same command finishes it from its checkpoint
    cluster.wait_idle()
    r = run_in_salloc(cluster, ["-N2", "-c2", "--mem=2000"], spec, run_dir)
    assert r.returncode == 0, r.stdout + r.stderr
    done = [t for t in _study(run_dir).trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 1 and done[0].user_attrs["metrics"]["resumed_from_epoch"] >= 2, done


STAT_CALLS = ("stat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2")


def test_a_studys_ranks_make_no_periodic_stat_on_the_run_directory(slurm_site_cluster: SlurmCluster) -> None:
    """``strace -f -e trace=%file`` on every rank process of a 2-node trial for 10 s of its steady state
    (a collective and a report with a pruning decision every 0.2 s): not one stat-like call on a path
    under the run directory (no STOP or PAUSE file watched, no answer file waited for: decisions come
    by rank 0's control socket)."""
    import shutil

    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (Debian: apt-get install strace)")
    cluster = slurm_site_cluster
    shared = cluster.shared_dir / "site-no-stat"
    spec = _spec(shared / "s.yaml", search={"n_trials": 1, "max_concurrent": 1,
                                            "pruner": {"type": "median", "options": {"startup_trials": 0}}},
                 training={"function": "trainfns:slow_reports", "epochs": 1, "options": {"steps": 150, "step_s": 0.2}},
                 resources={"processes": 2, "nodes": 2, "timeout": 600},
                 study={"name": "nostat", "metric": "loss", "direction": "minimize"})
    run_dir = shared / "run"
    proc = start_in_salloc(cluster, ["-N2", "-c2", "--mem=2000"], spec, run_dir, shared / "out.txt")
    try:
        trial_dir = run_dir / "trials" / "0"
        reports = trial_dir / "attempt-0" / "reports.jsonl"

        def reported_3() -> bool:
            if proc.poll() is not None:
                raise AssertionError((shared / "out.txt").read_text())
            return reports.exists() and len(reports.read_text().splitlines()) >= 3

        _wait_for("trial 0's third report", reported_3, STUDY_WAIT_S, every=0.3)
        ranks = {p.name for p in Path("/proc").iterdir() if p.name.isdigit() and _is_rank_of(p, str(run_dir))}
        # every process of both ranks: the task processes and the rank children they forked (strace -f
        # follows only what forks after it attached)
        pids = sorted(ranks)
        assert len([pid for pid in pids if _ppid(pid) not in ranks]) >= 2, ranks  # both ranks' task processes
        reports_before = len(reports.read_text().splitlines())
        argv = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", str(shared / "strace.txt")]
        for pid in pids:
            argv += ["-p", pid]
        tracer = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(10.0)
        tracer.terminate()
        tracer.wait(60)
        reports_during = len(reports.read_text().splitlines())
    finally:
        proc.kill()
        proc.wait(60)
        cluster.ensure_healthy()
    trace = (shared / "strace.txt").read_text(errors="replace").splitlines()
    assert any("/proc/" in line for line in trace), trace[:20]  # it traced them (their usage samples read /proc)
    assert reports_during - reports_before >= 2, (reports_before, reports_during)  # decided while traced
    under_run_dir = [line for line in trace if str(run_dir) in line]
    stats = [line for line in under_run_dir if re.search(rf"\b({'|'.join(STAT_CALLS)})\(", line)]
    assert not stats, stats[:20]
    assert not [line for line in under_run_dir if "answer-" in line or "/STOP" in line or "/PAUSE" in line]


def _ppid(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]
    except (OSError, IndexError):
        return ""


def _is_rank_of(proc: Path, run_dir: str) -> bool:
    try:
        cmd = (proc / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    text = b" ".join(cmd).decode(errors="replace")
    return "hpoflow.engines.cluster.node step" in text and run_dir in text
