"""Site defaults the slurm engine meets at real sites, without a cluster: ``sbatch --export=NONE`` (srun
inside such a job exports nothing unless told), a GPU lock directory on a node shared by users, NCCL's
interface forms for gloo, a ``scontrol -d`` line without ``GRES=``, the memory share of a GPU rank, and
``threads_per_core`` beside a user's CPU binding. The cluster-level counterparts are in
``test_site_defaults_cluster.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines.cluster import layout, node
from hpoflow.engines.slurm.allocation import Allocation, job_detail
from hpoflow.trial import TrialRequest
from tests.conftest import ROOT

# A stand-in for srun (as Parsl tests its launchers: a fake on PATH), true to SLURM 22.05 in one thing:
# which environment the step's tasks get. The last --export of its options wins, else SLURM_EXPORT_ENV
# (what `sbatch --export=NONE` puts in the job's environment), else ALL; NONE gives the SLURM_* variables
# only, a list those and the names listed. It writes its argv and the tasks' variable names, and exits.
FAKE_SRUN = """\
import json, os, sys
export = os.environ.get("SLURM_EXPORT_ENV", "ALL")
args = sys.argv[1:]
for i, a in enumerate(args):
    if not a.startswith("-"):
        args = args[:i]
        break
    if a.startswith("--export="):
        export = a.split("=", 1)[1]
names = export.split(",")
slurm = {k for k in os.environ if k.startswith("SLURM_")}
if names[0] == "ALL":
    task = set(os.environ)
elif names == ["NONE"]:
    task = slurm
else:
    task = slurm | {n.split("=")[0] for n in names if n.split("=")[0] in os.environ}
