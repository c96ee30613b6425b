"""Shares of a GPU (``resources.gpus_per_process: 1/k``): k ranks of different trials on one GPU.

The local engine is given stand-in GPUs by id (``LocalEngine(gpus=[0])``), as in test_local.py: it
sets each rank's ``CUDA_VISIBLE_DEVICES`` and cap variables whether or not a device is behind the id,
and a rank on a machine without CUDA records the memory fraction it would have set.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import pytest

from hpoflow.engines.compss.shape import TaskShape
from hpoflow.engines.gpushare import gpu_memory_mib, mps_running, share_env
from hpoflow.engines.local import LocalEngine, plan_placement
from hpoflow.engines.local._slots import all_free, give_back, take
from hpoflow.engines.machine import check_fits
from hpoflow.engines.slurm.engine import SlurmEngine
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest
from tests.engines.test_local import request, run_all

MIG = "MIG-1f5b8a2c-0000-4000-8000-000000000001"


def shape(processes: int, gpus: float) -> TrialRequest:
    return TrialRequest.shape(processes, 1, gpus)


def test_four_quarter_trials_run_at_once_on_one_stand_in_gpu_each_capped(tmp_path: Path) -> None:
    meet = tmp_path / "meet"
    meet.mkdir()
    # four core slots (ids reused: affinity to them is still valid), one stand-in GPU
    engine = LocalEngine(cores=[0, 1, 0, 1], gpus=[0])
    try:
        reqs = [request(tmp_path, n, "trainfns:share_probe", metric="ok", gpus_per_process=0.25,
                        options={"meet": str(meet), "trials": 4}) for n in range(4)]
        assert engine.capacity(reqs[0]) == 4
        results = run_all(engine, reqs)
    finally:
        engine.close()
    assert all(r.status == "complete" for r in results.values()), results
    for n in range(4):
        seen = json.loads((tmp_path / str(n) / "share.json").read_text())
        # each trial finished only after all four had started: they ran at once
        assert seen["arrived"] == 4
        assert seen["CUDA_VISIBLE_DEVICES"] == "0" and seen["HPOFLOW_GPU_SHARE"] == "0.25"
        cap = json.loads((tmp_path / str(n) / "gpu_share_rank0.json").read_text())
        assert cap["cuda_visible_devices"] == "0" and cap["share"] == 0.25 and cap["reserve_mib"] == 512
        if not mps_running(os.environ):
            assert seen["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] is None
            import torch

            assert cap["applied"] == ("torch" if torch.cuda.is_available() else
                                      "none: CUDA is not available in this process")
            # the allocator's cap is the share less the reserve for the rank's context (none without CUDA)
            assert (0 < cap["memory_fraction"] < 0.25) if torch.cuda.is_available() else cap["memory_fraction"] is None


def test_shares_are_packed_and_given_back_and_ranks_of_one_trial_use_different_gpus() -> None:
    gpus = [0, 1, 2]
    free = all_free(gpus)
    half = plan_placement(shape(2, 0.5), [0, 1], free)
    assert half is not None and [p.gpus for p in half] == [(0,), (1,)] and {p.share for p in half} == {Fraction(1, 2)}
    take(free, half)
    # a quarter goes where least is free (GPU 0, half taken), not to the whole GPU 2
    quarter = plan_placement(shape(1, 0.25), [0], free)
    assert quarter is not None and quarter[0].gpus == (0,)
    take(free, quarter)
    whole = plan_placement(shape(1, 1), [0], free)  # only GPU 2 is wholly free
    assert whole is not None and whole[0].gpus == (2,) and whole[0].share is None
    assert plan_placement(shape(2, 1), [0, 1], free) is None
    assert plan_placement(shape(4, 0.25), [0, 1, 2, 3], free) is None  # three GPUs: four ranks cannot spread
    _, free = give_back([], free, half + quarter, [0], gpus)
    assert free == all_free(gpus)
    _, again = give_back([], free, half, [0], gpus)  # released twice: never more than the GPU
    assert again == all_free(gpus)


def test_capacity_checks_and_mig_instances_stay_whole() -> None:
    engine = LocalEngine(cores=[0] * 8, gpus=[0, 1], prestart=False)
    try:
        assert engine.capacity(shape(1, 0.25)) == 8
        assert engine.capacity(shape(2, 0.5)) == 2
        assert engine.capacity(shape(3, 0.5)) == 0
    finally:
        engine.close()
    with pytest.raises(EngineError, match=r"needs 3 different GPUs \(ranks of one trial never share a GPU\), but 2"):
        check_fits(shape(3, 0.5), 8, 2)
    with pytest.raises(EngineError, match=r"gpus_per_process below 1 must be a share 1/k of one GPU .* but got 0.3"):
        check_fits(shape(1, 0.3), 8, 2)
    with pytest.raises(EngineError, match=r"MIG instances, which stay whole.*Fix: set gpus_per_process: 1"):
        check_fits(shape(1, 0.5), 8, 1, n_mig=1)
    assert plan_placement(shape(1, 0.5), [0], [MIG]) is None
    assert plan_placement(shape(1, 1), [0], [MIG]) is not None


@pytest.fixture
def mps_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory with an MPS control socket (a socket bound here: what the control daemon makes)."""
    pipe = tmp_path / "mps"
    pipe.mkdir()
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(pipe / "control"))
    try:
        yield pipe
    finally:
        sock.close()


