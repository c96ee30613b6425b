"""The driver's own CPU per trial with many trials in flight, for every search arm.

A study of ``--trials`` trials (default 10,000) on the simulated engine with ``W`` slots and
``search.max_concurrent: W`` for each ``W`` of ``--workers`` (default 1, 32, 256, 1,024). Trials are
YAHPO Gym's LCBench surrogate (``hpoflow.engines.simulated.yahpo``, task 167168: 52 epochs, each trial
reports 51 of them, then completes), or with ``--cost lognormal`` synthetic ones (20 epochs, median
60 s). The clock is virtual, so a trial costs only what the process spends on it.

Arms (``--arms``): ``ALG`` or ``ALG+X``; ALG is ``random``, ``tpe``, ``tpe_nl`` (TPE with
``constant_liar: false``), ``gp`` or ``bohb``; X is a stopping pruner (``median``: startup 5, ``asha``,
``hyperband``) or a scheduler that pauses and resumes trials (``promo``: promotion ASHA, eta 3; ``hb``:
promotion Hyperband; ``pbt``: population ``--population`` (default: the workers, at least 8), interval
4). The random arm at the same concurrency is the baseline of every ratio; it is run first when
``--arms`` leaves it out (unless ``--no-baseline``).

Per arm and concurrency, per trial, CPU in ms: ``cpu`` (the process, from the driver's start to its
end; ``kernel``: its system calls), ``engine`` (the simulated engine's calls, its cost model included:
not the driver's), ``cost`` (the cost model alone), ``driver`` = cpu - engine, of which ``optuna`` is
the sampler and pruner (TPE's ask and the history it reads, GP's fit, the median pruner's percentile:
intrinsic to the algorithm) and ``own`` the rest (hpoflow's bookkeeping and the storage's writes); ``late`` is
``driver`` per new trial between the starts of the trials 60 % and 90 % into the study (what a study
that grows pays late), ``early`` the same between 10 % and 40 %, and ``late_reports`` / ``early_reports`` the
reports (epochs) per new trial there (a stopping pruner stops fewer trials late: each report is a write);
``wall`` and ``overhead`` (``DriverSummary.driver_overhead_s``) per trial;
``ratio`` = driver / the random arm's driver. The outputs written after the last trial (trials.csv,
the report) are timed apart (``outputs_s``).

    python bench/driver_concurrency.py [--trials 10000] [--workers 1,32,256,1024] [--arms random,tpe+median]
    python bench/driver_concurrency.py --trials 500 --workers 32 --arms random+promo   # a quick look
    python bench/driver_concurrency.py --trials 2000 --workers 1024 --arms random+pbt --profile /tmp/pbt.prof
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from _common import emit

PRUNERS: dict[str, dict[str, Any]] = {"median": {"type": "median", "startup_trials": 5}, "asha": {"type": "asha"},
           "hyperband": {"type": "hyperband"}}
SCHEDULERS: dict[str, dict[str, Any]] = {"promo": {"type": "asha", "reduction_factor": 3}, "hb": {"type": "hyperband"},
              "pbt": {"type": "pbt", "interval": 4}}
ALGORITHMS = ("random", "tpe", "tpe_nl", "gp", "bohb")
DEFAULT_ARMS = ("random,tpe,tpe_nl,tpe+median,random+asha,random+hyperband,random+promo,random+hb,"
                "random+pbt")


def search_of(arm: str, n_trials: int, workers: int, population: int | None) -> dict[str, Any]:
    """The ``search:`` section of ``arm`` (module docstring)."""
    alg, _, extra = arm.partition("+")
    if alg not in ALGORITHMS or (extra and extra not in PRUNERS and extra not in SCHEDULERS):
        raise SystemExit(f"unknown arm {arm!r}: ALG or ALG+X, ALG one of {', '.join(ALGORITHMS)}, X one of "
                         f"{', '.join([*PRUNERS, *SCHEDULERS])}")
    search: dict[str, Any] = {"algorithm": alg.removesuffix("_nl"), "n_trials": n_trials,
                              "max_concurrent": workers, "seed": 0}
    if alg == "tpe_nl":
        search["sampler_options"] = {"constant_liar": False}
    if extra in PRUNERS:
        search["pruner"] = dict(PRUNERS[extra])
    elif extra in SCHEDULERS:
        search["scheduler"] = dict(SCHEDULERS[extra])
        if extra == "pbt":
            search["scheduler"]["population"] = population or max(8, workers)
    return search


class _Clock:
    """CPU seconds spent inside some calls, counted once where such calls nest."""

    def __init__(self) -> None:
        self.s = 0.0
        self._depth = 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            t0 = time.process_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.s += time.process_time() - t0
                self._depth -= 1
        return timed


@contextlib.contextmanager
def optuna_clock() -> Iterator[_Clock]:
    """Count the CPU of Optuna's samplers and pruners (their classes patched for the block), hpoflow's
    subclasses of Optuna's pruners included (``hpoflow.search.pruners``: same decisions, from an index)."""
    import optuna

    from hpoflow.search import pruners
    from hpoflow.search.bohb import BOHBSampler
    from hpoflow.search.history import ViewedSampler

    clock = _Clock()
    patched: list[tuple[type, str, Any]] = []
    methods = {optuna.samplers.RandomSampler: ("infer_relative_search_space", "sample_relative",
                                               "sample_independent", "before_trial", "after_trial"),
               optuna.samplers.TPESampler: ("infer_relative_search_space", "sample_relative", "sample_independent",
                                            "before_trial", "after_trial"),
               optuna.samplers.GPSampler: ("infer_relative_search_space", "sample_relative", "sample_independent",
                                           "before_trial", "after_trial"),
               ViewedSampler: ("infer_relative_search_space", "sample_relative", "sample_independent",
                               "before_trial", "after_trial"),
               BOHBSampler: ("infer_relative_search_space", "sample_relative", "sample_independent",
                             "before_trial", "after_trial"),
               optuna.pruners.MedianPruner: ("prune",), optuna.pruners.PercentilePruner: ("prune",),
               optuna.pruners.SuccessiveHalvingPruner: ("prune",), optuna.pruners.HyperbandPruner: ("prune",),
               pruners.IndexedPercentilePruner: ("prune", "observe"),
               pruners.IndexedSuccessiveHalvingPruner: ("prune", "observe"),
               pruners.IndexedHyperbandPruner: ("prune", "observe")}
    for cls, names in methods.items():
        for name in names:
            if name in cls.__dict__:
                patched.append((cls, name, cls.__dict__[name]))
                setattr(cls, name, clock.wrap(cls.__dict__[name]))
    try:
        yield clock
    finally:
        for cls, name, fn in reversed(patched):
            setattr(cls, name, fn)


