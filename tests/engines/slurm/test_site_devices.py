"""torchrun's device view for command trials on the "site" profile of the test cluster (four stand-in GPUs
per node that SLURM hands out as it would real ones): each rank of a 2-rank command trial in one node's
allocation, a job step's task (agents off) or a node agent's worker (on), runs a program whose
``CUDA_VISIBLE_DEVICES`` lists the trial's GPUs on the node in local-rank order, so ``cuda:LOCAL_RANK``
is the rank's own GPU (``hpoflow.train.devices``). The program records its environment and touches no
GPU (``tests/commandprog.py --env``)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT
from tests.engines.slurm.test_site import _completed, run_in_salloc
from tests.infra.slurm import SlurmCluster

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("agents", "nodes"), [("off", 1), ("on", 1), ("off", 2), ("on", 2)],
                         ids=["steps", "agents", "steps-2-nodes", "agents-2-nodes"])
def test_each_rank_of_a_command_trial_sees_its_nodes_gpus_of_the_trial_with_its_own_at_local_rank(
        slurm_site_cluster: SlurmCluster, agents: str, nodes: int) -> None:
    """Two ranks on each of ``nodes`` nodes, a GPU each."""
    shared = slurm_site_cluster.shared_dir / f"site-devices-{agents}-{nodes}"
    shared.mkdir(parents=True, exist_ok=True)
    env_file = shared / "env_RANK.json"
    spec = shared / "s.yaml"
    spec.write_text(yaml.safe_dump({
        "study": {"name": "devices", "metric": "val_loss", "direction": "minimize"},
        "space": {"x": {"type": "float", "low": 0.1, "high": 0.9}},
        "search": {"algorithm": "random", "n_trials": 1, "max_concurrent": 1, "seed": 0},
        "training": {"command": [sys.executable, str(ROOT / "tests" / "commandprog.py"), "--epochs", "1",
                                 "--env", str(env_file)]},
        "resources": {"processes": 2 * nodes, "nodes": nodes, "gpus_per_process": 1},
        "engine": "slurm",
        "engine_options": {"poll_interval_s": 0.1, "agents": agents},
    }, sort_keys=False))
    run_dir = shared / "run"
    r = run_in_salloc(slurm_site_cluster, [f"-N{nodes}", "-c4", "--gres=gpu:4", "--mem=3000"], spec, run_dir)
    study = _completed(r, run_dir, 1)
    trial_dir = run_dir / "trials" / str(study.trials[0].number)
    ranks = range(2 * nodes)
    envs = [json.loads(Path(str(env_file).replace("RANK", str(rank))).read_text())["environ"] for rank in ranks]
    logs = [(trial_dir / f"rank{rank}.log").read_text() for rank in ranks]
    # each rank's own GPU, as its rank process had it in CUDA_VISIBLE_DEVICES
    own = [re.findall(r"\(local rank \d\) has GPU\(s\) (\S+);", log) for log in logs]
    assert all(own), logs
    mine = [o[-1] for o in own]
    if agents == "off":  # a step's task: what SLURM bound, in the step's numbering, which the rank log names
        bound = [re.findall(r"rank \d+ GPUs: CUDA_VISIBLE_DEVICES=(\S+) \((gpu\d+) of node (\S+);", log)[-1]
                 for log in logs]
        assert [b[0] for b in bound] == mine, (bound, mine)
        for rank in ranks:  # one of the step's GPUs on the rank's node (SLURM_STEP_GPUS: the node's indices)
            assert bound[rank][1] in {f"gpu{g}" for g in envs[rank]["SLURM_STEP_GPUS"].split(",")}, (bound, rank)
    else:  # an agent's worker: one of the GPUs of the agents' step on the node (all 4 of the allocation)
        assert all("in its node agent's worker" in log for log in logs), logs
        assert set(mine) <= {"0", "1", "2", "3"}, mine
    by_node: dict[str, list[int]] = {}
    for rank, env in enumerate(envs):
        by_node.setdefault(env["SLURMD_NODENAME"], []).append(rank)
    assert sorted(len(v) for v in by_node.values()) == [2] * nodes, by_node  # two ranks on each node
    for node_ranks in by_node.values():
        first = node_ranks[0]
        assert node_ranks == [first, first + 1], by_node
        assert mine[first] != mine[first + 1]  # cuda:LOCAL_RANK differs between the node's ranks
        for local, rank in enumerate(node_ranks):
            env = envs[rank]
            listed = env["CUDA_VISIBLE_DEVICES"].split(",")
            assert env["LOCAL_RANK"] == str(local) and env["LOCAL_WORLD_SIZE"] == "2"
            assert listed == [mine[first], mine[first + 1]], (rank, listed, mine)  # its node's, local rank 0's first
            assert listed[int(env["LOCAL_RANK"])] == mine[rank] and env["HPOFLOW_CUDA_DEVICE"] == str(local)