def test_with_an_mps_daemon_a_share_caps_threads_and_memory(mps_dir: Path, tmp_path: Path) -> None:
    env = {"CUDA_MPS_PIPE_DIRECTORY": str(mps_dir)}
    assert mps_running(env) and not mps_running({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"  # a stand-in for NVML's report of the GPU's memory (MiB)
    smi.write_text("#!/bin/sh\necho 81559\n")
    smi.chmod(smi.stat().st_mode | stat.S_IEXEC)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{bin_dir}{os.pathsep}{old}"
    gpu_memory_mib.cache_clear()  # asked once per GPU: this test's stand-in answers
    try:
        capped = share_env(0, Fraction(1, 4), env)
    finally:
        os.environ["PATH"] = old
        gpu_memory_mib.cache_clear()
    assert capped == {"HPOFLOW_GPU_SHARE": "0.25", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
                      "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT": "0=20389M"}
    assert share_env(0, Fraction(1, 4), {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}) == {"HPOFLOW_GPU_SHARE": "0.25"}


def test_cluster_engines_refuse_a_share_with_one_line() -> None:
    with pytest.raises(EngineError) as slurm:
        SlurmEngine.check_fit(SlurmOptions(), shape(2, 0.25))
    assert "\n" not in str(slurm.value) and "gres/shard" in str(slurm.value) and "Fix:" in str(slurm.value)
    with pytest.raises(ValueError, match="COMPSs gives a task whole GPUs") as compss:
        TaskShape.of(2, 1, 0.5, 1, None)
    assert "\n" not in str(compss.value)


SPEC = """\
study: {{name: share, metric: val_accuracy, direction: maximize}}
space: {{lr: {{type: float, low: 0.001, high: 0.1, log: true}}}}
search: {{algorithm: random, n_trials: 2}}
training: {{model: mlp, dataset: digits, epochs: 1, batch_size: {batch}}}
resources: {{gpus_per_process: {gpus}}}
oracle: {{cluster: {cluster}}}
engine_options: {{gpus: [0]}}
"""


@pytest.mark.parametrize(("gpus", "said"), [
    (0.3, "gpus_per_process below 1 must be a share 1/k of one GPU (0.5, 0.25, 0.125, 0.333 for a third), but got "
          "0.3. Fix: use 1/3 = 0.3333, or a whole number"),
    (1.5, "gpus_per_process above 1 must be a whole number of GPUs, but got 1.5. Fix: use 0, a whole number, or a "
          "share 0.5, 0.25, 0.125, ... (at least 1/64)"),
], ids=["0.3", "1.5"])
def test_validate_refuses_other_fractions_with_one_line(tmp_path: Path, gpus: float, said: str) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC.format(batch=16, gpus=gpus, cluster="laptop"))
    r = subprocess.run([sys.executable, "-m", "hpoflow", "validate", "spec.yaml"], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.splitlines() == ["hpoflow: error: invalid study spec (1 problem):",
                                     f"  spec.yaml:5: resources.gpus_per_process: {said}"]


def test_validate_checks_that_a_trial_fits_its_share(tmp_path: Path) -> None:
    """A device of 64 MB: an mlp trial at batch 4096 (about 9 MiB per rank) fits a quarter of it, not a
    sixty-fourth (the oracle's precheck refuses such trials one by one as they run, with the same reason)."""
    from hpoflow.api.preflight import check_share
    from hpoflow.oracle.catalog import PRESETS
    from hpoflow.spec import load_spec

    small = {**PRESETS["laptop"], "name": "small", "devices_per_node": 1,
             "device": {"name": "small", "peak_flops": {"fp32": 1e12}, "memory_bytes": 6.4e7,
                        "memory_bandwidth": 1e11}}
    (tmp_path / "small.yaml").write_text(json.dumps(small))  # JSON is YAML

    def write(gpus: float) -> Path:
        path = tmp_path / "spec.yaml"
        path.write_text(SPEC.format(batch=4096, gpus=gpus, cluster=tmp_path / "small.yaml"))
        return path

    for fits in (1, 0.25):
        check_share(*load_spec(write(fits)))  # (no error)
    write(0.015625)
    r = subprocess.run([sys.executable, "-m", "hpoflow", "validate", "spec.yaml"], capture_output=True, text=True,
                       timeout=180, cwd=tmp_path, env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    head, problem = r.stderr.splitlines()
    assert head == "hpoflow: error: invalid study spec (1 problem):"
    assert problem.startswith("  spec.yaml:5: resources.gpus_per_process: no trial of this study fits its share of a "
                              "GPU; the smallest: memory per rank must fit its share of the GPU: trial needs "), problem
    assert "but a 0.015625 share (gpus_per_process) of small is 1.0 MiB of 61.0 MiB. Fix: " in problem
