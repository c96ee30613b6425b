"""The slurm engine's steps mode against its node agents and the local engine, on this machine: a real
SLURM cluster of 2 nodes (slurmctld on a bridge, one slurmd per network namespace: tests/infra/slurm.py),
each with this machine's 2 cores, so 2 trial slots of 1 core, as the local engine has.

In one run, alternating, medians over ``--repeats``, the same study of N trials of a 50 ms function
(``bench_objectives:sleep50``) on 2 slots, launched with ``hpoflow launch --engine slurm --nodes 2``:

- **steps**: each trial a ``srun --exact`` job step (``engine_options.agents: off``);
- **agents**: one ``srun`` step of node agents over the allocation, trials sent to them over TCP
  (``engine_options.agents: on``);
- **local**: the local engine's warm workers (forkserver started first, as in bench/trial_overhead.py).

Figures per mode: submit-to-first-step (``hpoflow launch``, i.e. sbatch, to the first trial's function
start: the first trial's ``started_at``); per trial, submit to its function's start once the engine
is up (median ``launch_s`` of the trials after the first round of ``slots``); overhead per trial and
slot from the first trial's start to the last one's end: (span x slots - N x 50 ms) / N, and from the
driver's start to its end as the driver counts it; for agents, their one-time start (from their
step's start to every agent connected, and to every agent's forkserver warm: ``agents/agents.json``),
and the overhead of the trials that started once every agent was warm (before that, the agents'
forkservers import torch beside the first trials; on this machine both "nodes" share its 2 cores);
and the job steps each study made (slurmd's ``launch task StepId=J.S`` lines: what ``sacct`` counts).

Needs root, slurm-wlm and munge (as tests/infra does); prints why and exits 2 otherwise.

    python bench/slurm_steps.py [--trials 40] [--repeats 3] [--profile plain|site] [--no-torch-preload]

``--no-torch-preload`` (the smoke test): the local engine's forkserver imports nothing before it forks
its workers, instead of torch and the trainer; its trials only sleep, so what they run is the same, and
its one-time start (before the study, outside every figure) costs ~2 CPU-s less. The agents' forkservers
are the engine's own either way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from _common import BENCH, emit, function_spec, median

ROOT = BENCH.parent
FN_S = 0.05
sys.path.insert(0, str(ROOT))

from tests.infra.slurm import SlurmCluster, unavailable_reason  # noqa: E402  (the test cluster, as the tests)


def overhead_ms(wall: float, n: int, slots: int) -> float:
    return (wall * slots - n * FN_S) / n * 1000.0


def run_local(n: int, slots: int, preload: list[str] | None = None) -> float:
    from hpoflow.api import optimize
    from hpoflow.engines.local import LocalEngine

    engine = LocalEngine(cores=list(range(slots)), preload=preload)
    engine.wait_warm()
    with tempfile.TemporaryDirectory() as d:
        res = optimize(function_spec("local", "bench_objectives:sleep50", n, slots), Path(d) / "run", engine=engine)
    engine.close()
    if res.summary.n_complete != n:
        raise RuntimeError(f"local: only {res.summary.n_complete} of {n} trials completed")
    return res.summary.elapsed_s


@dataclass
class SlurmRun:
    submit_to_first_s: float  # sbatch -> the first trial's function starts
    launch_s: float  # median, per trial after the first round: the engine's submit -> its function starts
    span_overhead_ms: float  # (first start -> last end) x slots - N x 50 ms, per trial
    elapsed_overhead_ms: float  # the same from the driver's own elapsed time
    steps: int  # job steps the study made
    agents_connected_s: float | None = None  # agents: their step's start -> every agent connected
    agents_warm_s: float | None = None  # ... -> every agent's forkserver warm
    warm_overhead_ms: float | None = None  # span_overhead_ms of the trials that started once the agents were warm


def _steps_of(cluster: SlurmCluster, job: str) -> int:
    found: set[str] = set()
    for log in cluster.log_dir.glob("slurmd-*.log"):
        found.update(re.findall(rf"launch task StepId={job}\.(\d+) ", log.read_text()))
    return len(found)


def run_slurm(cluster: SlurmCluster, shared: Path, name: str, n: int, slots: int, agents: str) -> SlurmRun:
    """One study launched on the cluster with ``engine_options.agents: agents``."""
    spec: dict[str, Any] = function_spec(name, "bench_objectives:sleep50", n, slots)
    spec["engine"] = "slurm"
    spec["engine_options"] = {"agents": agents}
    path = shared / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    run_dir = shared / f"run-{name}"
    t_submit = time.time()
    out = cluster.run([sys.executable, "-m", "hpoflow", "launch", str(path), "--engine", "slurm", "--nodes", "2",
                       "--time", "30", "--run-dir", str(run_dir)],
                      env={"PYTHONPATH": f"{ROOT}:{BENCH}"}, cwd=BENCH).stdout
    job = re.search(r"submitted job (\d+)", out)
    if job is None:
        raise RuntimeError(out)
    end = time.monotonic() + 1200
    while cluster.run(["squeue", "-h", "-j", job.group(1), "-o", "%i"], check=False).stdout.strip():
        if time.monotonic() > end:
            raise RuntimeError(f"job {job.group(1)} did not end")
        time.sleep(0.2)
    log = (run_dir / "launch" / f"slurm-{job.group(1)}.out").read_text()
    results = [json.loads(p.read_text()) for p in (run_dir / "trials").glob("*/result.json")]
    done = re.search(r"finished (\d+) complete, .*? in ([\d.]+) s", log)
    if done is None or int(done.group(1)) != n:
        raise RuntimeError(f"{name}: the driver did not finish {n} trials:\n{log}")
    timings = sorted((r["timings"] for r in results), key=lambda t: t["started_at"])
    first = timings[0]["started_at"]
    last = max(t["started_at"] + t["duration_s"] for t in timings)
    agents_json = run_dir / "agents" / "agents.json"
    record = json.loads(agents_json.read_text()) if agents_json.exists() else {}
    started = record.get("step_started")
    warm = [t for t in timings if "warm" in record and t["started_at"] >= record["warm"]]
    warm_overhead = None
    if len(warm) >= 4 * slots:  # enough of them for a figure
        span = max(t["started_at"] + t["duration_s"] for t in warm) - warm[0]["started_at"]
        warm_overhead = overhead_ms(span, len(warm), slots)
    return SlurmRun(first - t_submit, median([t["launch_s"] for t in timings[slots:]]),
                    overhead_ms(last - first, n, slots), overhead_ms(float(done.group(2)), n, slots),
                    _steps_of(cluster, job.group(1)),
                    record["connected"] - started if started and "connected" in record else None,
                    record["warm"] - started if started and "warm" in record else None, warm_overhead)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile", choices=["plain", "site"], default="plain",
                   help="the cluster's profile (tests/infra/slurm.py): plain, or site (CR_Core_Memory, GPUs, fabric)")
    p.add_argument("--no-torch-preload", action="store_true",
                   help="the local engine's forkserver preloads nothing (its trials only sleep): a cheaper start")
    args = p.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"no SLURM cluster here: {reason}", file=sys.stderr)
        return 2
    slots = 2
    cluster = SlurmCluster(2, profile=args.profile)
    cluster.start()
    runs: dict[str, list[SlurmRun]] = {"steps": [], "agents": []}
    local = []
    try:
        for k in range(args.repeats):
            for mode, agents in (("steps", "off"), ("agents", "on")):
                cluster.wait_idle()
                r = run_slurm(cluster, cluster.shared_dir, f"{mode}{k}", args.trials, slots, agents)
                runs[mode].append(r)
                print(f"round {k} {mode}: {r}", file=sys.stderr)
            preload = [] if args.no_torch_preload else None
            local.append(overhead_ms(run_local(args.trials, slots, preload), args.trials, slots))
            print(f"round {k} local: {local[-1]:.1f} ms per trial and slot", file=sys.stderr)
    finally:
        cluster.stop()

    def med(mode: str, field: str) -> float:
        values = [getattr(r, field) for r in runs[mode] if getattr(r, field) is not None]
        return round(median(values), 3) if values else float("nan")

    out: dict[str, Any] = {"bench": "slurm_steps", "profile": args.profile, "trials": args.trials, "slots": slots}
    for mode in runs:
        out[mode] = {"submit_to_first_step_s": med(mode, "submit_to_first_s"),
                     "launch_s_once_up": med(mode, "launch_s"),
                     "overhead_ms_per_trial_slot": med(mode, "span_overhead_ms"),
                     "overhead_ms_per_trial_slot_driver_elapsed": med(mode, "elapsed_overhead_ms"),
                     "job_steps": med(mode, "steps")}
    out["agents"].update(one_time_connected_s=med("agents", "agents_connected_s"),
                         one_time_warm_s=med("agents", "agents_warm_s"),
                         overhead_ms_per_trial_slot_once_warm=med("agents", "warm_overhead_ms"))
    out["local_overhead_ms_per_trial_slot"] = round(median(local), 1)
    out["steps_vs_agents_overhead"] = round(out["steps"]["overhead_ms_per_trial_slot"]
                                            / out["agents"]["overhead_ms_per_trial_slot"], 1)
    emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
