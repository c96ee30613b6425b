"""Overhead per trial and slot: 200 trials of a 50 ms function on 2 slots.

hpoflow (local engine: warm forkserver, async driver, journal storage) against, in the same run,
one fresh Python process per trial that imports torch and the trial runner and runs the function,
as a script-per-trial launcher of torch training does; and Optuna's thread mode. hpoflow runs twice:
as configured (per-rank system usage sampled, ``hpoflow.train.usage``) and, in a child process with
``HPOFLOW_USAGE=0``, without the sampler: the difference is the sampler's cost.

overhead per trial and slot = (wall time x slots - trials x 50 ms) / trials

    python bench/trial_overhead.py [--trials 200] [--repeats 3] [--baseline-trials 20]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from _common import BENCH, emit, function_spec, median

FN_S = 0.05


def overhead_ms(wall: float, n: int, slots: int) -> float:
    return (wall * slots - n * FN_S) / n * 1000.0


def run_hpoflow(n: int, slots: int) -> tuple[float, float]:
    from hpoflow.api import optimize
    from hpoflow.engines.local import LocalEngine

    engine = LocalEngine()
    engine.wait_warm()  # the forkserver's one-time start is reported separately
    with tempfile.TemporaryDirectory() as d:
        spec = function_spec("overhead", "bench_objectives:sleep50", n, slots)
        t0 = time.perf_counter()
        res = optimize(spec, Path(d) / "run", engine=engine)
        wall = time.perf_counter() - t0
    engine.close()
    if res.summary.n_complete != n:
        raise RuntimeError(f"only {res.summary.n_complete} of {n} trials completed")
    return wall, res.summary.driver_overhead_s


def run_fresh_processes(n: int, slots: int) -> float:
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "import torch, hpoflow.train.runner, bench_objectives; time.sleep(0.05)"
    )

    def one(_: int) -> None:
        subprocess.run([sys.executable, "-c", code, str(BENCH)], check=True)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(slots) as pool:
        list(pool.map(one, range(n)))
    return time.perf_counter() - t0


def run_optuna_threads(n: int, slots: int) -> float:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))

    def objective(trial: optuna.Trial) -> float:
        x = trial.suggest_float("x", 0, 1)
        time.sleep(FN_S)
        return x

    t0 = time.perf_counter()
    study.optimize(objective, n_trials=n, n_jobs=slots)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=200)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline-trials", type=int, default=20,
                    help="trials for the fresh-process baseline (it is slow; the figure is per trial)")
    ap.add_argument("--hpoflow-only", action="store_true", help=argparse.SUPPRESS)  # the usage-off child
    a = ap.parse_args()
    if a.hpoflow_only:
        runs = [run_hpoflow(a.trials, a.slots)[0] for _ in range(a.repeats)]
        emit({"hpoflow_ms_per_trial": round(median([overhead_ms(w, a.trials, a.slots) for w in runs]), 2)})
        return

    hp, drv, fresh, thr = [], [], [], []
    for i in range(a.repeats):
        wall, driver_s = run_hpoflow(a.trials, a.slots)
        hp.append(overhead_ms(wall, a.trials, a.slots))
        drv.append(driver_s / a.trials * 1000)
        fresh.append(overhead_ms(run_fresh_processes(a.baseline_trials, a.slots), a.baseline_trials, a.slots))
        thr.append(overhead_ms(run_optuna_threads(a.trials, a.slots), a.trials, a.slots))
        print(f"repeat {i + 1}: hpoflow {hp[-1]:.1f} ms (driver {drv[-1]:.1f} ms), fresh process "
              f"{fresh[-1]:.0f} ms, optuna threads {thr[-1]:.1f} ms per trial and slot", flush=True)
    import json
    import os

    child = subprocess.run([sys.executable, __file__, "--hpoflow-only", "--trials", str(a.trials), "--slots",
                            str(a.slots), "--repeats", str(a.repeats)], capture_output=True, text=True,
                           env={**os.environ, "HPOFLOW_USAGE": "0"}, check=True)
    no_usage = json.loads(child.stdout.strip().splitlines()[-1])["hpoflow_ms_per_trial"]
    figures = {
        "hpoflow_ms_per_trial": round(median(hp), 2),
        "hpoflow_without_usage_sampler_ms_per_trial": no_usage,
        "hpoflow_driver_ms_per_trial": round(median(drv), 2),
        "fresh_process_ms_per_trial": round(median(fresh), 1),
        "optuna_threads_ms_per_trial": round(median(thr), 2),
        "speedup_vs_fresh_process": round(median(fresh) / median(hp), 1),
        "trials": a.trials, "slots": a.slots, "repeats": a.repeats, "target_ms": 5,
    }
    print(f"median overhead per trial and slot: hpoflow {figures['hpoflow_ms_per_trial']} ms, "
          f"fresh process {figures['fresh_process_ms_per_trial']} ms "
          f"({figures['speedup_vs_fresh_process']}x), optuna threads {figures['optuna_threads_ms_per_trial']} ms "
          f"(no isolation, no DDP); target <= 5 ms; without the usage sampler {no_usage} ms")
    emit(figures)


if __name__ == "__main__":
    main()
