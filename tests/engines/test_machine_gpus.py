"""GPU detection from CUDA_VISIBLE_DEVICES: indices, and GPU and MIG instance UUIDs (fabricated values,
in the forms NVIDIA documents and SLURM and MIG partitions set), counted and passed on to ranks."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpoflow.engines.cluster.layout import bound_gpus, split_for_ranks
from hpoflow.engines.local.engine import LocalEngine, plan_placement
from hpoflow.engines.machine import check_fits, detect_gpus, parse_visible_devices
from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest

GPU_A = "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6"
GPU_B = "GPU-2d4c3a6e-1b0f-4f1e-9c0e-7a1b2c3d4e5f"
MIG_A = "MIG-1f5b8a2c-3d4e-5f60-7182-93a4b5c6d7e8"
MIG_B = "MIG-9e8d7c6b-5a49-3827-1605-f4e3d2c1b0a9"
MIG_LEGACY = "MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0"


@pytest.mark.parametrize(("value", "devices"), [
    ("0,1", [0, 1]),
    (" 2 , 3 ", [2, 3]),
    (f"{GPU_A},{GPU_B}", [GPU_A, GPU_B]),
    (f"{MIG_A},{MIG_B}", [MIG_A, MIG_B]),
    (MIG_LEGACY, [MIG_LEGACY]),
    (f"{MIG_A}, {GPU_B},3", [MIG_A, GPU_B, 3]),  # mixed, as CUDA allows
    (f"{MIG_A},{MIG_A}", [MIG_A]),  # named twice: one device
    ("", []),  # empty: no GPU
    ("-1", []),  # the usual way to hide every GPU
    ("0,-1,1", [0]),  # CUDA stops at the first invalid entry
    (f"{MIG_A},bogus,{MIG_B}", [MIG_A]),
    ("NoDevFiles", []),  # what some SLURM versions set when no GPU was allocated
])
def test_visible_devices_are_read_as_cuda_reads_them(value: str, devices: list[int | str]) -> None:
    assert parse_visible_devices(value) == devices


def test_detect_gpus_counts_uuids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{MIG_A},{MIG_B}")
    assert detect_gpus() == [MIG_A, MIG_B]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert detect_gpus() == [0, 2]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert detect_gpus() == []


def test_a_trial_of_two_mig_ranks_fits_and_each_rank_gets_its_uuid() -> None:
    req = TrialRequest(0, {}, {}, "m", "minimize", "/tmp/x", processes=2, gpus_per_process=1)
    devices = parse_visible_devices(f"{MIG_A},{MIG_B}")
    check_fits(req, n_cores=2, n_gpus=len(devices))  # no error: 2 GPUs counted
    with pytest.raises(EngineError, match="2 GPUs, but 1 are visible"):
        check_fits(req, n_cores=2, n_gpus=len(parse_visible_devices(MIG_A)))
    placement = plan_placement(req, [0, 1], devices)
    assert placement is not None and [p.gpus for p in placement] == [(MIG_A,), (MIG_B,)]
    # what the local engine writes into each rank's environment: the UUID, not an index
    assert [",".join(str(g) for g in p.gpus) for p in placement] == [MIG_A, MIG_B]


def test_the_local_engine_sees_uuid_gpus(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", f"{GPU_A},{GPU_B}")
    engine = LocalEngine(cores=[0], prestart=False)
    try:
        assert engine.gpus == [GPU_A, GPU_B]
        req = TrialRequest(0, {}, {}, "m", "minimize", str(tmp_path), processes=1, gpus_per_process=2)
        assert engine.capacity(req) == 1
    finally:
        engine.close()


def test_cluster_launchers_pass_uuids_on_per_rank() -> None:
    gpus = bound_gpus({"CUDA_VISIBLE_DEVICES": f"{MIG_A},{MIG_B}"})
    assert gpus == [MIG_A, MIG_B]
    assert split_for_ranks(gpus, 2, 1) == [(MIG_A,), (MIG_B,)]
    assert bound_gpus({"COMPSS_BINDED_GPUS": "2,3", "CUDA_VISIBLE_DEVICES": MIG_A}) == [2, 3]
