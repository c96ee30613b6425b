"""Rank layout, bindings and launcher commands from a faked COMPSs environment (no processes)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hpoflow.engines.cluster.attempt import _plan
from hpoflow.engines.cluster.layout import (
    bound_cpus,
    bound_gpus,
    launcher_argv,
    node_index_from_env,
    ordered_hosts,
    parse_id_list,
    processes_per_node,
    rank_layout,
    resolve_node_index,
    split_for_ranks,
)
from hpoflow.train.transport import TrialFiles
from tests.engines._fakes import make_request


def test_bindings_from_compss_env() -> None:
    assert parse_id_list("0,2, 4-6,x,") == [0, 2, 4, 5, 6]
    env = {"COMPSS_BINDED_CPUS": "8-11", "COMPSS_BINDED_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": "0"}
    assert bound_cpus(env) == [8, 9, 10, 11] and bound_gpus(env) == [2, 3]
    assert bound_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == [1] and bound_gpus({}) == []
    assert bound_cpus({}) is None
    assert split_for_ranks([8, 9, 10, 11], 2, 2) == [(8, 9), (10, 11)]
    assert split_for_ranks([2, 3], 2, 1) == [(2,), (3,)]
    assert split_for_ranks([5], 2, 2) == [(5,), (5,)]  # too few: shared, never empty
    assert split_for_ranks([], 2, 1) == [(), ()]


def test_rank_layout_is_node_major() -> None:
    layout = rank_layout(3, 2)
    assert [(s.rank, s.node_index, s.local_rank) for s in layout] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1), (4, 2, 0), (5, 2, 1)]
    with pytest.raises(ValueError, match=r"processes must be a multiple of resources\.nodes"):
        processes_per_node(make_request(Path("/t"), processes=3, nodes=2))


def test_hosts_executing_node_first_and_node_index_by_name() -> None:
    env = {"COMPSS_HOSTNAMES": "s01r1b02-ib0,s01r1b07-ib0,s01r1b01-ib0"}
    hosts = ordered_hosts(env, 3)
    assert hosts == ["s01r1b01-ib0", "s01r1b02-ib0", "s01r1b07-ib0"]
    assert resolve_node_index(hosts, {"HPOFLOW_NODE_NAME": "s01r1b07"}) == 2  # network suffix
    assert resolve_node_index(hosts, {"SLURMD_NODENAME": "s01r1b01.cluster.local"}) == 0
    with pytest.raises(ValueError, match="matches 0 of the trial's hosts"):
        resolve_node_index(["x1", "x2"], {"HPOFLOW_NODE_NAME": "nohost"})
    with pytest.raises(ValueError, match="COMPSS_HOSTNAMES names 3"):
        ordered_hosts(env, 2)
    with pytest.raises(ValueError, match="neither COMPSS_HOSTNAMES nor SLURM_JOB_NODELIST is set"):
        ordered_hosts({}, 2)
    with pytest.raises(ValueError, match="not a plain host name"):
        ordered_hosts({"COMPSS_HOSTNAMES": "-oProxyCommand=x,b"}, 2)
    assert node_index_from_env({"OMPI_COMM_WORLD_RANK": "3"}) == 3 and node_index_from_env({}) is None


def test_launcher_commands() -> None:
    req = make_request(Path("/r/trials/0"), processes=8, nodes=2, cpus_per_process=4, gpus_per_process=1)
    hosts = ["n2", "n1"]
    (srun,) = launcher_argv("srun", hosts, 4, req, "/r/job.json", python="/py")
    assert srun == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=16",
                    "--kill-on-bad-exit=1", "--export=ALL", "--overlap", "--gres=gpu:4", "/py", "-m",
                    "hpoflow.engines.cluster.node", "node", "--job", "/r/job.json", "--hosts", "n2,n1"]
    (mpi,) = launcher_argv("mpirun", hosts, 4, req, "/r/job.json", python="/py", mpirun_args=("--bind-to", "none"))
    assert mpi[:8] == ["mpirun", "-np", "2", "--host", "n2,n1", "--map-by", "ppr:1:node", "--bind-to"]
    assert mpi[-4:] == ["--hosts", "n2,n1", "--index-from", "mpi"]
    ssh = launcher_argv("ssh", hosts, 4, req, "/r/my job.json", python="/py", pythonpath="/a b")
    assert [c[:4] for c in ssh] == [["ssh", "-o", "BatchMode=yes", "n2"], ["ssh", "-o", "BatchMode=yes", "n1"]]
    # ssh joins its arguments for a remote shell: the quoting must give back the exact argv
    remote = shlex.split(" ".join(ssh[1][4:]))
    assert remote == ["env", "PYTHONPATH=/a b", "/py", "-m", "hpoflow.engines.cluster.node", "node", "--job",
                      "/r/my job.json", "--hosts", "n2,n1", "--node-index", "1"]
    with pytest.raises(ValueError, match="valid launchers: mpirun, srun, ssh"):
        launcher_argv("pdsh", hosts, 4, req, "/j")


def test_multinode_plan_from_faked_compss_and_slurm_env(tmp_path: Path) -> None:
    req = make_request(tmp_path / "0", processes=4, nodes=2, cpus_per_process=2, timeout=50)
    files = TrialFiles(Path(req.trial_dir), 0)
    env = {"COMPSS_HOSTNAMES": "nodeA,nodeB", "COMPSS_NUM_NODES": "2", "SLURM_NNODES": "2",
           "SLURM_NODELIST": "nodeA,nodeB", "SLURM_TASKS_PER_NODE": "1(x2)"}
    cmds, job = _plan(req, files, {"launcher": "srun", "env": {"NCCL_DEBUG": "WARN"}}, env)
    assert job["master_addr"] == "nodeB" and job["hosts"] == ["nodeB", "nodeA"]  # rendezvous: executing node
    assert job["master_port"] == 0 and job["ppn"] == 2 and job["world_size"] == 4
    # rank 0's TCP store, announced in the attempt directory: no file store (no lock) on the shared fs, no port
    assert job["store"] == "" and job["announce"] == str(tmp_path / "0" / "attempt-0" / "rendezvous.addr")
    assert job["env"] == {"NCCL_DEBUG": "WARN"} and job["deadline"] is not None
    assert len(cmds) == 1 and cmds[0][0] == "srun" and "--cpus-per-task=4" in cmds[0]
    json.dumps(job)  # the job file is plain JSON
    single = make_request(tmp_path / "1", processes=2, cpus_per_process=1, gpus_per_process=1)
    cmds, job = _plan(single, TrialFiles(Path(single.trial_dir), 0), {},
                      {"COMPSS_BINDED_CPUS": "4,5", "COMPSS_BINDED_GPUS": "1,3"})
    assert job["master_addr"] == "127.0.0.1" and job["cpus"] == [4, 5] and job["gpus"] == [1, 3]
    assert cmds[0][-2:] == ["--node-index", "0"]
