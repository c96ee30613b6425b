"""torchrun's device view for command trials (``hpoflow.train.devices``): the program of each rank on a
node sees the trial's GPUs on that node in local-rank order, so ``cuda:LOCAL_RANK`` is its own GPU.

The mapping as a pure function; the exchange through a real torch store (threads as ranks); then real
2-rank command trials with stand-in GPU ids (no CUDA is touched: the program only records its
environment) on the local engine and on the cluster node launcher a COMPSs task (and a SLURM trial
job) runs. The SLURM steps and node agents are tested on the test cluster's site profile
(tests/engines/slurm/test_site.py)."""

from __future__ import annotations

import datetime
import json
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from torch.distributed import HashStore  # type: ignore[attr-defined]  # not re-exported in the stubs

from hpoflow.engines.cluster.attempt import run_trial
from hpoflow.engines.local import LocalEngine
from hpoflow.spec import TrainConfig
from hpoflow.train.devices import DeviceView, gather_node_gpus, node_view, program_devices, visible_ids
from hpoflow.trial import TrialRequest
from tests.conftest import ROOT
from tests.engines.test_local import request as function_request
from tests.train.test_command import events

PROG = [sys.executable, str(ROOT / "tests" / "commandprog.py")]  # a fresh process: no CUDA state of a worker
WARM = ["python", "tests/commandprog.py"]  # runs warm in a process forked from the worker


def test_a_value_of_cuda_visible_devices_is_read_as_cuda_reads_it() -> None:
    assert visible_ids("5, 7") == ["5", "7"]
    assert visible_ids("GPU-8932f937-aaaa,MIG-1f5b8a2c-bbbb") == ["GPU-8932f937-aaaa", "MIG-1f5b8a2c-bbbb"]
    assert visible_ids("2,-1,3") == ["2"]  # CUDA stops at the first entry that names no device
    assert visible_ids("1,1") == ["1"] and visible_ids("") == [] and visible_ids(None) == []


def test_each_rank_of_a_node_sees_every_gpu_of_the_node_in_local_rank_order() -> None:
    peers = [["5"], ["7"]]
    assert node_view(peers, 0) == DeviceView(("5", "7"), (0,))
    assert node_view(peers, 1) == DeviceView(("5", "7"), (1,))  # cuda:LOCAL_RANK is the rank's own
    two_each = [["0", "1"], ["2", "3"], ["4", "5"]]
    for lr in range(3):  # gpus_per_process: 2: entries 2*LOCAL_RANK and 2*LOCAL_RANK+1
        assert node_view(two_each, lr) == DeviceView(("0", "1", "2", "3", "4", "5"), (2 * lr, 2 * lr + 1))
    uuids = [["GPU-b"], ["GPU-a"]]  # in local-rank order, not sorted
    assert node_view(uuids, 1) == DeviceView(("GPU-b", "GPU-a"), (1,))


def test_ranks_that_share_a_gpu_see_it_once_and_are_told_their_index() -> None:
    """A launcher with fewer GPUs than ranks shares them round-robin: CUDA refuses a list that names a
    device twice, so each GPU is listed once and HPOFLOW_CUDA_DEVICE, not LOCAL_RANK, is the rank's."""
    shared = [["0"], ["1"], ["0"], ["1"]]
    assert [node_view(shared, lr) for lr in range(4)] == [DeviceView(("0", "1"), (i,)) for i in (0, 1, 0, 1)]
    assert node_view([["0", "2"], ["1", "2"]], 1) == DeviceView(("0", "2", "1"), (2, 1))
    env = DeviceView(("0", "1"), (0,)).env({}, ["0"])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,1", "HPOFLOW_CUDA_DEVICE": "0", "HPOFLOW_CUDA_DEVICES": "0"}


def test_mig_instances_no_gpu_and_a_wrong_local_rank() -> None:
    # CUDA enumerates one MIG instance per process: each rank keeps its own
    assert node_view([["MIG-a"], ["MIG-b"]], 1) == DeviceView(("MIG-b",), (0,))
    assert node_view([["MIG-a"]], 0) == DeviceView(("MIG-a",), (0,))
    assert node_view([["0"], []], 1) is None  # no GPU of its own: its view is left alone
    with pytest.raises(ValueError, match="local rank 2 is not one of the node's 2 rank"):
        node_view([["0"], ["1"]], 2)


