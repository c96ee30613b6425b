"""What a share of a GPU protects (docs/architecture.md, shared GPUs), with stand-ins for the GPU: the
memory caps leave each sharer a reserve for what no cap counts (its CUDA context, NCCL's buffers), a
command trial's program on a share without MPS has no cap and the engine says so once, the ranks number
GPUs as nvidia-smi and NVML do (``CUDA_DEVICE_ORDER=PCI_BUS_ID``), and a GPU in MIG mode given by its index
is MIG. ``nvidia-smi`` is a script on PATH answering as NVML would."""

from __future__ import annotations

import json
import logging
import os
import stat
import sys
from collections.abc import Iterator
from dataclasses import replace
from fractions import Fraction
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from hpoflow.engines.gpushare import gpu_memory_mib, is_mig, mig_enabled, share_env
from hpoflow.engines.local import LocalEngine, plan_placement
from hpoflow.engines.machine import check_fits
from hpoflow.errors import EngineError
from hpoflow.spec import TrainConfig
from hpoflow.train import runner
from hpoflow.trial import TrialRequest
from tests.conftest import ROOT
from tests.engines.test_local import request, run_all

_SMI = """#!/bin/sh
# nvidia-smi as NVML answers: GPU 0 is in MIG mode, GPU 1 is not; each has MEMORY MiB
case "$*" in
  *mig.mode.current*) case "$*" in *"-i 0"*) echo Enabled;; *) echo Disabled;; esac;;
  *memory.total*) echo MEMORY;;
  *) exit 9;;
esac
"""


@pytest.fixture
def smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    path = bin_dir / "nvidia-smi"
    path.write_text(_SMI.replace("MEMORY", "16384"))
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    gpu_memory_mib.cache_clear()
    mig_enabled.cache_clear()
    yield path
    gpu_memory_mib.cache_clear()
    mig_enabled.cache_clear()


def test_a_gpu_in_mig_mode_given_by_index_is_mig_and_never_shared(smi: Path) -> None:
    assert is_mig(0) and not is_mig(1) and is_mig("MIG-1f5b8a2c-0000-4000-8000-000000000001")
    one = TrialRequest.shape(1, 1, 0.5)
    assert plan_placement(one, [0], {0: Fraction(1), 1: Fraction(1)})[0].gpus == (1,)  # type: ignore[index]
    assert plan_placement(one, [0], {0: Fraction(1)}) is None
    engine = LocalEngine(cores=[0] * 4, gpus=[0, 1], prestart=False)
    try:
        assert engine.capacity(TrialRequest.shape(1, 1, 0.25)) == 4  # GPU 1's four quarters; GPU 0 stays whole
    finally:
        engine.close()
    with pytest.raises(EngineError, match="1 of the GPUs here are MIG instances"):
        check_fits(one, 4, 2, sum(1 for g in (0, 1) if is_mig(g)))


