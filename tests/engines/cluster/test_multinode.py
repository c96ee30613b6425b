"""Multi-node trials started exactly as the @multinode task starts them: a fake srun on loopback and
a fake ssh into two real network namespaces (198.18.0.0/15 only), each a real 2-rank gloo DDP trial."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines.cluster.attempt import run_trial
from tests.engines._fakes import NetnsPair, make_request, rank_processes

pytestmark = pytest.mark.slow  # two-node trials in network namespaces


def _outcomes(trial_dir: Path) -> list[dict[str, Any]]:
    return [json.loads((trial_dir / "attempt-0" / f"outcome-{r}.json").read_text()) for r in range(2)]


def test_srun_launcher_runs_a_two_node_ddp_trial(fake_bin: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # COMPSs lists the executing node last; SLURM numbers the nodes in another order.
    monkeypatch.setenv("COMPSS_HOSTNAMES", "fakeB,fakeA")
    monkeypatch.setenv("COMPSS_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_NODELIST", "fakeB,fakeA")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.delenv("HPOFLOW_NODE_NAME", raising=False)
    trial_dir = tmp_path / "trials" / "0"
    req = make_request(trial_dir, processes=2, nodes=2, timeout=120)
    res = run_trial(req.to_json(), json.dumps({"launcher": "srun", "master_addr": "127.0.0.1", "srun_args": []}))
    assert res["status"] == "complete", res
    assert res["metrics"]["world"] == 2.0 and res["metrics"]["weight_spread"] == 0.0
    assert res["metrics"]["moved"] > 1e-3
    srun_argv = ast.literal_eval((tmp_path / "srun.log").read_text().splitlines()[0])
    assert srun_argv[:5] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=1",
                             "--kill-on-bad-exit=1"]
    assert srun_argv[srun_argv.index("--hosts") + 1] == "fakeA,fakeB"  # executing node first
    a, b = _outcomes(trial_dir)
    assert a["status"] == b["status"] == "ok"
    # all-gathered after training: both ranks hold identical weights (loss differs: own data shard)
    assert a["metrics"]["weight_spread"] == b["metrics"]["weight_spread"] == 0.0
    node_log = (trial_dir / "node0.log").read_text()
    assert "node 0" in node_log and "ranks 0..0" in node_log
    assert not rank_processes(str(trial_dir / "attempt-0" / "job.json"))


def test_ssh_launcher_two_nodes_in_two_network_namespaces(fake_bin: Path, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          netns_pair: NetnsPair) -> None:
    a_addr, b_addr = netns_pair.ADDRS
    # the executing node (last) is B: rank 0 and the rendezvous live in namespace B
    monkeypatch.setenv("COMPSS_HOSTNAMES", f"{a_addr},{b_addr}")
    monkeypatch.setenv("FAKE_SSH_NETNS", f"{a_addr}={netns_pair.ns[0]},{b_addr}={netns_pair.ns[1]}")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    trial_dir = tmp_path / "trials" / "0"
    req = make_request(trial_dir, processes=2, nodes=2, timeout=120)
    res = run_trial(req.to_json(), json.dumps({"launcher": "ssh"}))
    assert res["status"] == "complete", res
    assert res["metrics"]["weight_spread"] == 0.0 and res["metrics"]["moved"] > 1e-3
    r0, r1 = _outcomes(trial_dir)
    assert r0["metrics"]["weight_spread"] == r1["metrics"]["weight_spread"] == 0.0
    assert r0["host"] == r1["host"]  # same machine, two network namespaces
    job = json.loads((trial_dir / "attempt-0" / "job.json").read_text())
    assert job["master_addr"] == b_addr and job["hosts"] == [b_addr, a_addr]
    ssh_lines = (tmp_path / "ssh.log").read_text().splitlines()
    assert len(ssh_lines) == 2
    hosts = sorted(ast.literal_eval(line)[2] for line in ssh_lines)
    assert hosts == sorted([a_addr, b_addr])
    # each node launcher ran inside its namespace and used the veth interface for gloo
    logs = [(trial_dir / f"node{i}.log").read_text() for i in range(2)]
    assert "node 0" in logs[0] and "node 1" in logs[1]
    assert all(f"gloo interface {netns_pair.IFNAME}" in log for log in logs)
    assert not rank_processes(str(trial_dir / "attempt-0" / "job.json"))