def _engine(spec: dict[str, Any], engine_clock: _Clock, cost_clock: _Clock) -> Any:
    """The spec's simulated engine, its calls and its cost model timed."""
    from hpoflow.engines.simulated.engine import SimulatedEngine
    from hpoflow.engines.simulated.options import SimulatedOptions
    from hpoflow.registry import COST_MODELS

    options = SimulatedOptions.model_validate(spec["engine_options"])
    name, values = options.cost_model()
    cost = cost_clock.wrap(COST_MODELS.get(name)(COST_MODELS.options(name, values)))

    class Timed(SimulatedEngine):
        pass

    for method in ("submit", "poll", "answer", "cancel", "pause"):
        setattr(Timed, method, engine_clock.wrap(getattr(SimulatedEngine, method)))
    return Timed(options, cost=cost)


class _Marks:
    """A driver listener: process and engine CPU at the start, at each new trial's start and at the end."""

    def __init__(self, engine_clock: _Clock) -> None:
        self.engine = engine_clock
        self.start: tuple[float, float] = (0.0, 0.0)
        self.starts: list[tuple[float, float, int]] = []  # (CPU, engine CPU, reports so far) at each new trial
        self.reports = 0
        self.finish: tuple[float, float] = (0.0, 0.0)
        self.kernel = 0.0  # of the process CPU, the kernel's (system calls: the storage's file locks and appends)

    def _now(self) -> tuple[float, float]:
        return time.process_time(), self.engine.s

    def on_start(self, n_total: int, n_done: int) -> None:
        self.start = self._now()
        self.kernel = -os.times().system

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        self.starts.append((*self._now(), self.reports))  # (a promotion or a retry is no new trial: not called)

    def on_trial_report(self, number: int, step: int, metrics: dict[str, float]) -> None:
        self.reports += 1

    def on_trial_end(self, result: Any, params: dict[str, Any], best: float | None) -> None:
        pass

    def window(self, lo_frac: float, hi_frac: float) -> tuple[float, float]:
        """Driver CPU seconds, and reports, per new trial between the starts of the trials ``lo_frac`` and
        ``hi_frac`` into the study."""
        n = len(self.starts)
        lo, hi = int(n * lo_frac), int(n * hi_frac)
        if hi <= lo:
            return 0.0, 0.0
        (c0, e0, r0), (c1, e1, r1) = self.starts[lo], self.starts[hi]
        return ((c1 - c0) - (e1 - e0)) / (hi - lo), (r1 - r0) / (hi - lo)

    def on_finish(self, summary: Any) -> None:
        self.finish = self._now()
        self.kernel += os.times().system