def test_each_sharer_s_cap_leaves_a_reserve_for_its_context(smi: Path, tmp_path: Path) -> None:
    env = share_env(1, Fraction(1, 4), {}, reserve_mib=512)
    assert env == {"HPOFLOW_GPU_SHARE": "0.25", "HPOFLOW_GPU_SHARE_RESERVE_MIB": "512",
                   "HPOFLOW_GPU_MEMORY_FRACTION": f"{(16384 / 4 - 512) / 16384:.6g}"}  # 3.5 of 16 GiB, not 4
    mps = tmp_path / "mps"
    mps.mkdir()
    import socket

    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(mps / "control"))
        capped = share_env(1, Fraction(1, 4), {"CUDA_MPS_PIPE_DIRECTORY": str(mps)}, reserve_mib=512)
        tiny = share_env(1, Fraction(1, 64), {"CUDA_MPS_PIPE_DIRECTORY": str(mps)}, reserve_mib=512)
    assert capped["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={16384 // 4 - 512}M"
    assert capped["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    # 256 MiB cannot hold the reserve: no MPS limit, no fraction; the rank refuses to start (below)
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT" not in tiny and "HPOFLOW_GPU_MEMORY_FRACTION" not in tiny


class _FakeCuda:
    """``torch.cuda``'s calls ``_cap_gpu_share`` makes, on a 16 GiB device."""

    def __init__(self) -> None:
        self.fractions: list[tuple[float, int]] = []

    def get_device_properties(self, device: int) -> SimpleNamespace:
        return SimpleNamespace(total_memory=16 * 2**30)

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.fractions.append((fraction, device))


def test_a_rank_caps_its_allocator_to_its_share_less_the_reserve(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    fake = _FakeCuda()
    monkeypatch.setattr(torch, "cuda", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT", raising=False)
    monkeypatch.delenv("HPOFLOW_GPU_SHARE_RESERVE_MIB", raising=False)
    monkeypatch.setenv("HPOFLOW_GPU_SHARE", "0.25")
    req = replace(TrialRequest.shape(1, 1, 0.25), trial_dir=str(tmp_path))
    runner._cap_gpu_share(req, 0, use_cuda=True)
    assert fake.fractions == [(0.25 - 512 / 16384, 0)]
    record = json.loads((tmp_path / "gpu_share_rank0.json").read_text())
    assert record["memory_fraction"] == 0.25 - 512 / 16384 and record["reserve_mib"] == 512
    assert record["memory_cap_mib"] == 16384 / 4 - 512 and record["applied"] == "torch"
    monkeypatch.setenv("HPOFLOW_GPU_SHARE_RESERVE_MIB", "1024")
    runner._cap_gpu_share(req, 0, use_cuda=True)
    assert fake.fractions[-1] == (0.25 - 1024 / 16384, 0)
    monkeypatch.setenv("HPOFLOW_GPU_SHARE", "0.015625")  # 256 MiB: less than the reserve
    with pytest.raises(ValueError, match=r"a 0.015625 share of GPU 1 is 256 MiB of 16384 MiB, which does not "
                                         r"hold the 1024 MiB .* Fix: a larger share"):
        runner._cap_gpu_share(req, 0, use_cuda=True)
    assert len(fake.fractions) == 2


def test_an_unreadable_reserve_is_refused_before_anything_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    from hpoflow.engines.local.options import LocalOptions

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # (a stand-in GPU: the share fits)
    monkeypatch.setenv("HPOFLOW_GPU_SHARE_RESERVE_MIB", "half a gig")
    with pytest.raises(EngineError, match=r"HPOFLOW_GPU_SHARE_RESERVE_MIB must be a whole number of MiB >= 0, "
                                          r"but got 'half a gig'"):
        LocalEngine.check_fit(LocalOptions(), TrialRequest.shape(1, 1, 0.25))
    with pytest.raises(EngineError, match="HPOFLOW_GPU_SHARE_RESERVE_MIB must be a whole number"):
        LocalEngine(cores=[0], gpus=[0], prestart=False)


_PROGRAM = ("import json, os, pathlib; keys = ('CUDA_DEVICE_ORDER', 'HPOFLOW_GPU_SHARE', 'HPOFLOW_GPU_MEMORY_FRACTION',"
            " 'HPOFLOW_GPU_SHARE_RESERVE_MIB'); pathlib.Path(os.environ['HPOFLOW_TRIAL_DIR'], 'env.json').write_text("
            "json.dumps({k: os.environ.get(k) for k in keys})); print('val_loss=0.5')")


def _command(tmp_path: Path, number: int) -> TrialRequest:
    train = TrainConfig(command=[sys.executable, "-c", _PROGRAM]).model_dump(mode="json")
    return TrialRequest(number, {"x": 0.5}, train, "val_loss", "minimize", str(tmp_path / str(number)),
                        workdir=str(ROOT), gpus_per_process=0.25)


def test_a_command_trial_on_a_share_without_mps_is_warned_of_once_and_told_its_fraction(
        smi: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "no-mps"))
    monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
    monkeypatch.delenv("HPOFLOW_GPU_SHARE_RESERVE_MIB", raising=False)
    engine = LocalEngine(cores=[0, 1], gpus=[1])
    try:
        with caplog.at_level(logging.WARNING, logger="hpoflow"):
            results = run_all(engine, [_command(tmp_path, 0), _command(tmp_path, 1)])
    finally:
        engine.close()
    assert all(r.status == "complete" for r in results.values()), results
    said = [r.getMessage() for r in caplog.records if "no memory cap" in r.getMessage()]
    assert len(said) == 1, said  # once per engine, not per trial
    assert "no MPS control daemon runs" in said[0] and "HPOFLOW_GPU_MEMORY_FRACTION" in said[0]
    for n in (0, 1):
        seen = json.loads((tmp_path / str(n) / "env.json").read_text())
        assert seen == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "HPOFLOW_GPU_SHARE": "0.25",
                        "HPOFLOW_GPU_MEMORY_FRACTION": f"{(16384 / 4 - 512) / 16384:.6g}",
                        "HPOFLOW_GPU_SHARE_RESERVE_MIB": "512"}


def test_ranks_number_gpus_in_pci_order_unless_the_user_chose_an_order(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}
    for order in (None, "FASTEST_FIRST"):
        if order is None:
            monkeypatch.delenv("CUDA_DEVICE_ORDER", raising=False)
        else:
            monkeypatch.setenv("CUDA_DEVICE_ORDER", order)
        engine = LocalEngine(cores=[0], gpus=[0])
        try:
            req = request(tmp_path / str(order), 0, "trainfns_light:environment", metric="value")
            (res,) = run_all(engine, [req]).values()
        finally:
            engine.close()
        assert res.status == "complete", res.error
        environ = json.loads((tmp_path / str(order) / "0" / "seen0.json").read_text())["environ"]
        seen[str(order)] = environ.get("CUDA_DEVICE_ORDER")
    assert seen == {"None": "PCI_BUS_ID", "FASTEST_FIRST": "FASTEST_FIRST"}
