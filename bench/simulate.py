"""The driver at cluster scale, on the simulated engine (virtual clock; nothing trains).

1. Scale: 10,000 log-normal trials (median 600 s, sigma 1) on 4,096 simulated slots with the random
   sampler and the default journal storage: wall time, and driver time per trial.
2. Sampler time per trial at 64, 512 and 4,096 concurrent trials (4 x concurrency trials, at most
   --sampler-trials) for random and TPE (Optuna's constant liar), and GP at 64 only (its fit grows
   cubically with the trials): the driver's own time per trial, the sampler included.
3. Replay: a real 2-slot study on the local engine (trials that sleep log-normal durations), then the
   same number of trials replaying its measured durations on 2 simulated slots: the two makespans.

    python bench/simulate.py [--trials 10000 --slots 4096] [--sampler-trials 2048] [--quick]

``--quick`` (the smoke test): 200 trials on 128 slots, random and TPE at 64 concurrent trials (128
trials each; no GP), a replay of 6 trials on an engine whose forkserver preloads nothing (the trials
only sleep): every part once, at sizes whose figures are not the study's.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BENCH, emit


def spec(n: int, slots: int, algorithm: str, **extra: Any) -> dict[str, Any]:
    return {"study": {"name": "sim", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}, "y": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": algorithm, "n_trials": n, "max_concurrent": slots, "seed": 0},
            "training": {"model": "cnn", "epochs": 10}, "oracle": {"enabled": False}, **extra}


def simulate(n: int, slots: int, algorithm: str, engine_options: dict[str, Any]) -> dict[str, float]:
    from hpoflow.api import optimize
    from hpoflow.engines.simulated.engine import SimulatedEngine
    from hpoflow.engines.simulated.options import SimulatedOptions

    eng = SimulatedEngine(SimulatedOptions.model_validate({"slots": slots, **engine_options}))
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        res = optimize(spec(n, slots, algorithm), Path(d) / "run", engine=eng)
        wall = time.perf_counter() - t0
    return {"wall_s": round(wall, 2), "driver_ms_per_trial": round(res.summary.driver_overhead_s / n * 1000, 2),
            "complete": res.summary.n_complete, **{k: round(v, 4) for k, v in eng.stats().items()}}


def replay_check(n: int, preload: list[str] | None = None) -> dict[str, float]:
    """A real 2-slot study, then its measured durations replayed on 2 simulated slots; ``preload``: what
    the engine's forkserver imports (None: the engine's default, torch)."""
    from hpoflow.api import optimize
    from hpoflow.engines.local import LocalEngine

    rng = random.Random(0)
    durations = [min(1.5, 0.2 * math.exp(0.8 * rng.gauss(0, 1))) for _ in range(n)]
    real_spec = {"study": {"name": "real", "metric": "value", "direction": "minimize"},
                 "space": {"i": {"type": "int", "low": 0, "high": n - 1}},
                 "search": {"algorithm": "grid", "n_trials": n, "max_concurrent": 2},
                 "training": {"function": "bench_objectives:sleep_indexed", "options": {"durations": durations}},
                 "resources": {"processes": 1, "cpus_per_process": 1}}
    with tempfile.TemporaryDirectory() as d:
        engine = LocalEngine(cores=[0, 1], preload=preload)
        engine.wait_warm()
        optimize(real_spec, Path(d) / "real", engine=engine)
        engine.close()
        results = [json.loads(p.read_text()) for p in (Path(d) / "real").glob("trials/*/result.json")]
        submits = [r["timings"]["started_at"] - r["timings"]["launch_s"] for r in results]
        ends = [s + r["timings"]["duration_s"] for s, r in zip(submits, results, strict=True)]
        real = max(ends) - min(submits)
        sim = simulate(n, 2, "random", {"replay": str(Path(d) / "real")})
    return {"trials": n, "real_makespan_s": round(real, 3), "replayed_makespan_s": round(sim["makespan_s"], 3),
            "ratio": round(sim["makespan_s"] / real, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=10000)
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--sampler-trials", type=int, default=2048, help="cap on trials per sampler measurement")
    ap.add_argument("--replay-trials", type=int, default=24)
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    a = ap.parse_args()
    if a.quick:
        a.trials, a.slots, a.sampler_trials, a.replay_trials = 200, 128, 128, 6
    lognormal = {"lognormal": {"median_s": 600.0, "sigma": 1.0, "seed": 0}}
    figures: dict[str, Any] = {}
    scale = simulate(a.trials, a.slots, "random", lognormal)
    figures["scale"] = {"trials": a.trials, "slots": a.slots, **scale}
    print(f"scale: {a.trials} trials on {a.slots} slots in {scale['wall_s']} s wall, driver "
          f"{scale['driver_ms_per_trial']} ms per trial; virtual makespan {scale['makespan_s'] / 3600:.1f} h, "
          f"busy {scale['busy']:.3f}", flush=True)
    samplers: dict[str, dict[str, float]] = {}
    for algorithm, sizes in (("random", (64, 512, 4096)), ("tpe", (64, 512, 4096)), ("gp", (64,))):
        for conc in sizes:
            if a.quick and (conc > 128 or algorithm == "gp"):
                continue
            n = min(4 * conc, a.sampler_trials) if algorithm != "gp" else min(4 * conc, 256, a.sampler_trials // 4)
            r = simulate(n, conc, algorithm, lognormal)
            samplers[f"{algorithm}@{conc}"] = {"trials": n, "driver_ms_per_trial": r["driver_ms_per_trial"]}
            print(f"{algorithm} at {conc} concurrent ({n} trials): {r['driver_ms_per_trial']} ms per trial", flush=True)
    figures["sampler_ms_per_trial"] = samplers
    # quick: the trials only sleep, so the engine's forkserver preloads nothing instead of torch (~2 CPU-s)
    rep = replay_check(a.replay_trials, preload=[] if a.quick else None)
    figures["replay"] = rep
    print(f"replay: real 2-slot makespan {rep['real_makespan_s']} s, replayed {rep['replayed_makespan_s']} s "
          f"(ratio {rep['ratio']}; target within 5 %)", flush=True)
    emit(figures)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(BENCH))
    main()
