"""The slurm engine's pure parts, without SLURM: host lists, the allocation, options, the driver's
batch script (run by a real bash with a stand-in python, to check every path survives its quoting)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines.cluster.hostlist import HostlistError, expand
from hpoflow.engines.slurm.allocation import Allocation, cpus_per_node
from hpoflow.engines.slurm.engine import _share_refusal
from hpoflow.engines.slurm.launch import SlurmLaunch, batch_script
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest


@pytest.mark.parametrize(("text", "hosts"), [
    ("n1", ["n1"]),
    ("n[1-3]", ["n1", "n2", "n3"]),
    ("n[1-2,7],gpu-a[08-10]", ["n1", "n2", "n7", "gpu-a08", "gpu-a09", "gpu-a10"]),
    ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
    ("a,b , c", ["a", "b", "c"]),
    ("", []),
])
def test_host_lists_expand_as_scontrol_show_hostnames(text: str, hosts: list[str]) -> None:
    assert expand(text) == hosts


@pytest.mark.parametrize("text", ["n[1-", "n1-2]", "n[[1]]", "n[3-1]", "n[a-b]", "n[1-99999999999]", "n[²]"])
def test_host_lists_slurm_would_not_write_are_refused(text: str) -> None:
    with pytest.raises(HostlistError):
        expand(text)


def test_cpus_per_node_reads_slurms_run_length_form() -> None:
    assert cpus_per_node("36(x2),72") == [36, 36, 72]
    assert cpus_per_node("4") == [4]
    with pytest.raises(ValueError):
        cpus_per_node("4(x)")


def test_the_allocation_counts_what_fits_and_says_why_not() -> None:
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]", "SLURM_JOB_CPUS_PER_NODE": "4(x2),2",
           "SLURM_GPUS_PER_NODE": "a100:2"}
    alloc = Allocation.from_env(env)
    assert alloc.hosts == ("n1", "n2", "n3") and alloc.cpus == (4, 4, 2) and alloc.gpus_per_node == 2
    shape = TrialRequest.shape
    assert alloc.capacity(shape(1, 1, 0)) == 10  # one core each
    assert alloc.capacity(shape(2, 2, 0)) == 2  # 4 cores per trial on one node: n1, n2 (n3 has 2)
    assert alloc.capacity(shape(2, 1, 0, nodes=2)) == 5  # 1 core on each of 2 nodes: 10 shares over pairs
    assert alloc.capacity(shape(4, 2, 0, nodes=2)) == 1  # 4 cores on each of 2 nodes: n1 + n2 once
    assert alloc.capacity(shape(1, 1, 1)) == 6  # by GPUs: 2 per node
    assert alloc.capacity(shape(3, 1, 0, nodes=2)) == 0  # does not split evenly
    with pytest.raises(EngineError, match=r"allocation \(job 7\) has 3 node\(s\) with \[4, 4, 2\] CPUs"):
        alloc.check_fit(shape(4, 2, 0, nodes=3))
    with pytest.raises(EngineError, match="SLURM_JOB_ID is not set"):
        Allocation.from_env({})


def test_options_choose_the_mode_and_refuse_what_slurm_would_misread() -> None:
    assert SlurmOptions().resolved_mode({"SLURM_JOB_ID": "3"}) == "steps"
    assert SlurmOptions().resolved_mode({}) == "jobs"
    assert SlurmOptions(mode="jobs").resolved_mode({"SLURM_JOB_ID": "3"}) == "jobs"
    with pytest.raises(ValueError, match="account may hold only"):
        SlurmOptions(account="proj x")
    with pytest.raises(ValueError, match="each element is one flag"):
        SlurmOptions(sbatch_args=("--reservation", "x"))


PRINTER = """import json, os, sys
json.dump({"argv": sys.argv[1:], "cwd": os.getcwd(), "requeue": os.environ.get("HPOFLOW_REQUEUE"),
           "pythonpath": os.environ.get("PYTHONPATH")}, open(os.environ["OUT"], "w"))
