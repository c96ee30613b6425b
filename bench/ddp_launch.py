"""DDP launch: time from submitting a 2-rank trial to its first training step, hpoflow vs torchrun.

hpoflow: a prestarted, warm ``LocalEngine`` (forkserver with torch preloaded, persistent workers)
runs trials of ``bench_objectives:ddp_first_step``: both ranks join a fresh gloo process group on
loopback, wrap a tiny model in DDP and read the wall clock just before their first step. Two figures
per trial: the engine's own ``launch_s`` (submit -> training function starts, rendezvous included)
and the independent one, the function's ``first_step_at`` minus the wall time of ``submit``.

torchrun: one ``python -m torch.distributed.run --standalone --nproc_per_node=2`` per trial (this
script in worker mode), the way a script-per-trial launcher starts a DDP trial: the same model, DDP
wrap and clock read; time from starting the command to rank 0's first step.

    python bench/ddp_launch.py [--trials 12] [--torchrun-trials 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH, emit, median

TARGET_S = 0.5


def run_hpoflow(n: int) -> tuple[list[float], list[float]]:
    """``n`` 2-rank trials on one warm engine; per trial (launch_s, submit -> first step)."""
    from hpoflow.engines.local import LocalEngine
    from hpoflow.spec import TrainConfig
    from hpoflow.trial import TrialRequest, TrialResult

    engine = LocalEngine(cores=_two_cores())
    engine.wait_warm()  # forkserver start and worker forks are one-time costs, not per trial
    train = TrainConfig(function="bench_objectives:ddp_first_step").model_dump(mode="json")
    launch, first_step = [], []
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(n):
                req = TrialRequest(number=i, params={}, train=train, metric="value", direction="minimize",
                                   trial_dir=str(Path(d) / str(i)), processes=2, timeout=120,
                                   python_path=(str(BENCH),))
                submitted = time.time()
                engine.submit(req)
                res = None
                while res is None:
                    res = next((e for e in engine.poll(None) if isinstance(e, TrialResult)), None)
                if res.status != "complete":
                    raise RuntimeError(f"trial {i} {res.status}: {res.error}\n{res.stderr_tail}")
                launch.append(res.timings["launch_s"])
                first_step.append(res.metrics["first_step_at"] - submitted)
    finally:
        engine.close()
    return launch, first_step


def _two_cores() -> list[int]:
    from hpoflow.engines.machine import machine_cores

    cores = machine_cores()
    if len(cores) < 2:
        raise SystemExit(f"a 2-rank trial needs 2 cores, but this process may use {cores}")
    return cores[:2]


def run_torchrun(n: int) -> list[float]:
    """``n`` torchrun launches; per launch, start of the command -> rank 0's first step."""
    out = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as d:
        for i in range(n):
            stamp = Path(d) / f"first_step_{i}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   str(Path(__file__).resolve()), "--torchrun-worker", str(stamp)]
            started = time.time()
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0 or not stamp.exists():
                raise RuntimeError(f"torchrun failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
            out.append(float(stamp.read_text()) - started)
    return out


def torchrun_worker(stamp: str) -> None:
    """One rank under torchrun: the same work as ``bench_objectives.ddp_first_step``."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")  # rank, world size and rendezvous from torchrun's environment
    try:
        torch.manual_seed(0)
        model = DistributedDataParallel(torch.nn.Linear(32, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(16, 32), torch.randn(16, 1)
        first_step_at = time.time()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if dist.get_rank() == 0:
            tmp = Path(stamp + ".tmp")
            tmp.write_text(repr(first_step_at))
            tmp.replace(stamp)
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=12, help="hpoflow trials (one warm engine)")
    ap.add_argument("--torchrun-trials", type=int, default=5, help="torchrun launches")
    ap.add_argument("--torchrun-worker", metavar="STAMP_FILE", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.trials < 1 or a.torchrun_trials < 0:
        raise SystemExit(f"--trials must be >= 1 and --torchrun-trials >= 0, but got {a.trials} and "
                         f"{a.torchrun_trials}")
    if a.torchrun_worker:
        torchrun_worker(a.torchrun_worker)
        return

    launch, first = run_hpoflow(a.trials)
    for i, (ls, fs) in enumerate(zip(launch, first, strict=True)):
        print(f"hpoflow trial {i}: launch_s {ls * 1000:.0f} ms, submit -> first step {fs * 1000:.0f} ms", flush=True)
    tr = run_torchrun(a.torchrun_trials)
    for i, t in enumerate(tr):
        print(f"torchrun launch {i}: start -> first step {t:.2f} s", flush=True)
    hp_first = median(first)
    tr_med = median(tr) if tr else None  # --torchrun-trials 0 (smoke tests): no baseline
    figures = {
        "hpoflow_launch_s": round(median(launch), 4),
        "hpoflow_first_step_s": round(hp_first, 4),
        "hpoflow_first_trial_first_step_s": round(first[0], 4),
        "hpoflow_max_first_step_s": round(max(first), 4),
        "torchrun_launch_s": None if tr_med is None else round(tr_med, 3),
        "speedup_vs_torchrun": None if tr_med is None else round(tr_med / hp_first, 1),
        "trials": a.trials, "torchrun_trials": a.torchrun_trials, "target_s": TARGET_S,
    }
    baseline = "not run" if tr_med is None else f"{tr_med:.2f} s ({figures['speedup_vs_torchrun']}x)"
    print(f"median submit -> first DDP step (2 ranks, gloo): hpoflow {hp_first * 1000:.0f} ms "
          f"(engine launch_s {figures['hpoflow_launch_s'] * 1000:.0f} ms, first trial "
          f"{first[0] * 1000:.0f} ms, worst {max(first) * 1000:.0f} ms), torchrun {baseline}; "
          f"target <= {TARGET_S} s")
    emit(figures)


if __name__ == "__main__":
    main()
