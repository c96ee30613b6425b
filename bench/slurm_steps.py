"""The slurm engine's steps mode against the local engine, on this machine: a real SLURM cluster of
2 nodes (slurmctld on a bridge, one slurmd per network namespace: tests/infra/slurm.py), each with
this machine's 2 cores, so 2 trial slots of 1 core, as the local engine has.

- submit-to-first-step latency: from ``hpoflow launch --engine slurm`` (sbatch of the driver) to the
  moment the first trial's training function starts (its rank's ``started_at``);
- overhead per trial and slot: N trials of a 50 ms function on 2 slots, from the driver's start to
  its end: (elapsed x slots - N x 50 ms) / N; each trial a ``srun --exact`` job step, against the
  local engine's warm workers (forkserver started first, as in bench/trial_overhead.py), in the same
  run, alternating, medians over ``--repeats``.

Needs root, slurm-wlm and munge (as tests/infra does); prints why and exits 2 otherwise.

    python bench/slurm_steps.py [--trials 40] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import yaml
from _common import BENCH, emit, function_spec, median

ROOT = BENCH.parent
FN_S = 0.05
sys.path.insert(0, str(ROOT))

from tests.infra.slurm import SlurmCluster, unavailable_reason  # noqa: E402  (the test cluster, as the tests)


def overhead_ms(wall: float, n: int, slots: int) -> float:
    return (wall * slots - n * FN_S) / n * 1000.0


def run_local(n: int, slots: int) -> float:
    from hpoflow.api import optimize
    from hpoflow.engines.local import LocalEngine

    engine = LocalEngine(cores=list(range(slots)))
    engine.wait_warm()
    with tempfile.TemporaryDirectory() as d:
        res = optimize(function_spec("local", "bench_objectives:sleep50", n, slots), Path(d) / "run", engine=engine)
    engine.close()
    if res.summary.n_complete != n:
        raise RuntimeError(f"local: only {res.summary.n_complete} of {n} trials completed")
    return res.summary.elapsed_s


def run_steps(cluster: SlurmCluster, shared: Path, k: int, n: int, slots: int) -> tuple[float, float]:
    """One study in steps mode: (submit-to-first-step seconds, the driver's elapsed seconds)."""
    spec = function_spec("steps", "bench_objectives:sleep50", n, slots)
    spec["engine"] = "slurm"
    path = shared / f"steps{k}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = shared / f"run{k}"
    t_submit = time.time()
    out = cluster.run([sys.executable, "-m", "hpoflow", "launch", str(path), "--engine", "slurm", "--nodes", "2",
                       "--time", "30", "--run-dir", str(run_dir)],
                      env={"PYTHONPATH": f"{ROOT}:{BENCH}"}, cwd=BENCH).stdout
    job = re.search(r"submitted job (\d+)", out)
    if job is None:
        raise RuntimeError(out)
    end = time.monotonic() + 600
    while cluster.run(["squeue", "-h", "-j", job.group(1), "-o", "%i"], check=False).stdout.strip():
        if time.monotonic() > end:
            raise RuntimeError(f"job {job.group(1)} did not end")
        time.sleep(0.2)
    log = (run_dir / "launch" / f"slurm-{job.group(1)}.out").read_text()
    results = [json.loads(p.read_text()) for p in (run_dir / "trials").glob("*/result.json")]
    done = re.search(r"finished (\d+) complete, .*? in ([\d.]+) s", log)
    if done is None or int(done.group(1)) != n:
        raise RuntimeError(f"steps: the driver did not finish {n} trials:\n{log}")
    first = min(r["timings"]["started_at"] for r in results)
    return first - t_submit, float(done.group(2))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"no SLURM cluster here: {reason}", file=sys.stderr)
        return 2
    slots = 2
    cluster = SlurmCluster(2)
    cluster.start()
    try:
        shared = cluster.shared_dir
        latency, steps, local = [], [], []
        for k in range(args.repeats):
            lat, elapsed = run_steps(cluster, shared, k, args.trials, slots)
            latency.append(lat)
            steps.append(overhead_ms(elapsed, args.trials, slots))
            local.append(overhead_ms(run_local(args.trials, slots), args.trials, slots))
            print(f"round {k}: submit-to-first-step {lat:.2f} s; overhead per trial and slot: steps "
                  f"{steps[-1]:.1f} ms, local {local[-1]:.1f} ms", file=sys.stderr)
    finally:
        cluster.stop()
    emit({"bench": "slurm_steps", "trials": args.trials, "slots": slots,
          "submit_to_first_step_s": round(median(latency), 3),
          "steps_overhead_ms_per_trial_slot": round(median(steps), 1),
          "local_overhead_ms_per_trial_slot": round(median(local), 1),
          "steps_vs_local": round(median(steps) / median(local), 1)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