"""


def test_the_batch_script_passes_any_path_intact_through_bash(tmp_path: Path) -> None:
    odd = tmp_path / "my specs; $(touch pwned) `id` 'v2' é"
    odd.mkdir()
    spec, run_dir, work = odd / "study 'a'.yaml", odd / 'runs "b" $HOME *', odd / "work dir"
    work.mkdir()
    printer = tmp_path / "printer.py"
    printer.write_text(PRINTER)
    launch = SlurmLaunch(spec=str(spec), run_dir=str(run_dir), python=sys.executable, pythonpath=(str(odd), "/x y"),
                         workdir=str(work), nodes=2, time_minutes=30, partition="gpu", account="proj-1",
                         requeue=True, n_trials=5)
    script = batch_script(launch)
    assert "#SBATCH --signal=B:USR1@300" in script and "#SBATCH --no-kill" in script
    assert "#SBATCH --requeue" in script and "#SBATCH --partition=gpu" in script and "#SBATCH --exclusive" in script
    # run it: `exec PYTHON -m hpoflow run ...` becomes `exec PYTHON printer.py -m hpoflow run ...`
    body = script.replace(" -m hpoflow run ", f" {printer} -m hpoflow run ", 1)
    path = tmp_path / "driver.sbatch"
    path.write_text(body)
    out = tmp_path / "argv.json"
    subprocess.run(["bash", str(path)], check=True, env={**os.environ, "OUT": str(out)}, timeout=60)
    got = json.loads(out.read_text())
    assert got["argv"] == ["-m", "hpoflow", "run", str(spec), "--run-dir", str(run_dir), "--n-trials", "5"]
    assert got["cwd"] == str(work) and got["requeue"] == "1"
    assert got["pythonpath"].startswith(f"{odd}:/x y")
    assert not (work / "pwned").exists() and not Path("pwned").exists()


def test_a_job_array_gives_each_driver_its_own_run_directory(tmp_path: Path) -> None:
    launch = SlurmLaunch(spec="/s.yaml", run_dir="/r un", python="/py", pythonpath=(), workdir="/", drivers=3)
    script = batch_script(launch)
    assert "#SBATCH --array=0-2" in script
    assert """--run-dir '/r un'/driver-"$SLURM_ARRAY_TASK_ID\"""" in script