def run_arm(arm: str, n_trials: int, workers: int, *, cost: str, population: int | None,
            profile: str | None) -> dict[str, Any]:
    """One study of ``arm``; its figures (module docstring)."""
    from hpoflow.api import optimize
    from hpoflow.engines.simulated.yahpo import yahpo_spec

    spec = yahpo_spec("167168", search=search_of(arm, n_trials, workers, population), slots=workers,
                      name=f"dc-{arm.replace('+', '-')}-{workers}")
    if cost == "lognormal":
        spec["engine_options"] = {"slots": workers, "lognormal": {"median_s": 60}, "epochs": 20}
        spec["training"]["epochs"] = 20
    engine_clock, cost_clock = _Clock(), _Clock()
    eng = _engine(spec, engine_clock, cost_clock)
    marks = _Marks(engine_clock)
    prof = cProfile.Profile() if profile else None
    with tempfile.TemporaryDirectory() as d, optuna_clock() as oc:
        t0 = time.monotonic()
        if prof is not None:
            prof.enable()
        try:
            res = optimize(spec, Path(d) / "run", engine=eng, listener=marks, handle_signals=False)  # type: ignore[arg-type]
        finally:
            if prof is not None:
                prof.disable()
        wall = time.monotonic() - t0
        outputs_s = time.process_time() - marks.finish[0]
    if prof is not None and profile:
        prof.dump_stats(profile)
    s = res.summary
    done = max(1, s.n_complete + s.n_pruned + s.n_failed)
    cpu = marks.finish[0] - marks.start[0]
    engine = marks.finish[1] - marks.start[1]
    per = 1000.0 / done
    late, late_reports = marks.window(0.6, 0.9)
    early, early_reports = marks.window(0.1, 0.4)
    return {"arm": arm, "workers": workers, "trials": done, "complete": s.n_complete, "pruned": s.n_pruned,
            "failed": s.n_failed, "cpu_ms": round(cpu * per, 3), "kernel_ms": round(marks.kernel * per, 3),
            "engine_ms": round(engine * per, 3),
            "cost_ms": round(cost_clock.s * per, 3), "driver_ms": round((cpu - engine) * per, 3),
            "optuna_ms": round(oc.s * per, 3), "own_ms": round((cpu - engine - oc.s) * per, 3),
            "late_ms": round(late * 1000.0, 3), "late_reports": round(late_reports, 1),
            "early_ms": round(early * 1000.0, 3), "early_reports": round(early_reports, 1),
            "wall_ms": round(wall * per, 3),
            "overhead_ms": round(s.driver_overhead_s * per, 3), "outputs_s": round(outputs_s, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated (default {DEFAULT_ARMS}); also gp, tpe+...")
    ap.add_argument("--trials", type=int, default=10_000)
    ap.add_argument("--workers", default="1,32,256,1024", help="concurrencies, comma-separated")
    ap.add_argument("--cost", choices=("yahpo", "lognormal"), default="yahpo")
    ap.add_argument("--population", type=int, default=None, help="pbt's population (default: the workers, >= 8)")
    ap.add_argument("--no-baseline", action="store_true",
                    help="do not add the random arm when --arms leaves it out (no ratios then)")
    ap.add_argument("--profile", default=None,
                    help="cProfile each run into FILE (FILE.ARM.WORKERS when several runs)")
    a = ap.parse_args()
    arms = [x.strip() for x in a.arms.split(",") if x.strip()]
    if "random" not in arms and not a.no_baseline:
        arms.insert(0, "random")  # the baseline of the ratios
    workers = [int(w) for w in a.workers.split(",")]
    several = len(arms) * len(workers) > 1
    rows = []
    for w in workers:
        base: float | None = None
        for arm in arms:
            prof = f"{a.profile}.{arm}.{w}" if a.profile and several else a.profile
            row = run_arm(arm, a.trials, w, cost=a.cost, population=a.population, profile=prof)
            if arm == "random":
                base = row["driver_ms"]
            row["ratio"] = round(row["driver_ms"] / base, 2) if base else None
            rows.append(row)
            print(f"{arm:>18} x{w:<5} driver {row['driver_ms']:7.2f} ms/trial (early {row['early_ms']:.2f} with "
                  f"{row['early_reports']} reports a trial, late {row['late_ms']:.2f} with {row['late_reports']}; "
                  f"optuna {row['optuna_ms']:6.2f}, own {row['own_ms']:6.2f}) ratio {row['ratio']}; "
                  f"cpu {row['cpu_ms']:.2f} (kernel {row['kernel_ms']:.2f}), engine {row['engine_ms']:.2f} "
                  f"(cost {row['cost_ms']:.2f}), wall {row['wall_ms']:.2f}, overhead {row['overhead_ms']:.2f}; "
                  f"{row['complete']} complete, {row['pruned']} pruned, {row['failed']} failed; "
                  f"outputs {row['outputs_s']} s", flush=True)
    emit({"trials": a.trials, "cost": a.cost, "runs": rows})


if __name__ == "__main__":
    main()
