"""Smoke tests of the benchmark scripts: each runs with tiny arguments and ends with its JSON line."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"

CASES = {
    "driver_scale.py": (["--trials", "40", "--block", "20"],
                        {"trials", "total_s", "ms_per_trial_first_1000", "ms_per_trial_last_1000", "growth_ratio",
                         "curve", "waiting_scan_ms_at_end"}),
    "utilization.py": (["--trials", "4", "--repeats", "1", "--median-s", "0.05", "--no-torch-preload"],
                       {"hpoflow_busy", "batch_busy", "ideal_async_busy"}),
    "ddp_launch.py": (["--trials", "2", "--torchrun-trials", "0"],
                      {"hpoflow_launch_s", "torchrun_launch_s", "hpoflow_first_step_s"}),
    "command_launch.py": (["--trials", "1", "--torchrun-trials", "0"],
                          {"warm_first_report_s", "isolated_first_report_s", "torchrun_first_report_s"}),
    "command_reports.py": (["--lines", "50", "200"], {"lines", "ratio"}),
    "startup.py": (["--repeats", "1", "--trials", "6"],
                   {"help_s", "validate_s", "status_s", "run_2_trials_s", "first_trial_start_s", "run_fixed_s",
                    "run_overhead_ms_per_trial_slot", "optuna_threads_2_trials_s"}),
    "simulate.py": (["--quick"], {"scale", "sampler_ms_per_trial", "replay"}),
    "elastic.py": (["--quick"], {"speedup_2", "64_slots", "real"}),
    "ask_ahead.py": (["--trials", "6", "--trial-s", "0.05", "--repeats", "1"], {"off", "on", "makespan_ratio"}),
    "checkpoint_study.py": (["--quick"], {"rows", "machine", "filesystem", "cluster"}),
    "worker_overheads.py": (["--calls", "10", "--lines", "1000", "--repeats", "1"],
                            {"reap_proc_children_us", "reap_psutil_us", "log_pump_overhead"}),
    # 3 digits trials on 2 slots: a later trial beside the first ones, so digits_first_vs_later_duration is
    # measured (with 2 it was None)
    "peers.py": (["--digits-trials", "3", "--epochs", "1", "--short-trials", "4", "--repeats", "1"],
                 {"digits_wall_ratio", "digits_pss_ratio", "digits_first_vs_later_duration",
                  "short_hpoflow_overhead_ms_per_trial_slot", "short_optuna_overhead_ms_per_trial_slot"}),
    "busy.py": (["true"], {"exit", "wall_s", "busy_core_s", "idle_core_s", "mean_busy_cores"}),
    "agent_fleet.py": (["--agents", "64", "--trials", "200", "--small", "16", "--idle-s", "2", "--procs", "2"],
                       {"cpu_per_trial_ms", "cpu_per_heartbeat_us", "each_completed_once"}),
    "gpu_check.py": (["--dry-run"], {"environment", "trials", "epochs", "cpu", "gpu", "share"}),
    "suite_cpu.py": (["--out", "cpu", "-n", "2", "-q", "tests/test_layers.py"],
                     {"tests", "cpu_s", "wall_s", "pytest_exit"}),
    "slurm_steps.py": (["--trials", "4", "--repeats", "1", "--no-torch-preload"],
                       {"steps", "agents", "local_overhead_ms_per_trial_slot", "steps_vs_agents_overhead"}),
}
# A bound for a hang, not a speed: each script takes seconds on a quiet machine and a few minutes with
# other work on both cores.
SCRIPT_TIMEOUT_S = 900

pytestmark = pytest.mark.slow  # runs the benchmark scripts


@pytest.mark.parametrize("script", sorted(CASES))
def test_bench_script_ends_with_its_json_line(script: str, tmp_path: Path) -> None:
    if script == "slurm_steps.py":  # it starts a real SLURM cluster of its own (tests/infra/slurm.py)
        from tests.infra.slurm import unavailable_reason

        reason = unavailable_reason()
        if reason:
            pytest.skip(f"no SLURM cluster: {reason}")
    if script == "suite_cpu.py" and os.geteuid() != 0:  # it makes a cgroup of each pytest process's own
        pytest.skip("suite_cpu.py needs root to make its cgroups")
    args, keys = CASES[script]
    proc = subprocess.run([sys.executable, str(BENCH / script), *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert keys <= set(figures), f"{script} JSON line lacks {sorted(keys - set(figures))}: {figures}"
    if script == "peers.py":  # measured, not None: a later digits trial ran beside the first ones
        assert figures["digits_first_vs_later_duration"] is not None, figures
    if script == "gpu_check.py":  # the cpu study ran every trial; the GPU studies only where CUDA is
        assert figures["cpu"]["complete"] == figures["trials"] == 2 and figures["cpu"]["failed"] == 0, figures
        if not figures["environment"]["cuda_available"]:
            assert figures["gpu"] is None and figures["share"] is None, figures
    if script == "suite_cpu.py":  # the two tests of tests/test_layers.py, each charged what its worker spent
        assert figures["tests"] == 2 and figures["cpu_s"] > 0 and figures["pytest_exit"] == 0, figures


def test_oracle_validation_with_a_given_calibration(tmp_path: Path, calibration_2: tuple[Any, Path]) -> None:
    cal = calibration_2[1]
    proc = subprocess.run([sys.executable, str(BENCH / "oracle_validation.py"), "--calibration", str(cal),
                           "--steps", "10"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=SCRIPT_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(figures["ratios"]) == {"mlp@1", "mlp@2", "cnn@1", "cnn@2"}
    assert all(r > 0 for r in figures["ratios"].values()) and figures["rounds"] == 1
    assert set(figures["per_round"]) == set(figures["ratios"])


def _bench_module(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_busy_reads_what_the_kernels_process_accounting_wrote() -> None:
    """``busy.py --processes``'s reading of acct_v3 records, from records made here: turning the kernel's
    accounting on in a test would turn off one measuring the whole suite (there is one per machine)."""
    busy = _bench_module("busy")

    def record(comm: bytes, forked: bool, utime: int, stime: int = 0, version: int = 3) -> bytes:
        return struct.pack("=BBHIIIIIIf8H16s", 0x01 if forked else 0, version, 0, 0, 0, 0, 4321, 1, 0, 0.0,
                           utime, stime, 0, 0, 0, 0, 0, 0, comm)

    exponent_1 = (1 << 13) | 10  # a comp_t of 10 * 8**1 ticks
    data = b"".join([record(b"python", False, 250, 50), record(b"python", False, 40), record(b"python", False, 70),
                     record(b"python", True, 150), record(b"slurmd", False, exponent_1),
                     record(b"python", False, 9999, version=2)])  # not v3: skipped
    ended = list(busy.read_accounting(data))
    assert [(e.command, e.forked, e.cpu_s) for e in ended] == [
        ("python", False, 3.0), ("python", False, 0.4), ("python", False, 0.7), ("python", True, 1.5),
        ("slurmd", False, 0.8)]
    summary = busy.summarize(ended)
    assert summary["processes"] == 5 and summary["cpu_s"] == pytest.approx(6.4)
    assert [(r["command"], r["processes"], r["cpu_s"]) for r in summary["by_command"]] == [
        ("python", 3, 4.1), ("python*", 1, 1.5), ("slurmd", 1, 0.8)]
    bands = {tuple(r["band_s"]): (r["processes"], r["cpu_s"]) for r in summary["largest_by_band"]}
    assert bands == {(0.0, 0.5): (1, 0.4), (0.5, 1.0): (1, 0.7), (1.0, 2.5): (0, 0), (2.5, 6.0): (1, 3.0),
                     (6.0, None): (0, 0)}


def test_busy_names_each_process_by_its_command_line() -> None:
    """``busy.py --kinds``: the kind of a process from its command line, and a process of the accounting
    found among those a ``Sightings`` saw running (a real child here), or by its parent when it forked without
    an exec; what it never saw is named as such."""
    busy = _bench_module("busy")
    py = "/usr/bin/python3"
    assert [busy.kind(a) for a in (
        [py, "-c", "from multiprocessing.forkserver import main; main(8, 9, ['x'], **{})"],
        [py, "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"],
        [py, "-m", "hpoflow", "run", "spec.yaml", "--json"],
        ["/usr/bin/python3", "/usr/local/bin/hpoflow", "validate", "spec.yaml"],
        [py, "-m", "hpoflow.engines.cluster.node", "rank", "--world", "2"],
        [py, "-X", "importtime", "-m", "pytest", "-q"],
        [py, "-u", "examples/scripts/train_hf.py", "--epochs", "1"],
        [py, "-c", "print(1)"],
        [py, "-m", "hpoflow.engines.agent", "--port", "1"],
        ["/usr/sbin/slurmd", "-N", "n1"],
    )] == ["forkserver", "pytest-xdist worker", "hpoflow run", "hpoflow validate",
           "hpoflow.engines.cluster.node rank", "pytest", "train_hf.py", "python -c", "hpoflow.engines.agent",
           "slurmd"]

    seen = busy.Sightings(every_s=0.02)
    seen.start()
    began = int(time.time())
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    child.wait()
    seen.stop()
    argv = seen.find(child.pid, began)
    assert argv is not None and argv[1:] == ["-c", "import time; time.sleep(0.5)"], argv
    ended = [busy.Ended("python", False, 1.0, child.pid, os.getpid(), began),
             busy.Ended("python", True, 0.5, child.pid + 1, child.pid, began),  # forked by the child
             busy.Ended("python", True, 0.25, child.pid + 1, child.pid, began),
             busy.Ended("python", False, 2.0, 1, 0, began - 3600),  # not seen (pid 1 began long before)
             busy.Ended("srun", False, 0.125, child.pid, os.getpid(), began)]  # exec'd after the sighting
    rows = [(r["kind"], r["processes"], r["cpu_s"]) for r in busy.summarize_kinds(ended, seen)]
    assert rows == [("python (unseen)", 1, 2.0), ("python -c", 1, 1.0), ("forked from python -c", 2, 0.8),
                    ("srun", 1, 0.1)], rows
