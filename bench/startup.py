"""Cold start: how long a person waits for the CLI, and for a study's first trial.

Each figure is the median wall time of a fresh ``hpoflow`` process (nothing warm in between):

- ``hpoflow --help``, ``hpoflow validate examples/digits.yaml``, ``hpoflow status RUN_DIR``;
- ``hpoflow run`` of a study of 2 and of N (default 200) trials of a 50 ms function on 2 slots, and
  the time from the command to the start of its first trial. From the two sizes, wall(n) = fixed +
  n x per-trial / slots gives the run's fixed cost and its cost per trial and slot;
- the same two studies as a plain Optuna script (threads, ``n_jobs=slots``, in-memory storage), and
  as a Ray Tune script where Ray is installed (skipped otherwise), each a fresh process too.

    python bench/startup.py [--repeats 5] [--trials 200] [--slots 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import BENCH, emit, median

ROOT = BENCH.parent
FN_S = 0.05

OPTUNA_SCRIPT = """
import sys, time
import optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)
def objective(trial):
    x = trial.suggest_float("x", 0.0, 1.0)
    time.sleep(0.05)
    return x
study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
study.optimize(objective, n_trials=int(sys.argv[1]), n_jobs=int(sys.argv[2]))
"""

RAY_SCRIPT = """
import sys, time
import ray
from ray import tune
def objective(config):
    time.sleep(0.05)
    return {"value": config["x"]}
ray.init(num_cpus=int(sys.argv[2]), include_dashboard=False, log_to_driver=False)
tune.Tuner(objective, param_space={"x": tune.uniform(0.0, 1.0)},
           tune_config=tune.TuneConfig(num_samples=int(sys.argv[1]), metric="value", mode="min")).fit()
"""


def _env() -> dict[str, str]:
    # the trial function lives in bench/; hpoflow itself from this checkout
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), str(ROOT), os.environ.get("PYTHONPATH", "")])}


def timed(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr[-2000:]}")
    return wall


def write_spec(d: Path, n: int, slots: int) -> Path:
    spec = {"study": {"name": f"startup{n}", "metric": "value", "direction": "minimize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": slots, "seed": 0},
            "training": {"function": "bench_objectives:sleep50"},
            "resources": {"processes": 1, "cpus_per_process": 1}}
    path = d / f"startup{n}.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def run_study(spec: Path, run_dir: Path) -> tuple[float, float]:
    """(wall time of ``hpoflow run``, seconds from the command to its first trial's start)."""
    hpoflow = [sys.executable, "-m", "hpoflow"]
    t0_wall = time.time()
    wall = timed([*hpoflow, "run", str(spec), "--run-dir", str(run_dir), "--quiet"], spec.parent)
    starts = [json.loads(p.read_text())["timings"]["started_at"] for p in run_dir.glob("trials/*/result.json")]
    return wall, min(starts) - t0_wall


def fit(w_small: float, w_large: float, n_small: int, n_large: int, slots: int) -> tuple[float, float]:
    """wall(n) = fixed + n * per_trial / slots: (fixed s, per-trial-and-slot s) from two sizes."""
    per = (w_large - w_small) * slots / (n_large - n_small)
    return w_small - n_small * per / slots, per


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trials", type=int, default=200, help="trials of the large study")
    ap.add_argument("--slots", type=int, default=2)
    a = ap.parse_args()
    small, large = 2, a.trials
    hpoflow = [sys.executable, "-m", "hpoflow"]
    has_ray = importlib.util.find_spec("ray") is not None
    walls: dict[str, list[float]] = {}

    def add(key: str, value: float) -> None:
        walls.setdefault(key, []).append(value)

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        specs = {n: write_spec(d, n, a.slots) for n in (small, large)}
        status_dir = d / "status_run"
        run_study(specs[small], status_dir)
        for i in range(a.repeats):
            add("help", timed([*hpoflow, "--help"], d))
            add("validate", timed([*hpoflow, "validate", str(ROOT / "examples" / "digits.yaml")], d))
            add("status", timed([*hpoflow, "status", str(status_dir)], d))
            for n in (small, large):
                wall, first = run_study(specs[n], d / f"run{n}_{i}")
                add(f"run_{n}", wall)
                add(f"first_trial_{n}", first)
                add(f"optuna_{n}", timed([sys.executable, "-c", OPTUNA_SCRIPT, str(n), str(a.slots)], d))
                if has_ray:
                    add(f"ray_{n}", timed([sys.executable, "-c", RAY_SCRIPT, str(n), str(a.slots)], d))
            print(f"repeat {i + 1}: help {walls['help'][-1]:.2f} s, validate {walls['validate'][-1]:.2f} s, "
                  f"status {walls['status'][-1]:.2f} s, run {small} trials {walls[f'run_{small}'][-1]:.2f} s "
                  f"(first trial at {walls[f'first_trial_{small}'][-1]:.2f} s), run {large} trials "
                  f"{walls[f'run_{large}'][-1]:.2f} s; optuna threads {walls[f'optuna_{small}'][-1]:.2f} / "
                  f"{walls[f'optuna_{large}'][-1]:.2f} s", flush=True)

    med = {k: round(median(v), 3) for k, v in walls.items()}
    fixed, per = fit(med[f"run_{small}"], med[f"run_{large}"], small, large, a.slots)
    o_fixed, o_per = fit(med[f"optuna_{small}"], med[f"optuna_{large}"], small, large, a.slots)
    figures = {
        "help_s": med["help"], "validate_s": med["validate"], "status_s": med["status"],
        f"run_{small}_trials_s": med[f"run_{small}"], f"run_{large}_trials_s": med[f"run_{large}"],
        "first_trial_start_s": med[f"first_trial_{small}"],
        "run_fixed_s": round(fixed, 3), "run_overhead_ms_per_trial_slot": round((per - FN_S) * 1000, 1),
        f"optuna_threads_{small}_trials_s": med[f"optuna_{small}"],
        f"optuna_threads_{large}_trials_s": med[f"optuna_{large}"],
        "optuna_threads_fixed_s": round(o_fixed, 3),
        "optuna_threads_overhead_ms_per_trial_slot": round((o_per - FN_S) * 1000, 1),
        "ratio_run_2_vs_optuna_2": round(med[f"run_{small}"] / med[f"optuna_{small}"], 2),
        "repeats": a.repeats, "slots": a.slots, "trials": [small, large],
        "targets": {"light_commands_s": 0.3, "run_2_trials_s": 1.5, "first_trial_start_s": 1.0,
                    "overhead_ms_per_trial_slot": 20},
    }
    if has_ray:
        figures[f"ray_tune_{small}_trials_s"] = med[f"ray_{small}"]
        figures[f"ray_tune_{large}_trials_s"] = med[f"ray_{large}"]
    else:
        figures["ray_tune"] = "skipped: ray not installed"
    print(f"median: --help {figures['help_s']} s, validate {figures['validate_s']} s, status {figures['status_s']} s; "
          f"run {small} trials {figures[f'run_{small}_trials_s']} s, first trial starts at "
          f"{figures['first_trial_start_s']} s; fixed cost {figures['run_fixed_s']} s, "
          f"{figures['run_overhead_ms_per_trial_slot']} ms overhead per trial and slot; plain Optuna (threads) "
          f"{figures[f'optuna_threads_{small}_trials_s']} s for {small} trials (fixed "
          f"{figures['optuna_threads_fixed_s']} s)")
    emit(figures)


if __name__ == "__main__":
    main()
