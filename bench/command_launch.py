"""Command trials: time from submitting a 2-rank trial of a plain torchrun script to its first report,
warm (runpy in processes forked from the engine's workers, torch imported already), isolated (a fresh
``python`` per rank, ``training.isolate: true``) and under ``torchrun`` itself, in one run.

The script is examples/scripts/train_ddp.py, for one epoch: each rank sets up its gloo process group
from torchrun's environment, trains an epoch of a small MLP and rank 0 prints ``epoch=1 val_loss=...``.
hpoflow: a prestarted, warm ``LocalEngine`` (its one-time start is left out) gets the trials one after
another; the figure is submit -> the engine's first report event. torchrun: ``torchrun --standalone
--nproc-per-node 2`` per launch; start of the command -> rank 0's ``epoch=1`` line on its stdout.

    python bench/command_launch.py [--trials 5] [--torchrun-trials 3]
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

ROOT = BENCH.parent
SCRIPT = "examples/scripts/train_ddp.py"
ARGS = ["--epochs", "1"]


def run_hpoflow(n: int, isolate: bool) -> list[float]:
    """``n`` 2-rank command trials on one warm engine; per trial, submit -> its first report."""
    from hpoflow.engines.local import LocalEngine
    from hpoflow.engines.machine import machine_cores
    from hpoflow.spec import TrainConfig
    from hpoflow.trial import TrialReport, TrialRequest, TrialResult

    cores = machine_cores()
    if len(cores) < 2:
        raise SystemExit(f"a 2-rank trial needs 2 cores, but this process may use {cores}")
    engine = LocalEngine(cores=cores[:2])
    engine.wait_warm()  # forkserver start and worker forks are one-time costs, not per trial
    train = TrainConfig(command=["python", SCRIPT, *ARGS], isolate=isolate).model_dump(mode="json")
    out = []
    try:
        with tempfile.TemporaryDirectory() as d:
            for i in range(n):
                req = TrialRequest(number=i, params={}, train=train, metric="val_loss", direction="minimize",
                                   trial_dir=str(Path(d) / str(i)), processes=2, timeout=300, workdir=str(ROOT))
                submitted = time.monotonic()
                engine.submit(req)
                first = res = None
                while res is None:
                    for ev in engine.poll(None):
                        if isinstance(ev, TrialReport) and first is None:
                            first = time.monotonic() - submitted
                        elif isinstance(ev, TrialResult):
                            res = ev
                if res.status != "complete" or first is None:
                    raise RuntimeError(f"trial {i} {res.status}: {res.error}\n{res.stderr_tail}")
                out.append(first)
    finally:
        engine.close()
    return out


def run_torchrun(n: int) -> list[float]:
    """``n`` torchrun launches; per launch, start of the command -> rank 0's first ``epoch=`` line."""
    out = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    for i in range(n):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", SCRIPT, *ARGS]
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                text=True)
        first = None
        assert proc.stdout is not None
        for line in proc.stdout:
            if first is None and line.startswith("epoch=1 "):
                first = time.monotonic() - started
        if proc.wait(300) != 0 or first is None:
            raise RuntimeError(f"torchrun launch {i} failed (exit {proc.returncode})")
        out.append(first)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=5, help="hpoflow trials of each kind (one warm engine each)")
    ap.add_argument("--torchrun-trials", type=int, default=3, help="torchrun launches")
    a = ap.parse_args()
    if a.trials < 1 or a.torchrun_trials < 0:
        raise SystemExit(f"--trials must be >= 1 and --torchrun-trials >= 0, but got {a.trials} and "
                         f"{a.torchrun_trials}")
    warm = run_hpoflow(a.trials, isolate=False)
    isolated = run_hpoflow(a.trials, isolate=True)
    torchrun = run_torchrun(a.torchrun_trials)
    for name, xs in (("warm", warm), ("isolated", isolated), ("torchrun", torchrun)):
        print(f"{name:9s} submit -> first report: " + ", ".join(f"{x:.2f}" for x in xs) + " s", flush=True)
    tr = median(torchrun) if torchrun else None  # --torchrun-trials 0 (smoke tests): no baseline
    figures = {
        "warm_first_report_s": round(median(warm), 3),
        "isolated_first_report_s": round(median(isolated), 3),
        "torchrun_first_report_s": None if tr is None else round(tr, 3),
        "warm_speedup_vs_torchrun": None if tr is None else round(tr / median(warm), 1),
        "isolated_speedup_vs_torchrun": None if tr is None else round(tr / median(isolated), 1),
        "trials": a.trials, "torchrun_trials": a.torchrun_trials,
    }
    print(f"median: warm {figures['warm_first_report_s']} s, isolated {figures['isolated_first_report_s']} s, "
          f"torchrun {figures['torchrun_first_report_s']} s", flush=True)
    emit(figures)


if __name__ == "__main__":
    main()
