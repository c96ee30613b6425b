"""Site defaults on the "site" profile of the test cluster (tests/infra/slurm.py): a driver submitted
with ``sbatch --export=NONE`` (its batch script sets PATH, PYTHONPATH and SLURM_CONF itself, as a site's
login profile would), and two Unix users whose studies share a node. Bounds on time bound a hang, not
a speed: the machine has 2 cores, shared with whatever else runs."""

from __future__ import annotations

import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import optuna
import pytest

from tests.conftest import ROOT
from tests.engines.slurm.test_cluster import wait_job
from tests.engines.slurm.test_site import STUDY_WAIT_S, _spec, _study, run_in_salloc
from tests.infra import users
from tests.infra.slurm import SlurmCluster, write_script

pytestmark = pytest.mark.slow


def _all_complete(run_dir: Path, n: int, out: str) -> None:
    study = _study(run_dir)
    states = [t.state for t in study.trials]
    assert states == [optuna.trial.TrialState.COMPLETE] * n, (states, out, [t.user_attrs.get("error")
                                                                          for t in study.trials])


# The trials check that what the batch script set reaches them. (PYTHONPATH itself cannot be checked so:
# the engine sets the ranks' own, and this machine's hpoflow is installed, so a step's task imports it
# without one; at a site whose hpoflow is a checkout on PYTHONPATH, the step's task cannot.)
PROFILE_PROBE = '''\
import os


def probe(ctx):
    if os.environ.get("SITE_PROFILE") != "loaded":
        raise RuntimeError("SITE_PROFILE, which the batch script set, did not reach this rank")
    return {"ok": 1.0}
'''


@pytest.mark.parametrize("agents", ["off", "on"])
def test_a_study_submitted_with_sbatch_export_none_completes(slurm_site_cluster: SlurmCluster, agents: str) -> None:
    """``sbatch --export=NONE`` gives the batch script none of the submitter's variables and puts
    ``SLURM_EXPORT_ENV=NONE`` in its environment, which every srun inside takes as its ``--export``
    unless told otherwise: the trials' steps (off) or the agents' step (on) would start without what
    the batch script set (PYTHONPATH, a site module's variables) and without the agents' secret, and
    no trial would complete."""
    cluster = slurm_site_cluster
    shared = cluster.shared_dir / f"site-export-none-{agents}"
    n = 4
    shared.mkdir(parents=True, exist_ok=True)
    (shared / "profile_probe.py").write_text(PROFILE_PROBE)
    spec = _spec(shared / "s.yaml", search={"n_trials": n, "max_concurrent": 2},
                 training={"function": "profile_probe:probe", "epochs": 1},
                 engine_options={"poll_interval_s": 0.1, "agents": agents})
    run_dir = shared / "run"
    q = shlex.quote
    pythonpath = f"{ROOT}:{ROOT / 'tests'}"
    script = write_script(shared / "driver.sh", "\n".join([
        'echo "before the profile: SLURM_EXPORT_ENV=${SLURM_EXPORT_ENV:-unset} PYTHONPATH=${PYTHONPATH:-unset}"',
        "export PATH=/usr/local/bin:/usr/bin:/bin",
        f"export PYTHONPATH={q(pythonpath)}",
        f"export SLURM_CONF={q(str(cluster.conf_path))}",
        "export SITE_PROFILE=loaded  # as a site's module sets what its software needs",
        f"cd {q(str(ROOT / 'tests'))}",
        f"exec {q(sys.executable)} -m hpoflow run {q(str(spec))} --run-dir {q(str(run_dir))}",
        ""]))
    out = shared / "job.out"
    r = cluster.run(["sbatch", "--export=NONE", "--parsable", "-N1", "-c4", "--mem=3000", f"--output={out}",
                     str(script)], env={"PYTHONPATH": "/nowhere"})
    info = wait_job(cluster, r.stdout.strip().split(";")[0], STUDY_WAIT_S)
    text = out.read_text(errors="replace")
    # the condition under test: the job got nothing of the submitter's environment, and srun would export none
    assert "before the profile: SLURM_EXPORT_ENV=NONE PYTHONPATH=unset" in text, text
    assert info.get("JobState") == "COMPLETED" and "Traceback" not in text, (info, text)
    _all_complete(run_dir, n, text)


MEET_FN = '''\
"""Each user's trial says it arrived and waits until the other user's has: both ran at the same time."""
import os
import time
from pathlib import Path


def meet(ctx):
    meet = Path(ctx.options["meet"])
    (meet / f"arrived-{os.getuid()}").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    deadline = time.monotonic() + float(ctx.options["wait_s"])
    while len(list(meet.glob("arrived-*"))) < int(ctx.options["users"]):
        if time.monotonic() > deadline:
            raise TimeoutError("the other user's trial did not run at the same time")
        time.sleep(0.05)
    return {"ok": 1.0}
'''