with open(os.environ["FAKE_SRUN_LOG"], "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "task_env": sorted(task)}) + "\\n")
"""


def _fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``srun`` (FAKE_SRUN) and an ``scontrol`` that does not answer, first on PATH; the log srun writes."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(f"#!{sys.executable}\n{FAKE_SRUN}")
    (bin_dir / "scontrol").write_text("#!/bin/sh\nexit 1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    log = tmp_path / "srun.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SRUN_LOG", str(log))
    return log


def _wait_lines(path: Path, timeout: float = 60.0) -> list[dict[str, Any]]:
    """The fake srun's records once it wrote one (60 s: a python start on a loaded 2-core machine)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if path.exists() and path.read_text().endswith("\n"):
            return [json.loads(line) for line in path.read_text().splitlines()]
        time.sleep(0.05)
    raise AssertionError(f"srun was not run within {timeout:.0f} s")


@pytest.mark.parametrize("agents", ["off", "on"])
def test_in_a_job_submitted_with_export_none_the_tasks_still_get_pythonpath_and_the_agents_secret(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, agents: str) -> None:
    """``sbatch --export=NONE`` leaves ``SLURM_EXPORT_ENV=NONE`` in the driver's environment: an srun
    without an ``--export`` of its own would hand its tasks the SLURM_* variables only (no PYTHONPATH: the
    step's ``python -m hpoflow...`` cannot import hpoflow; no secret: the agents cannot join)."""
    from hpoflow.engines.slurm.engine import SlurmEngine
    from hpoflow.engines.slurm.options import SlurmOptions

    log = _fake_slurm(tmp_path, monkeypatch)
    for key, value in {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_CPUS_PER_NODE": "2",
                       "SLURM_EXPORT_ENV": "NONE", "PYTHONPATH": str(ROOT)}.items():
        monkeypatch.setenv(key, value)
    engine = SlurmEngine(SlurmOptions(agents=agents, kill_grace_s=1.0), tmp_path / "run")
    try:
        if agents == "off":
            engine.submit(TrialRequest(0, {}, {}, "loss", "minimize", str(tmp_path / "trials" / "0"), processes=1))
        (call,) = _wait_lines(log)
    finally:
        engine.close()
    assert "PYTHONPATH" in call["task_env"], call
    if agents == "on":
        assert "HPOFLOW_AGENT_SECRET" in call["task_env"], call
        assert not any("HPOFLOW_AGENT_SECRET=" in a for a in call["argv"])  # named, never its value


def test_export_flags_keep_a_users_export_and_add_what_hpoflow_needs() -> None:
    from hpoflow.engines.cluster.layout import export_flags

    assert export_flags(["--overlap"]) == ["--export=ALL", "--overlap"]
    assert export_flags(["--export=ALL,X=1"]) == ["--export=ALL,X=1"]  # everything already
    assert export_flags(["--export=HOME,TERM"], ("PYTHONPATH", "S")) == ["--export=HOME,TERM,PYTHONPATH,S"]
    assert export_flags(["--export=NONE"], ("PYTHONPATH",)) == ["--export=PYTHONPATH"]  # NONE takes no names
    assert export_flags(["--export=NONE"], ()) == ["--export=NONE"]
    assert export_flags(["--export=A", "--export=NONE"], ("P",)) == ["--export=A", "--export=P"]  # srun's last
    argv = layout.srun_argv(layout.LaunchJob(("n1", "n2"), 2, 0, "/py", "/job.json", ("--export=NONE",)))[0]
    assert "--export=PYTHONPATH" in argv and "--export=NONE" not in argv  # jobs mode's node launchers too


def test_gpu_lock_directories_are_per_user_so_a_second_user_on_the_node_can_lock_a_gpu(tmp_path: Path) -> None:
    """Root's rank makes the node's GPU lock directory first, under the usual umask (022); then a rank
    of another user (nobody, in a forked child) must still hold a lock on one of its GPUs. With one
    directory for every user (1755: only its maker may create in it) the second user's rank failed with
    an uncaught PermissionError, which the engine retried as a node failure."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to act as a second user (setuid)")
    node_name = f"test{os.getpid()}-{tmp_path.name}"  # lock files no real rank uses
    old = os.umask(0o022)
    made: list[Path] = []
    try:
        made.append(node._gpu_lock_dir())
        fd = node._lock_gpu(made[0], node_name, "gpu0", 0, "1.0")
        assert isinstance(fd, int)
        os.close(fd)
        node._GPU_LOCKS.remove(fd)
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the child: nobody's rank
            code = 1
            try:
                os.setgid(65534)
                os.setuid(65534)
                held = node._lock_gpu(node._gpu_lock_dir(), node_name, "gpu1", 1, "2.0")
                code = 0 if isinstance(held, int) else 2
            except BaseException as exc:  # any error of the child is its exit code
                sys.stderr.write(f"{type(exc).__name__}: {exc}\n")
                code = 3 if isinstance(exc, PermissionError) else 4
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the second user's rank could not lock its GPU"
        theirs = made[0].parent / "hpoflow-gpus-65534"
        made.append(theirs)
        assert theirs.stat().st_uid == 65534 and (theirs.stat().st_mode & 0o777) == 0o700
        assert (made[0].stat().st_mode & 0o777) == 0o700 and made[0] != theirs
    finally:
        os.umask(old)
        for d in made:
            for lock in d.glob(f"{node_name}-*.lock"):
                lock.unlink()
            if d.name == "hpoflow-gpus-65534" and d.is_dir() and not any(d.iterdir()):
                d.rmdir()


def test_a_lock_directory_taken_by_another_user_is_refused(tmp_path: Path) -> None:
    from hpoflow.engines.machine import gpu_lock_dir

    tmp_path.chmod(0o1777)
    mine = gpu_lock_dir(tmp_path)
    assert mine.name == f"hpoflow-gpus-{os.getuid()}" and (mine.stat().st_mode & 0o777) == 0o700
    assert gpu_lock_dir(tmp_path) == mine  # made once, then used
    mine.rmdir()
    mine.symlink_to(tmp_path)  # a link where the directory should be: never followed
    with pytest.raises(PermissionError, match="not a directory"):
        gpu_lock_dir(tmp_path)


@pytest.mark.parametrize(("nccl", "expected"), [
    ("hsn", "hsn0"),  # a prefix (Slingshot): gloo needs the exact name
    ("^docker,lo", "hsn0"),  # leave out: of eth0 and hsn0, the one that is not the launch node's route
    ("^=eth0", "hsn0"),
    ("=hsn0", "hsn0"),
    ("ib", "eth0"),  # selects nothing here: the engine's own choice, as if unset (the route)
])
def test_gloo_gets_one_exact_interface_from_each_of_nccls_forms(monkeypatch: pytest.MonkeyPatch, nccl: str,
                                                                 expected: str) -> None:
    """A node with a management network (eth0, the route to the launch node), a fabric (hsn0) and a
    container bridge (docker0)."""
    monkeypatch.setattr(layout, "_up_interfaces", lambda: ["docker0", "eth0", "hsn0", "lo"], raising=False)
    monkeypatch.setattr(node, "choose_ifname", lambda target, port=9: "eth0")
    monkeypatch.setattr(node, "fabric_candidates", lambda exclude=None: [])
    env = {"NCCL_SOCKET_IFNAME": nccl, "SLURM_LAUNCH_NODE_IPADDR": "10.0.0.1"}
    ifname, why = node.gloo_interface({"socket_ifname": "auto"}, 2, env)
    assert ifname == expected, why


def test_nccl_interface_forms_select_as_nccl_reads_them() -> None:
    from hpoflow.engines.cluster.layout import gloo_ifname_from_nccl, nccl_ifnames

    up = ["docker0", "eth0", "hsn0", "hsn1", "ib0", "lo"]
    assert nccl_ifnames("hsn", up) == ["hsn0", "hsn1"]
    assert nccl_ifnames("hsn,ib", up) == ["hsn0", "hsn1", "ib0"]
    assert nccl_ifnames("=hsn", up) == []  # exact names only
    assert nccl_ifnames("^docker,lo", up) == ["eth0", "hsn0", "hsn1", "ib0"]
    assert nccl_ifnames("^docker", up) == ["eth0", "hsn0", "hsn1", "ib0"]  # never loopback when leaving out
    assert nccl_ifnames("^=hsn0,docker0", up) == ["eth0", "hsn1", "ib0"]
    assert nccl_ifnames("lo", up) == ["lo"]  # named: a one-host test's loopback
    assert gloo_ifname_from_nccl("hsn", route="eth0", interfaces=up)[0] == "hsn0"  # the first of several
    none, why = gloo_ifname_from_nccl("ib9", interfaces=up)
    assert none is None and "selects none" in why and "hsn0" in why


def test_a_scontrol_line_without_gres_does_not_zero_the_gpus_the_environment_gave() -> None:
    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_CPUS_PER_NODE": "4",
           "SLURM_GPUS_PER_NODE": "4", "SLURM_MEM_PER_NODE": "3000"}
    alloc = Allocation.from_env(env).refined(job_detail("JobId=1 Nodes=n1 CPU_IDs=0-3 Mem=3000"), {}, True)
    assert alloc.gpus_per_node == 4  # the line says nothing of GPUs: the environment's 4 stand
    none = Allocation.from_env(env).refined(job_detail("JobId=1 Nodes=n1 CPU_IDs=0-3 Mem=3000 GRES="), {}, True)
    assert none.gpus_per_node == 0  # an empty GRES= does say: none


def test_a_gpu_rank_gets_its_gpus_share_of_the_nodes_memory_not_only_its_cpus() -> None:
    """A node of 128 hardware threads, 8 GPUs and 512 GB: a rank of 1 CPU and 1 GPU is an eighth of the
    node by GPUs (64 GB, as SLURM's DefMemPerGPU gives), not 1/128 by CPUs (4 GB)."""
    node_mb = 512 * 1024
    alloc = Allocation("1", ("n1",), (128,), 8, memory_mb=(node_mb,))
    shape = TrialRequest.shape
    assert alloc.rank_memory_mb(shape(1, 1, 1)) == node_mb // 8
    assert alloc.capacity(shape(1, 1, 1)) == 8  # the memory share holds all 8 GPUs' ranks at once
    assert alloc.rank_memory_mb(shape(1, 1, 0.25)) == node_mb // 32  # a quarter of a GPU: a quarter of that
    assert alloc.rank_memory_mb(shape(1, 64, 1)) == node_mb // 2  # by CPUs where that is larger
    assert alloc.rank_memory_mb(shape(1, 1, 0)) == node_mb // 128  # no GPU: by CPUs, as before
    assert Allocation("1", ("n1",), (4,), 0, memory_mb=(3000,)).rank_memory_mb(shape(1, 1, 0)) == 750  # no GPUs


def _validate(tmp_path: Path, srun_args: list[str]) -> subprocess.CompletedProcess[str]:
    spec = tmp_path / "s.yaml"
    (tmp_path / "m.py").write_text("def f(ctx):\n    return {'loss': 0.0}\n")
    spec.write_text("study: {name: s, metric: loss, direction: minimize}\n"
                    "space: {lr: {type: float, low: 0.01, high: 0.1}}\n"
                    "search: {algorithm: random, n_trials: 2}\n"
                    "training: {function: 'm:f', epochs: 1}\n"
                    "resources: {processes: 1}\n"
                    "engine: slurm\n"
                    "engine_options:\n"
                    "  threads_per_core: 1\n"
                    f"  srun_args: {json.dumps(srun_args)}\n")
    return subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(spec)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_threads_per_core_beside_a_users_cpu_bind_is_one_clear_error_at_validate(tmp_path: Path) -> None:
    """srun refuses ``--hint=nomultithread`` (threads_per_core: 1) together with ``--cpu-bind``: every
    step would fail to start. ``hpoflow validate`` says so at the flag, with the rule and the fix."""
    r = _validate(tmp_path, ["--cpu-bind=cores"])
    assert r.returncode == 2, r.stdout + r.stderr
    problems = [line for line in r.stderr.splitlines() if line.startswith("  ")]
    assert len(problems) == 1 and "Traceback" not in r.stderr, r.stderr
    (line,) = problems
    assert f"{tmp_path / 's.yaml'}:9: engine_options.srun_args:" in line, line  # where
    assert "--hint=nomultithread" in line and "'--cpu-bind=cores'" in line and "Fix:" in line, line
    assert _validate(tmp_path, ["--cpu-bind=verbose"]).returncode == 0  # verbose binds nothing