def test_an_mps_memory_limit_follows_the_ranks_gpu_to_its_index_in_the_programs_list() -> None:
    view = DeviceView(("5", "7"), (1,))
    assert view.env({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20389M"}, ["7"])["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] \
        == "1=20389M"
    assert view.env({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "4G"}, ["7"])["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "4G"
    two = DeviceView(("0", "1", "2", "3"), (2, 3))
    assert two.env({"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=1G,1=2G,5=9G"}, ["2", "3"])[
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "2=1G,3=2G"  # an ordinal the rank did not have: dropped
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in view.env({}, ["7"])


def _gather_all(layout: list[tuple[str, int, list[str]]], local_world: int) -> list[list[list[str]] | None]:
    """Every rank of ``layout`` (rank -> node, local rank, own GPUs) in a thread of its own, one store."""
    store = HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    out: list[list[list[str]] | None] = [None] * len(layout)
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        node, lr, own = layout[r]
        try:
            out[r] = gather_node_gpus(store, r, lr, len(layout), local_world, own, node)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(layout))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    return out


def test_the_ranks_of_each_node_learn_their_peers_gpus_through_the_store() -> None:
    layout = [("a", 0, ["0"]), ("a", 1, ["1"]), ("b", 0, ["2"]), ("b", 1, ["0"])]
    got = _gather_all(layout, 2)
    assert got == [[["0"], ["1"]], [["0"], ["1"]], [["2"], ["0"]], [["2"], ["0"]]]
    # srun --distribution=cyclic: a block of ranks is not one node's; no rank waits, each keeps its own view
    cyclic = [("a", 0, ["0"]), ("b", 0, ["0"]), ("a", 1, ["1"]), ("b", 1, ["1"])]
    assert _gather_all(cyclic, 2) == [None] * 4


def test_what_program_devices_gives_one_rank_a_cpu_trial_and_ranks_on_one_node() -> None:
    assert program_devices(0, 0, 1, 1, 1, {"CUDA_VISIBLE_DEVICES": "3"}) == {
        "CUDA_VISIBLE_DEVICES": "3", "HPOFLOW_CUDA_DEVICE": "0", "HPOFLOW_CUDA_DEVICES": "0"}
    assert program_devices(0, 0, 2, 2, 0, {"CUDA_VISIBLE_DEVICES": "3"}) == {}  # no GPU asked: untouched
    assert program_devices(0, 0, 1, 1, 1, {}) == {}
    store = HashStore()
    store.set_timeout(datetime.timedelta(seconds=20))
    store.set("hpoflow/command/gpus/0", json.dumps({"node": "n1", "local_rank": 0, "gpus": ["2", "3"]}))
    got = program_devices(1, 1, 2, 2, 2, {"CUDA_VISIBLE_DEVICES": "0,1", "SLURMD_NODENAME": "n1"}, store)
    assert got == {"CUDA_VISIBLE_DEVICES": "2,3,0,1", "HPOFLOW_CUDA_DEVICE": "2", "HPOFLOW_CUDA_DEVICES": "2,3"}


# -- real trials ------------------------------------------------------------------------------------------
def _command_request(tmp_path: Path, number: int, env_file: Path, prog: list[str], **kw: Any) -> TrialRequest:
    train = TrainConfig(command=[*prog, "--epochs", "1", "--env", str(env_file)]).model_dump(mode="json")
    return TrialRequest(number, {"x": 0.5}, train, "val_loss", "minimize", str(tmp_path / str(number)),
                        workdir=str(ROOT), **kw)


def _seen(env_file: Path, ranks: int) -> list[dict[str, str]]:
    return [json.loads(Path(str(env_file).replace("RANK", str(r))).read_text())["environ"] for r in range(ranks)]


def _own_gpus(trial_dir: Path, rank: int) -> list[str]:
    """The rank's own GPUs as its rank process had them (its CUDA_VISIBLE_DEVICES, which the rank log names)."""
    found = re.findall(r"rank \d+ \(local rank \d+\) has GPU\(s\) (\S+);", (trial_dir / f"rank{rank}.log").read_text())
    assert found, (trial_dir / f"rank{rank}.log").read_text()
    return found[-1].split(",")


def test_on_the_local_engine_each_rank_sees_the_trials_gpus_and_its_own_at_local_rank(tmp_path: Path) -> None:
    """Stand-in GPUs 5 and 7 (``LocalEngine(gpus=...)``, as test_local.py fakes them): a 2-rank command
    trial with a GPU per rank, warm and isolated, and a function trial on the same GPUs, whose ranks keep
    their own GPU each (``ctx.device``'s view)."""
    env_file = tmp_path / "env_RANK.json"
    engine = LocalEngine(cores=[0, 1], gpus=[5, 7])
    try:
        results = events(engine, [_command_request(tmp_path, 0, env_file, WARM, processes=2, gpus_per_process=1)])
        warm = _seen(env_file, 2)
        results |= events(engine, [_command_request(tmp_path, 1, env_file, PROG, processes=2, gpus_per_process=1)])
        isolated = _seen(env_file, 2)
        results |= events(engine, [_command_request(tmp_path, 2, tmp_path / "one_RANK.json", PROG, gpus_per_process=1)])
        results |= events(engine, [function_request(tmp_path, 3, "trainfns:env_probe", metric="ok", processes=2,
                                                    gpus_per_process=1)])
    finally:
        engine.close()
    assert all(r.status == "complete" for r in results.values()), results
    for number, seen in ((0, warm), (1, isolated)):
        own = [_own_gpus(tmp_path / str(number), r) for r in (0, 1)]
        assert sorted(own) == [["5"], ["7"]], own  # the engine gave each rank one of the two
        for r, env in enumerate(seen):
            assert env["LOCAL_RANK"] == str(r) and env["LOCAL_WORLD_SIZE"] == "2"
            listed = env["CUDA_VISIBLE_DEVICES"].split(",")
            assert listed == [own[0][0], own[1][0]], (listed, own)  # the trial's GPUs, local rank 0's first
            assert listed[int(env["LOCAL_RANK"])] == own[r][0]  # cuda:LOCAL_RANK is its own GPU
            assert env["HPOFLOW_CUDA_DEVICE"] == env["LOCAL_RANK"]
        assert seen[0]["CUDA_VISIBLE_DEVICES"] == seen[1]["CUDA_VISIBLE_DEVICES"]
    (one,) = _seen(tmp_path / "one_RANK.json", 1)
    assert one["CUDA_VISIBLE_DEVICES"] in ("5", "7") and one["HPOFLOW_CUDA_DEVICE"] == "0"  # its own GPU, as before
    function_seen = sorted((tmp_path / "3" / f"env{r}.txt").read_text().split("\n")[0] for r in (0, 1))
    assert function_seen == ["5", "7"]  # a function trial's ranks: their own GPU each, unchanged


def test_two_gpus_per_rank_on_the_local_engine(tmp_path: Path) -> None:
    env_file = tmp_path / "env_RANK.json"
    engine = LocalEngine(cores=[0, 1], gpus=[0, 1, 2, 3])
    try:
        results = events(engine, [_command_request(tmp_path, 0, env_file, PROG, processes=2, gpus_per_process=2)])
    finally:
        engine.close()
    assert results[0].status == "complete", results
    own = [_own_gpus(tmp_path / "0", r) for r in (0, 1)]
    for r, env in enumerate(_seen(env_file, 2)):
        listed = env["CUDA_VISIBLE_DEVICES"].split(",")
        assert listed == own[0] + own[1] and len(set(listed)) == 4, (listed, own)
        assert listed[2 * r:2 * r + 2] == own[r] and env["HPOFLOW_CUDA_DEVICES"] == f"{2 * r},{2 * r + 1}"


def test_the_cluster_node_launcher_of_a_compss_task_gives_the_same_view(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A COMPSs task (and a SLURM trial job) runs a trial through ``run_trial``: one node launcher here,
    which splits the GPUs COMPSs bound to the task (``COMPSS_BINDED_GPUS``, stand-ins 5 and 7) between
    its ranks, fresh interpreters that run the command trial."""
    monkeypatch.setenv("COMPSS_BINDED_GPUS", "5,7")
    monkeypatch.delenv("COMPSS_BINDED_CPUS", raising=False)
    env_file = tmp_path / "env_RANK.json"
    req = _command_request(tmp_path, 0, env_file, PROG, processes=2, gpus_per_process=1, timeout=120)
    res = run_trial(req.to_json(), "{}")
    assert res["status"] == "complete", res
    seen = _seen(env_file, 2)
    assert [_own_gpus(tmp_path / "0", r) for r in (0, 1)] == [["5"], ["7"]]  # the launcher's split, by local rank
    for r, env in enumerate(seen):
        assert env["CUDA_VISIBLE_DEVICES"] == "5,7" and env["LOCAL_RANK"] == str(r)
        assert env["HPOFLOW_CUDA_DEVICE"] == str(r) and env["LOCAL_WORLD_SIZE"] == "2"
