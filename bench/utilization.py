"""Slot utilization: 60 trials with log-normal durations (median 0.5 s, sigma 1) on 2 slots.

hpoflow: the real driver (``optimize``: journal storage, grid over a parameter ``i`` so trial ``i``
sleeps ``durations[i]``) on a warm ``LocalEngine``; the driver starts a trial as soon as a slot
frees. Baseline, through the same engine in the same run: synchronous batches of ``slots`` trials
(submit a batch, wait for all of it, submit the next), as batch-style PyCOMPSs HPO does with
``compss_wait_on`` per generation.

busy = sum of the trials' time in the training function (``run_s``) / (slots x makespan), makespan
from the first submit to the last result. With a fixed number of trials, no scheduler avoids the
tail where one slot idles while the last trial runs: ``ideal_async_busy`` and ``ideal_batch_busy``
are the same figure for a zero-overhead scheduler on the same durations in the same order.

    python bench/utilization.py [--trials 60] [--slots 2] [--repeats 3] [--seed 0] [--no-torch-preload]

``--no-torch-preload`` (the smoke test): the engine's forkserver imports nothing before it forks the
workers, instead of torch and the trainer; the trials only sleep, so what they run is the same, and the
one-time start (not part of any makespan) costs ~2 CPU-s less.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import BENCH, emit, median

from hpoflow.trial import TrialResult

TARGET = 0.97


def draw_durations(n: int, seed: int, median_s: float = 0.5, sigma: float = 1.0) -> list[float]:
    rng = np.random.default_rng(seed)
    return [round(float(d), 4) for d in rng.lognormal(math.log(median_s), sigma, n)]


def ideal_busy(durations: list[float], slots: int, batch: bool) -> float:
    """Busy fraction of a zero-overhead scheduler starting trials in the given order."""
    if batch:
        makespan = sum(max(durations[i : i + slots]) for i in range(0, len(durations), slots))
    else:
        free = [0.0] * slots
        for d in durations:
            k = free.index(min(free))
            free[k] += d
        makespan = max(free)
    return sum(durations) / (slots * makespan)


class _Clock:
    """A driver listener that keeps when the first trial started and the last one ended."""

    def __init__(self) -> None:
        self.first_start: float | None = None
        self.last_end = 0.0
        self.run_s = 0.0
        self.engine_s: list[float] = []  # per trial: engine time outside the function (duration_s - run_s)

    def on_start(self, n_total: int, n_done: int) -> None:
        pass

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        if self.first_start is None:
            self.first_start = time.monotonic()

    def on_trial_end(self, result: TrialResult, params: dict[str, Any], best: float | None) -> None:
        self.last_end = time.monotonic()
        self.run_s += result.timings.get("run_s", 0.0)
        self.engine_s.append(result.timings["duration_s"] - result.timings.get("run_s", 0.0))

    def on_finish(self, summary: Any) -> None:
        pass


def run_hpoflow(engine: Any, durations: list[float], slots: int) -> tuple[float, float, float]:
    """(busy, makespan, median ms per trial the engine spends outside the function) of the driver."""
    from hpoflow.api import optimize

    n = len(durations)
    spec = {
        "study": {"name": "utilization", "metric": "value", "direction": "minimize"},
        "space": {"i": {"type": "int", "low": 0, "high": n - 1}},
        "search": {"algorithm": "grid", "max_concurrent": slots, "seed": 0},
        "training": {"function": "bench_objectives:sleep_indexed", "options": {"durations": durations}},
        "resources": {"processes": 1, "cpus_per_process": 1},
    }
    clock = _Clock()
    with tempfile.TemporaryDirectory() as d:
        res = optimize(spec, Path(d) / "run", engine=engine, listener=clock, handle_signals=False)
    if res.summary.n_complete != n or clock.first_start is None:
        raise RuntimeError(f"only {res.summary.n_complete} of {n} trials completed")
    makespan = clock.last_end - clock.first_start
    return clock.run_s / (slots * makespan), makespan, median(clock.engine_s) * 1000


def run_batches(engine: Any, durations: list[float], slots: int) -> tuple[float, float]:
    """(busy, makespan) of synchronous batches of ``slots`` trials through the same engine."""
    from hpoflow.spec import TrainConfig
    from hpoflow.trial import TrialRequest

    train = TrainConfig(function="bench_objectives:sleep_indexed",
                        options={"durations": durations}).model_dump(mode="json")
    run_s = 0.0
    with tempfile.TemporaryDirectory() as d:
        t0 = time.monotonic()
        for start in range(0, len(durations), slots):
            batch = range(start, min(start + slots, len(durations)))
            for i in batch:
                engine.submit(TrialRequest(number=i, params={"i": i}, train=train, metric="value",
                                           direction="minimize", trial_dir=str(Path(d) / str(i)),
                                           python_path=(str(BENCH),)))
            pending = set(batch)
            while pending:
                for ev in engine.poll(None):
                    if isinstance(ev, TrialResult):
                        if ev.status != "complete":
                            raise RuntimeError(f"trial {ev.number} {ev.status}: {ev.error}\n{ev.stderr_tail}")
                        run_s += ev.timings.get("run_s", 0.0)
                        pending.discard(ev.number)
        makespan = time.monotonic() - t0
    return run_s / (slots * makespan), makespan


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=60)
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0, help="seed of the durations (fixed before any run)")
    ap.add_argument("--median-s", type=float, default=0.5, help="median trial duration")
    ap.add_argument("--no-torch-preload", action="store_true",
                    help="the engine's forkserver preloads nothing (the trials only sleep): a cheaper start")
    a = ap.parse_args()

    from hpoflow.engines.local import LocalEngine
    from hpoflow.engines.machine import machine_cores

    cores = machine_cores()
    if len(cores) < a.slots:
        raise SystemExit(f"--slots {a.slots} needs as many cores, but this process may use {cores}")
    durations = draw_durations(a.trials, a.seed, a.median_s)
    ideal_async = ideal_busy(durations, a.slots, batch=False)
    ideal_batch = ideal_busy(durations, a.slots, batch=True)
    print(f"{a.trials} durations: sum {sum(durations):.1f} s, median {median(durations):.2f} s, "
          f"max {max(durations):.2f} s; zero-overhead busy: async {ideal_async:.3f}, batches {ideal_batch:.3f}",
          flush=True)
    engine = LocalEngine(cores=cores[: a.slots], preload=[] if a.no_torch_preload else None)
    engine.wait_warm()  # one-time start, not part of any makespan
    hp, bt, eng = [], [], []
    try:
        for r in range(a.repeats):
            # Alternate the order so drift in the machine's load does not favour either side.
            order = ("hpoflow", "batch") if r % 2 == 0 else ("batch", "hpoflow")
            for which in order:
                if which == "hpoflow":
                    busy, span, engine_ms = run_hpoflow(engine, durations, a.slots)
                    hp.append(busy)
                    eng.append(engine_ms)
                else:
                    busy, span = run_batches(engine, durations, a.slots)
                    bt.append(busy)
                lost = (a.slots * span - busy * a.slots * span) / a.trials * 1000
                print(f"repeat {r + 1} {which}: busy {busy:.3f}, makespan {span:.2f} s, idle slot-time "
                      f"{lost:.0f} ms per trial", flush=True)
    finally:
        engine.close()
    figures = {
        "hpoflow_busy": round(median(hp), 4),
        "batch_busy": round(median(bt), 4),
        "ideal_async_busy": round(ideal_async, 4),
        "ideal_batch_busy": round(ideal_batch, 4),
        "hpoflow_vs_ideal": round(median(hp) / ideal_async, 4),
        "speedup_vs_batch": round(median(hp) / median(bt), 3),
        "hpoflow_engine_ms_per_trial": round(median(eng), 1),
        "trials": a.trials, "slots": a.slots, "repeats": a.repeats, "seed": a.seed, "target": TARGET,
    }
    print(f"median busy fraction: hpoflow {figures['hpoflow_busy']:.3f} (zero-overhead async "
          f"{ideal_async:.3f}), synchronous batches {figures['batch_busy']:.3f} (zero-overhead {ideal_batch:.3f}); "
          f"{figures['speedup_vs_batch']}x; target >= {TARGET}")
    emit(figures)


if __name__ == "__main__":
    main()