def test_launch_refuses_several_drivers_for_a_pbt_study(tmp_path: Path) -> None:
    """A PBT study's population is one driver's: ``launch --drivers 2`` is refused before anything is written."""
    import yaml

    spec = {"study": {"name": "pbt", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"lr": {"type": "float", "low": 1e-3, "high": 0.1, "log": True}},
            "search": {"algorithm": "random", "n_trials": 8, "scheduler": {"type": "pbt", "population": 2}},
            "training": {"model": "mlp", "epochs": 2, "lr": "${lr}"}, "engine": "slurm",
            "storage": str(tmp_path / "shared.journal")}
    path = tmp_path / "pbt.yaml"
    path.write_text(yaml.safe_dump(spec))
    root = Path(__file__).resolve().parents[3]
    r = subprocess.run([sys.executable, "-m", "hpoflow", "launch", str(path), "--engine", "slurm", "--drivers", "2",
                        "--run-dir", str(tmp_path / "run"), "--dry-run"], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    (line,) = r.stderr.strip().splitlines()
    assert "--drivers 2" in line and "owned by one driver" in line and "Fix: --drivers 1" in line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(("field", "value"), [("account", "a b"), ("qos", "q\nx"), ("job_name", "n'x")])
def test_sbatch_lines_carry_only_plain_values(field: str, value: str) -> None:
    with pytest.raises(EngineError, match="SLURM reads it from an #SBATCH line"):
        fields: dict[str, Any] = {field: value}
        SlurmLaunch(spec="/s", run_dir="/r", python="/p", pythonpath=(), workdir="/", **fields)


def test_the_jobs_end_comes_from_slurm_job_end_time_or_squeue() -> None:
    from datetime import datetime

    from hpoflow.engines.slurm.walltime import job_end_time

    assert job_end_time({"SLURM_JOB_END_TIME": "1800000000"}) == 1_800_000_000.0
    assert job_end_time({}) is None  # not in a job
    end = datetime(2026, 11, 24, 6, 30, 0).timestamp()
    assert job_end_time({"SLURM_JOB_ID": "7"}, squeue=lambda job: "2026-11-24T06:30:00\n") == end
    for unbounded in ("UNLIMITED\n", "N/A\n", None):
        def answer(job: str, text: str | None = unbounded) -> str | None:
            return text

        assert job_end_time({"SLURM_JOB_ID": "7"}, squeue=answer) is None


def test_the_walltime_warning_follows_a_time_limit_changed_while_the_job_runs() -> None:
    """The driver's own warning (a batch script without --signal) reads the job's end again from squeue:
    a limit shortened mid-job brings the warning forward, one extended or lifted puts it off."""
    import math
    import threading
    import time
    from datetime import datetime

    from hpoflow.engines.slurm.walltime import arm_walltime_warning

    def iso(t: float) -> str:
        return datetime.fromtimestamp(t).isoformat(timespec="seconds") + "\n"

    def armed(first_end: float, later: list[str | None]) -> threading.Event:
        """Armed 60 s before ``first_end`` (the job's end at its start); squeue answers ``later[0]``."""
        fired = threading.Event()
        env = {"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": str(int(first_end)), "HPOFLOW_WALLTIME_WARNING_S": "60",
               "HPOFLOW_WALLTIME_POLL_S": "0.01"}
        assert arm_walltime_warning(env, squeue=lambda job: later[0], fire=fired.set) is not None
        return fired

    now = math.floor(time.time())
    shortened: list[str | None] = [iso(now + 3600)]
    fired = armed(now + 3600, shortened)
    assert not fired.wait(0.3)  # an hour to go: nothing yet
    shortened[0] = iso(now + 30)  # scontrol update TimeLimit=...: the warning (60 s before) is due now
    assert fired.wait(30), "the shortened limit did not bring the warning forward"  # bounds a hang only

    # a limit extended or lifted while the warning was 1-2 s away: it does not come at the first end
    for extended in (7200, None):
        now = math.floor(time.time())
        answer = iso(now + extended) if extended else "UNLIMITED\n"
        assert not armed(now + 62, [answer]).wait(3.0), answer
    # slurmctld not answering keeps the end last known
    assert armed(math.floor(time.time()) + 62, [None]).wait(30)


def test_a_step_rank_takes_its_local_share_of_the_gpus_slurm_left_unbound() -> None:
    from hpoflow.engines.cluster.layout import step_rank_gpus

    # --gres steps and --gpu-bind=none: every task of a node sees all of the node's step GPUs
    assert step_rank_gpus([2, 3], [2, 3], 0, 2, 1) == ([2], ["gpu2"])
    assert step_rank_gpus([2, 3], [2, 3], 1, 2, 1) == ([3], ["gpu3"])
    assert step_rank_gpus([0, 1, 2, 3], [4, 5, 6, 7], 1, 2, 2) == ([2, 3], ["gpu6", "gpu7"])  # renumbered in a cgroup
    # SLURM bound the task already (--gpus-per-task): its one GPU is the rank's
    assert step_rank_gpus([3], [3], 1, 2, 1) == ([3], ["gpu3"])
    assert step_rank_gpus([1], [2, 3], 1, 2, 1) == ([1], ["visible1"])  # no node index known: the step's own name
    assert step_rank_gpus(["GPU-a", "GPU-b"], [0, 1], 1, 2, 1) == (["GPU-b"], ["gpu1"])
    with pytest.raises(ValueError, match=r"local rank 1 sees 3 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1,2\), but the step "
                                         r"gives this node's 2 rank\(s\) 1 GPU\(s\) each"):
        step_rank_gpus([0, 1, 2], [0, 1, 2], 1, 2, 1)
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES=unset"):
        step_rank_gpus([], [], 0, 1, 1)


# what SLURM 22.05 printed for `salloc -N1 -c4 --gres=gpu:4 --mem=3000` on the site-profile cluster (cut)
JOB_DETAIL = ("JobId=1 JobName=interactive JobState=RUNNING NodeList=n1 BatchHost=n1 NumNodes=1 NumCPUs=4 NumTasks=1 "
              "CPUs/Task=4 TRES=cpu=4,mem=3000M,node=1,billing=4 JOB_GRES=gpu:4   Nodes=n1 CPU_IDs=0-3 Mem=3000 "
              "GRES=gpu:4(IDX:0-3) MinCPUsNode=4 MinMemoryNode=3000M TresPerNode=gres:gpu:4 ")
NODE_LINE = ("NodeName=n1 Arch=x86_64 CoresPerSocket=2  CPUAlloc=0 CPUEfctv=4 CPUTot=4 Gres=gpu:4 NodeAddr=198.18.96.2 "
             "RealMemory=3000 AllocMem=0 Sockets=1 Boards=1 State=IDLE ThreadsPerCore=2 TmpDisk=0")


def test_the_controller_tells_the_gpus_and_memory_that_a_gres_allocation_sets_no_variable_for() -> None:
    from hpoflow.engines.slurm.allocation import config_value, job_detail, node_hardware, whole_cores

    detail = job_detail(JOB_DETAIL)
    assert detail is not None
    assert (detail.cpus, detail.memory_mb, detail.gpus, detail.gpu_ids) == (
        {"n1": 4}, {"n1": 3000}, {"n1": 4}, {"n1": (0, 1, 2, 3)})
    two = job_detail("JobId=9 Nodes=n[1-2] CPU_IDs=0-1,3 Mem=0 GRES= Nodes=n3 CPU_IDs=0 Mem=0 GRES=gpu:a100:2(IDX:1,3)")
    assert two is not None and two.cpus == {"n1": 3, "n2": 3, "n3": 1} and two.gpu_ids["n3"] == (1, 3)
    assert two.gpus == {"n1": 0, "n2": 0, "n3": 2}
    assert job_detail("JobId=9 JobState=PENDING") is None
    assert node_hardware(NODE_LINE)["n1"].threads_per_core == 2 and node_hardware(NODE_LINE)["n1"].gpus == 4
    assert whole_cores("CR_CORE_MEMORY") and whole_cores("CR_Socket") and not whole_cores("CR_CPU_MEMORY")
    assert config_value("MaxStepCount            = 40000\nSelectTypeParameters    = CR_CORE_MEMORY\n",
                        "SelectTypeParameters") == "CR_CORE_MEMORY"

    env = {"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n1", "SLURM_JOB_CPUS_PER_NODE": "4",
           "SLURM_MEM_PER_NODE": "3000"}
    bare = Allocation.from_env(env)
    assert bare.gpus_per_node == 0 and bare.memory_mb == (3000,)  # what the environment of a --gres job tells
    alloc = bare.refined(detail, node_hardware(NODE_LINE), whole_cores("CR_CORE_MEMORY"))
    assert alloc.gpus_per_node == 4 and alloc.gpu_ids == ((0, 1, 2, 3),) and alloc.threads_per_core == 2
    shape = TrialRequest.shape
    # a 1-CPU rank takes a whole core (2 threads): 2 side by side, each with half the memory
    assert alloc.rank_cpus(shape(1, 1, 0)) == 2 and alloc.capacity(shape(1, 1, 0)) == 2
    assert alloc.rank_memory_mb(shape(1, 1, 0)) == 1500
    assert alloc.capacity(shape(2, 1, 1)) == 1  # 2 ranks x 1 GPU: the 2 cores hold one such trial
    assert alloc.capacity(shape(1, 1, 0, memory_gb=2)) == 1  # 2048 MB each: one fits in 3000
    assert alloc.rank_memory_mb(shape(1, 1, 0, memory_gb=0.5)) == 512
    assert replace(alloc, one_thread_per_core=True).rank_cpus(shape(1, 2, 0)) == 4  # --hint=nomultithread: cores
    assert alloc.rank_cpus(shape(1, 3, 0)) == 4  # 3 threads: rounded up to 2 whole cores
    assert replace(alloc, whole_cores=False).rank_cpus(shape(1, 1, 0)) == 1  # CR_CPU: threads one by one
    with pytest.raises(EngineError, match=r"1 x 4 CPUs \(a rank's 3 CPU\(s\) take 4: SLURM gives whole cores of 2 "
                                          r"threads\), 1 x 4096 MB memory .* \[3000\] MB memory"):
        alloc.check_fit(shape(1, 3, 0, memory_gb=4))
    gone = alloc.keeping([])
    assert gone.hosts == () and gone.memory_mb == () and gone.gpu_ids == () and gone.capacity(shape(1, 1, 0)) == 0


def test_a_study_whose_steps_approach_max_step_count_is_warned_before_it_starts(
        capsys: pytest.CaptureFixture[str]) -> None:
    from hpoflow.engines.slurm.engine import SlurmEngine

    engine = object.__new__(SlurmEngine)  # steps mode without SLURM: only the allocation matters here
    engine.allocation = Allocation("7", ("n1",), (4,), 0, max_step_count=1000)
    engine.expect_runs(200, 600)  # 600 < 80 % of 1000: quiet
    assert capsys.readouterr().err == ""
    engine.expect_runs(300, 900)
    err = capsys.readouterr().err
    assert "may start 300 job steps (900 with every retry)" in err and "MaxStepCount=1000" in err and "Fix:" in err
    engine.allocation = replace(engine.allocation, max_step_count=0)  # unknown: nothing to say
    engine.expect_runs(10**6, 10**6)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize(("gres_types", "says"), [
    ("gpu,shard", "; this cluster has gres/shard (GresTypes=gpu,shard), but hpoflow's slurm engine does not ask SLURM "
                  "for shards: a step or job per trial gives each rank whole GPUs."),
    ("gpu", ", but a step or job per trial gives each rank whole GPUs: the slurm engine does not ask SLURM for "
            "gres/shard (and this cluster declares none)."),
    (None, ", but a step or job per trial gives each rank whole GPUs: the slurm engine does not ask SLURM for "
           "gres/shard.")],
    ids=["site-has-shards", "site-has-none", "scontrol-silent"])
def test_a_share_is_refused_in_one_line_that_says_whether_the_cluster_has_gres_shard(
        gres_types: str | None, says: str) -> None:
    line = _share_refusal(0.25, gres_types)
    assert line == ("resources.gpus_per_process: 0.25 shares a GPU between trials" + says + " Fix: run the driver "
                    "inside an allocation with engine_options.agents: auto or on (node agents share the allocation's "
                    "GPUs between trials), set gpus_per_process: 1 (whole GPUs), or use the local engine")


def test_on_node_agents_a_share_of_a_gpu_fits_k_ranks_a_gpu() -> None:
    """With agents a share ``1/k`` is no refusal: the allocation holds ``gpus_per_node x k`` ranks' shares
    per node (the ranks of one trial on distinct GPUs), and a step per trial still refuses it."""
    from hpoflow.engines.slurm.engine import _check_shape

    alloc = Allocation("1", ("n1",), (64,), 2)
    quarter = TrialRequest(0, {}, {}, "loss", "minimize", "/t", processes=1, gpus_per_process=0.25)
    _check_shape(quarter, agents=True)
    with pytest.raises(EngineError, match="shares a GPU"):
        _check_shape(quarter)
    assert alloc.capacity(quarter) == 8  # 2 GPUs x 4 shares
    assert alloc.capacity(replace(quarter, processes=2)) == 4  # 2 ranks: one share on each GPU
    assert alloc.capacity(replace(quarter, processes=3)) == 0  # 3 ranks cannot be on 3 distinct GPUs of 2


def test_a_multi_node_trial_fails_with_the_rank_that_died_not_with_its_peers_collective_error(tmp_path: Path) -> None:
    """Rank 1 on n2 is killed; rank 0 on n1 then fails in its all-reduce (gloo: connection closed), and its
    agent's word may reach the driver first: the trial's error names the death, on its node, either way."""
    import time

    from hpoflow.engines.slurm.agents import _merged_result, _Trial
    from hpoflow.train.transport import TrialFiles
    from hpoflow.trial import TrialResult, rank_died

    req = TrialRequest(0, {}, {}, "loss", "minimize", str(tmp_path), processes=2, nodes=2)
    peer = TrialResult(0, "failed", error="rank 0: RuntimeError: [gloo] Connection closed by peer", retryable=True)
    death = TrialResult(0, "failed", error=rank_died(1, -9), retryable=True)
    for first in ("n1", "n2"):
        t = _Trial(req, TrialFiles(tmp_path), time.monotonic(), time.time(), nodes=["n1", "n2"],
                   ended={"n1": peer, "n2": death}, failed_first=first)
        result = _merged_result(t)
        assert (result.status, result.error, result.retryable) == (
            "failed", "rank 1 killed by SIGKILL before it finished (on n2)", True), first
    t = _Trial(req, TrialFiles(tmp_path), time.monotonic(), time.time(), nodes=["n1", "n2"],
               ended={"n1": peer, "n2": TrialResult(0, "cancelled", error="cancelled")}, failed_first="n1")
    assert _merged_result(t).error == f"{peer.error} (on n1)"  # no rank died: the first failure