@pytest.fixture
def two_users() -> Iterator[users.UnixUsers]:
    """Two Unix users made for the test (``useradd``) and removed after it, also when it fails."""
    reason = users.unavailable_reason()
    if reason:
        pytest.skip(f"cannot make Unix users: {reason}")
    made = users.UnixUsers(2).open(reach=[ROOT])
    try:
        yield made
    finally:
        made.close()


def test_two_users_run_studies_on_one_node_at_once_and_both_complete(slurm_site_cluster: SlurmCluster,
                                                                      two_users: users.UnixUsers) -> None:
    """Each user's study (a step per trial, one GPU per rank) runs in its own allocation on node n1, and
    their trials meet: each waits until the other's has arrived. A rank locks its GPUs in a node-local
    directory; one directory for every user, made by the first user's rank under umask 022 (1755), left
    the second user's ranks unable to make their locks (PermissionError, retried as a node failure)."""
    cluster = slurm_site_cluster
    base = cluster.shared_dir / "site-two-users"
    meet = base / "meet"
    meet.mkdir(parents=True, exist_ok=True)
    meet.chmod(0o1777)
    runs = []
    for i, name in enumerate(two_users.names):
        home = two_users.own(i, base / name)
        (home / "meetfn.py").write_text(MEET_FN)
        spec = _spec(home / "s.yaml", search={"n_trials": 1, "max_concurrent": 1},
                     training={"function": "meetfn:meet", "epochs": 1,
                               "options": {"meet": str(meet), "users": 2, "wait_s": 300}},
                     resources={"processes": 1, "gpus_per_process": 1, "max_retries": 0})
        env = {**cluster.env, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}", "HOME": str(home)}
        argv = two_users.argv(i, ["salloc", "-N1", "-w", "n1", "-c2", "--mem=1400", "--gres=gpu:2", sys.executable,
                                  "-m", "hpoflow", "run", str(spec), "--run-dir", str(home / "run")])
        log = base / f"{name}.out"
        with open(log, "w") as out:
            runs.append((subprocess.Popen(argv, env=env, cwd=home, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, text=True), home, log))
    try:
        for proc, _home, _log in runs:
            proc.wait(STUDY_WAIT_S)
    finally:
        for proc, _home, _log in runs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)
    for (proc, home, log), uid in zip(runs, two_users.uids, strict=True):
        text = log.read_text(errors="replace")
        assert proc.returncode == 0, text
        _all_complete(home / "run", 1, text)
        assert (meet / f"arrived-{uid}").exists(), text
        ranks = "".join(p.read_text(errors="replace") for p in (home / "run").glob("trials/*/rank*.log"))
        assert "rank 0 GPUs: CUDA_VISIBLE_DEVICES=" in ranks, ranks  # each rank took (and locked) its GPU
        assert Path(f"/dev/shm/hpoflow-gpus-{uid}").is_dir()  # in its user's own lock directory


@pytest.mark.parametrize("agents", ["off", "on"])
def test_nccls_prefix_form_gives_gloo_the_exact_fabric_interface(slurm_site_cluster: SlurmCluster,
                                                                 agents: str) -> None:
    """The job's environment names the fabric as NCCL takes it, by prefix (``NCCL_SOCKET_IFNAME=fab``,
    as ``hsn`` on Slingshot): each rank of a 2-node trial gives gloo the exact name (``fab0``); gloo
    given ``fab`` itself finds no such interface and the trial fails."""
    cluster = slurm_site_cluster
    shared = cluster.shared_dir / f"site-nccl-prefix-{agents}"
    spec = _spec(shared / "s.yaml", search={"n_trials": 1, "max_concurrent": 1},
                 training={"function": "trainfns:allreduce_volume", "epochs": 1,
                           "options": {"floats": 1000, "steps": 3}},
                 resources={"processes": 2, "nodes": 2, "max_retries": 0},
                 study={"name": "nccl-prefix", "metric": "loss", "direction": "minimize"},
                 engine_options={"poll_interval_s": 0.1, "agents": agents})
    run_dir = shared / "run"
    r = run_in_salloc(cluster, ["-N2", "-c2", "--mem=2000"], spec, run_dir, env={"NCCL_SOCKET_IFNAME": "fab"})
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    _all_complete(run_dir, 1, out)
    logs = {rank: (run_dir / "trials" / "0" / f"rank{rank}.log").read_text() for rank in (0, 1)}
    for log in logs.values():
        assert "gloo interface fab0" in log, log
