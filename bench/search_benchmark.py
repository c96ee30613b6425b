"""hpoflow's searchers on a published benchmark: YAHPO Gym's LCBench surrogate, the paper's protocol.

Pfisterer et al. (AutoML-Conf 2022), single-objective multi-fidelity suite, LCBench instances 167168,
189873, 189906, target ``val_accuracy``: a budget of ceil(20*52 + sqrt(7)*52*40) = 6,544 epochs per run,
30 repetitions, normalized regret (best - y) / (best - worst) with best and worst over every arm's runs.

Every arm runs the real driver (``hpoflow.search.driver.Driver``: its sampler, pruner or scheduler, its
bookkeeping, an in-memory Optuna storage) on the simulated engine with the ``yahpo`` cost model: each
trial's learning curve and epoch times are the surrogate's (``hpoflow.engines.simulated.yahpo``). The run
stops when the trials have trained ``--budget-epochs`` epochs in all (a paused trial resumed at its rung
trains only the epochs after it). An evaluation is a trial's value where a run of it stopped: complete,
pruned, or paused at a rung (the paper's archive holds the same: each configuration's value at each budget
a method evaluated). The incumbent at a point is the best evaluation so far, in cumulative epochs and in
virtual wall-clock (the surrogate's training time, ``--workers`` trials at once).

Normalization, both printed: ``paper`` (best and worst over every arm's runs of this invocation, per
instance, as the paper) and ``fixed`` (best: the best of a 20,000-configuration random sample at 52 epochs
and of every run; worst: the worst of that sample), which does not move when arms are added.

    python bench/search_benchmark.py --instance 167168 --reps 30 --out runs/yahpo-167168.json
    python bench/search_benchmark.py --instance all --arms random,tpe+median --reps 30
    python bench/search_benchmark.py --instance 167168 --workers 32 --arms random,tpe+hb --reps 10
    python bench/search_benchmark.py --list      # the arms
    python bench/search_benchmark.py --recompute FILE.json   # every regret again, from the surrogate

The JSON (``--out``) holds per arm and repetition every trial's configuration, every epoch it trained
(run, epoch, virtual end time, value), every run's end (status), and the regrets, so every figure can be
recomputed from the surrogate (``--recompute``).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _common import emit

INSTANCES = ("167168", "189873", "189906")
BUDGET = math.ceil(20 * 52 + math.sqrt(7) * 52 * 40)  # 6,544 epochs: the paper's multi-fidelity budget
# The paper's mean normalized regret at the full budget, read from its plot (log scale, about +/-15 %)
PAPER = {"167168": {"Random": 0.12, "HB": 0.085, "DEHB": 0.08, "Optuna": 0.06, "BOHB": 0.04, "SMAC-HB": 0.022,
                    "SMAC": 0.013},
         "189873": {"Random": 0.17, "HB": 0.125, "DEHB": 0.12, "Optuna": 0.055, "BOHB": 0.058, "SMAC-HB": 0.022,
                    "SMAC": 0.026},
         "189906": {"Random": 0.065, "HB": 0.058, "DEHB": 0.05, "Optuna": 0.025, "BOHB": 0.033, "SMAC-HB": 0.011,
                    "SMAC": 0.007}}

_MEDIAN = {"type": "median", "startup_trials": 5}
ARMS: dict[str, dict[str, Any]] = {
    "random": {"algorithm": "random"},
    "tpe": {"algorithm": "tpe"},
    "gp": {"algorithm": "gp"},
    "gp-ts": {"algorithm": "gp", "sampler_options": {"acquisition": "thompson"}},
    # GP per budget (its per_budget option, on by default with a pruner or a scheduler): BOHB's rule with a GP;
    # gp+ with LogEI (Optuna's GPSampler), gp-ts+ with Thompson sampling (acquisition auto's per budget)
    "gp+hyperband": {"algorithm": "gp", "sampler_options": {"acquisition": "ei"}, "pruner": {"type": "hyperband"}},
    "gp+asha": {"algorithm": "gp", "sampler_options": {"acquisition": "ei"}, "pruner": {"type": "asha"}},
    "gp-ts+hyperband": {"algorithm": "gp", "sampler_options": {"acquisition": "thompson"},
                        "pruner": {"type": "hyperband"}},
    "gp-ts+asha": {"algorithm": "gp", "sampler_options": {"acquisition": "thompson"}, "pruner": {"type": "asha"}},
    # the same, its first rung at a third of the epochs (17 of 52; rungs 17 and 51): LCBench's best configurations
    # of 167168 and 189873 learn slowly and pass the fast starters only near epoch 17 (docs/search.md)
    "gp-ts+asha@17": {"algorithm": "gp", "sampler_options": {"acquisition": "thompson"},
                      "pruner": {"type": "asha", "min_resource": 17}},
    # with a pruner or a scheduler, TPE is fitted per budget (its per_budget option, on by default there)
    "tpe+median": {"algorithm": "tpe", "sampler_options": {"n_startup_trials": 5}, "pruner": _MEDIAN},
    # the paper's Optuna arm as YAHPO Gym's own code runs it: Optuna's TPESampler(n_startup_trials=5) (then
    # univariate) and MedianPruner(n_startup_trials=5, n_warmup_steps=0), evaluated at Hyperband's budgets
    # 2, 6, 17, 52, each evaluation a run from scratch (its epochs charged again)
    "optuna-paper": {"algorithm": "tpe", "sampler_options": {"n_startup_trials": 5, "multivariate": False,
                                                             "per_budget": False},
                     "pruner": {**_MEDIAN, "warmup_steps": 0}, "fidelities": [2, 6, 17, 52]},
    "tpe+asha": {"algorithm": "tpe", "pruner": {"type": "asha"}},
    "tpe+hyperband": {"algorithm": "tpe", "pruner": {"type": "hyperband"}},
    "random+promo": {"algorithm": "random", "scheduler": {"type": "asha"}},
    "random+hb": {"algorithm": "random", "scheduler": {"type": "hyperband"}},
    "tpe+promo": {"algorithm": "tpe", "scheduler": {"type": "asha"}},
    "tpe+hb": {"algorithm": "tpe", "scheduler": {"type": "hyperband"}},
    # BOHB's model (hpoflow.search.bohb) with the Hyperband pruner, the ASHA pruner (bohb's default and
    # search.algorithm auto's), or pausing and resuming
    "bohb": {"algorithm": "bohb", "pruner": {"type": "hyperband"}},
    "bohb+hb": {"algorithm": "bohb", "scheduler": {"type": "hyperband"}},
    "bohb+promo": {"algorithm": "bohb", "scheduler": {"type": "asha"}},
    "bohb+asha": {"algorithm": "bohb", "pruner": {"type": "asha"}},
    # TPE as Optuna reads a stopped trial (ranked by the last step it reached, among the bad trials), as
    # search.algorithm: tpe did before its per_budget option: the rows the tpe+ arms above replace
    **{f"tpe-step+{x}": {"algorithm": "tpe", "sampler_options": {"per_budget": False}, **extra}
       for x, extra in (("asha", {"pruner": {"type": "asha"}}), ("hyperband", {"pruner": {"type": "hyperband"}}),
                        ("promo", {"scheduler": {"type": "asha"}}), ("hb", {"scheduler": {"type": "hyperband"}}))},
    "tpe-step+median": {"algorithm": "tpe", "sampler_options": {"n_startup_trials": 5, "per_budget": False},
                        "pruner": _MEDIAN},
    # hpoflow before this benchmark: judged from the first epoch (median warmup 0, ASHA's first rung 1,
    # the promotion rungs 1, 3, 9, 27); LCBench's first epoch says nothing of the last (docs/search.md)
    "tpe+median@1": {"algorithm": "tpe", "sampler_options": {"n_startup_trials": 5, "per_budget": False},
                     "pruner": {**_MEDIAN, "warmup_steps": 0}},
    "tpe+asha@1": {"algorithm": "tpe", "sampler_options": {"per_budget": False},
                   "pruner": {"type": "asha", "min_resource": 1}},
    "random+promo@1": {"algorithm": "random", "scheduler": {"type": "asha", "anchor": "min"}},
}
DEFAULT_ARMS = ("random", "tpe", "tpe+median", "tpe+asha", "tpe+hyperband", "random+promo", "random+hb", "tpe+hb")


@dataclass
class _Trace:
    """What the engine saw of one run: every epoch trained and every run's end (``SimObserver``)."""

    budget: int
    stop: Any = None
    epochs: list[tuple[int, int, float, float]] = field(default_factory=list)  # (trial, epoch, t, value)
    ends: list[tuple[int, str, float, int]] = field(default_factory=list)  # (trial, status, t, epoch)
    metric: str = "val_accuracy"
    fidelities: list[int] | None = None  # an arm evaluated at these epochs, each from scratch
    spent: int = 0

    def epoch_ended(self, number: int, epoch: int, clock: float, metrics: dict[str, float]) -> None:
        self.epochs.append((number, epoch, clock, float(metrics[self.metric])))
        self.spent += _cost(self.fidelities, epoch)
        if self.spent >= self.budget and self.stop is not None:
            stop, self.stop = self.stop, None
            stop("budget")  # the driver cancels what runs: those runs' epochs past the budget never count

    def run_ended(self, number: int, status: str, clock: float, epoch: int) -> None:
        self.ends.append((number, status, clock, epoch))


def run_arm(instance: str, arm: str, rep: int, workers: int, budget: int, data: str | None) -> dict[str, Any]:
    """One repetition of one arm: the driver on the surrogate until ``budget`` epochs are trained."""
    import optuna

    from hpoflow.engines.simulated.engine import SimulatedEngine
    from hpoflow.engines.simulated.options import SimulatedOptions
    from hpoflow.engines.simulated.yahpo import yahpo_spec
    from hpoflow.search.driver import Driver
    from hpoflow.search.samplers import make_pruner, make_sampler
    from hpoflow.spec import StudySpec

    arm_search = dict(ARMS[arm])
    fidelities = arm_search.pop("fidelities", None)
    search = {**arm_search, "seed": rep, "n_trials": budget, "max_concurrent": workers}
    raw = yahpo_spec(instance, data_path=data, search=search, slots=workers, fidelities=fidelities)
    spec = StudySpec.model_validate(raw)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction=spec.study.direction, sampler=make_sampler(spec.search),
                                pruner=make_pruner(spec.search.pruner, spec.training.get("epochs")))
    engine = SimulatedEngine(SimulatedOptions.model_validate(raw["engine_options"]))
    trace = _Trace(budget, fidelities=fidelities)
    engine.observer = trace
    cpu0, wall0 = time.process_time(), time.perf_counter()
    with tempfile.TemporaryDirectory() as d:
        driver = Driver(spec, study, engine, Path(d))
        trace.stop = driver.request_stop
        summary = driver.run()
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    params = {t.number: t.params for t in study.get_trials(deepcopy=False)}
    return {"arm": arm, "rep": rep, "workers": workers, "budget_epochs": budget,
            **({"fidelities": fidelities} if fidelities else {}),
            "trials": {str(n): params[n] for n in sorted({e[0] for e in trace.epochs})},
            "epochs": [list(e) for e in trace.epochs], "ends": [list(e) for e in trace.ends],
            "driver": {"cpu_s": round(cpu, 3), "wall_s": round(wall, 3),
                       "overhead_s": round(summary.driver_overhead_s, 3),
                       "runs": len(trace.ends)}}


def evaluations(run: dict[str, Any]) -> list[tuple[int, float, float]]:
    """(cumulative epochs, virtual time, value) of each evaluation within the budget, in time order: a
    run's value where it stopped (complete, pruned, paused), at the epoch it stopped."""
    budget = int(run["budget_epochs"])
    fidelities = run.get("fidelities")
    epochs, total = [], 0
    for row in run["epochs"]:  # the epochs trained within the budget (an evaluation from scratch costs its epochs)
        total += _cost(fidelities, int(row[1]))
        if total > budget:
            break
        epochs.append(row)
    value = {(int(n), int(e)): (float(t), float(v)) for n, e, t, v in epochs}
    order = sorted(range(len(epochs)), key=lambda i: (epochs[i][2], i))
    cum_at: dict[tuple[int, int], int] = {}
    total = 0
    for i in order:
        total += _cost(fidelities, int(epochs[i][1]))
        cum_at[(int(epochs[i][0]), int(epochs[i][1]))] = total
    out = []
    for n, status, _t, e in run["ends"]:
        key = (int(n), int(e))
        if status in ("complete", "pruned", "paused") and key in value:
            t, v = value[key]
            out.append((cum_at[key], t, v))
    return sorted(out)


def _cost(fidelities: list[int] | None, step: int) -> int:
    """Epochs a trial's report at ``step`` cost: 1, or with ``fidelities`` that fidelity's epochs (a run from
    scratch, as the paper's Optuna arm evaluates)."""
    return int(fidelities[step - 1]) if fidelities else 1


def regret_curve(evals: list[tuple[int, float, float]], best: float, worst: float, budget: int,
                 points: int = 100) -> list[float]:
    """Normalized regret of the incumbent after each 1/``points`` of the budget (1.0 before any evaluation)."""
    out, inc, i = [], -math.inf, 0
    for k in range(1, points + 1):
        upto = budget * k / points
        while i < len(evals) and evals[i][0] <= upto:
            inc = max(inc, evals[i][2])
            i += 1
        out.append(1.0 if inc == -math.inf else (best - inc) / (best - worst))
    return out


def time_to(evals: list[tuple[int, float, float]], target: float) -> float | None:
    """Virtual wall-clock at which the incumbent first reaches ``target`` (None: never)."""
    for _, t, v in sorted(evals, key=lambda x: x[1]):
        if v >= target:
            return t
    return None


@functools.lru_cache(maxsize=4)
def _sample_curves(instance: str, data: str | None, n: int, seed: int) -> tuple[Any, Any]:
    """``n`` random configurations (the space of ``yahpo_spec``, seeded): their validation accuracy and
    cumulative training time after each of the 52 epochs, as two (n, 52) arrays."""
    import numpy as np

    from hpoflow.engines.simulated.yahpo import surrogate, yahpo_spec

    space = yahpo_spec(instance, data_path=data)["space"]
    rng = np.random.default_rng(seed)
    cols = {}
    for k, h in space.items():
        lo, hi = float(h["low"]), float(h["high"])
        x = np.exp(rng.uniform(math.log(lo), math.log(hi), n)) if h.get("log") else rng.uniform(lo, hi, n)
        cols[k] = np.clip(np.round(x), lo, hi).astype(int) if h["type"] == "int" else x
    configs = [{k: (int(v[i]) if space[k]["type"] == "int" else float(v[i])) for k, v in cols.items()}
               for i in range(n)]
    sur = surrogate("lcbench", data)
    acc = np.empty((n, 52), dtype=np.float64)
    spent = np.empty((n, 52), dtype=np.float64)
    for lo in range(0, n, 2_000):  # one batch per 2,000 configurations
        for i, c in enumerate(sur.curves(instance, configs[lo:lo + 2_000], 52), start=lo):
            acc[i] = [row["val_accuracy"] for row in c]
            spent[i] = [row["time"] for row in c]
    return acc, spent


def reference(instance: str, data: str | None, n: int = 20_000, seed: int = 0) -> tuple[float, float]:
    """(best, worst) of ``n`` random configurations at 52 epochs (the space of ``yahpo_spec``, seeded)."""
    acc, _ = _sample_curves(instance, data, n, seed)
    return float(acc[:, -1].max()), float(acc[:, -1].min())


def earliest(instance: str, data: str | None, target: float, n: int = 20_000, seed: int = 0) -> float | None:
    """The earliest virtual time at which any of ``n`` random configurations, trained from the start, reaches
    ``target`` (its own training time: no searcher with any number of workers gets there sooner with one of
    them); None: none does."""
    import numpy as np

    acc, spent = _sample_curves(instance, data, n, seed)
    hit = acc >= target
    first = np.where(hit.any(axis=1), hit.argmax(axis=1), -1)
    times = spent[np.arange(len(first)), first][first >= 0]
    return float(times.min()) if times.size else None


def soonest_search(instance: str, data: str | None, target: float, n: int = 50_000, rounds: int = 25,
                   keep: int = 100, children: int = 30, seed: int = 1) -> dict[str, Any]:
    """How soon any configuration reaches ``target`` (its own training time from its first epoch): the
    soonest of ``n`` random configurations, then a local search on the surrogate (``rounds`` rounds of
    ``children`` Gaussian steps in the unit cube (log scale where the space is) around each of the ``keep``
    soonest so far, the step shrinking by 15 % a round). Not a bound on a searcher (a configuration the
    search missed may be sooner still): it shows how rare the configurations that get there soon are."""
    import numpy as np

    from hpoflow.engines.simulated.yahpo import surrogate, yahpo_spec

    space = yahpo_spec(instance, data_path=data)["space"]
    names = list(space)
    sur = surrogate("lcbench", data)

    def config(u: Any) -> dict[str, Any]:
        c: dict[str, Any] = {}
        for k, x in zip(names, np.clip(u, 0.0, 1.0), strict=True):
            h = space[k]
            lo, hi = float(h["low"]), float(h["high"])
            v = math.exp(math.log(lo) + x * (math.log(hi) - math.log(lo))) if h.get("log") else lo + x * (hi - lo)
            c[k] = int(min(hi, max(lo, round(v)))) if h["type"] == "int" else float(v)
        return c

    def soonest(units: Any) -> Any:
        out = []
        configs = [config(u) for u in units]
        for lo in range(0, len(configs), 2_000):
            for c in sur.curves(instance, configs[lo:lo + 2_000], 52):
                out.append(min((row["time"] for row in c if row["val_accuracy"] >= target), default=math.inf))
        return np.array(out)

    rng = np.random.default_rng(seed)
    units = rng.uniform(0.0, 1.0, (n, len(names)))
    times = soonest(units)
    first = float(times.min())
    order = np.argsort(times)[:keep]
    pool_u, pool_t = units[order], times[order]
    for r in range(rounds):
        kids = np.clip(np.repeat(pool_u, children, axis=0)
                       + rng.normal(0.0, 0.2 * 0.85**r, (len(pool_u) * children, len(names))), 0.0, 1.0)
        all_u, all_t = np.vstack([pool_u, kids]), np.concatenate([pool_t, soonest(kids)])
        order = np.argsort(all_t)[:keep]
        pool_u, pool_t = all_u[order], all_t[order]
    return {"target": target, "random": n, "random_soonest_s": first, "searched_soonest_s": float(pool_t[0]),
            "config": config(pool_u[0])}


def summarize(runs: list[dict[str, Any]], instance: str, data: str | None, budget: int,
              sample: int = 20_000) -> dict[str, Any]:
    """Regrets per arm, both normalizations (``sample``: the fixed reference's random configurations);
    anytime points; time to Random's final regret."""
    evs = {(r["arm"], r["rep"]): evaluations(r) for r in runs}
    values = [v for e in evs.values() for _, _, v in e]
    ref_best, ref_worst = reference(instance, data, sample)
    norms = {"paper": (max(values), min(values)), "fixed": (max(ref_best, max(values)), ref_worst)}
    arms = list(dict.fromkeys(r["arm"] for r in runs))
    out: dict[str, Any] = {"instance": instance, "budget_epochs": budget, "reference_sample": sample,
                           "normalization": {k: {"best": b, "worst": w} for k, (b, w) in norms.items()}, "arms": {}}
    for arm in arms:
        mine = [r for r in runs if r["arm"] == arm]
        row: dict[str, Any] = {"reps": len(mine)}
        for name, (b, w) in norms.items():
            curves = [regret_curve(evs[(arm, r["rep"])], b, w, budget) for r in mine]
            mean = [statistics.fmean(c[k] for c in curves) for k in range(100)]
            row[name] = {"final": mean[-1], "at10": mean[9], "at25": mean[24], "anytime": mean,
                         "per_rep_final": [c[-1] for c in curves]}
        cpu = [r["driver"]["cpu_s"] for r in mine]
        n_runs = [r["driver"]["runs"] for r in mine]
        row["trials"] = statistics.fmean(len(r["trials"]) for r in mine)
        row["driver_cpu_ms_per_run"] = 1000 * sum(cpu) / max(1, sum(n_runs))
        out["arms"][arm] = row
    if "random" in out["arms"]:  # how much sooner (virtual wall-clock) each arm reaches Random's final regret
        b, w = norms["paper"]
        target = b - out["arms"]["random"]["paper"]["final"] * (b - w)
        for arm in arms:
            times = [time_to(evs[(arm, r["rep"])], target) for r in runs if r["arm"] == arm]
            reached = [t for t in times if t is not None]
            out["arms"][arm]["time_to_random_final_s"] = statistics.median(reached) if reached else None
            out["arms"][arm]["reached_random_final"] = f"{len(reached)}/{len(times)}"
        # how soon the soonest of the reference's random configurations gets there on its own (no bound on a
        # searcher: rarer configurations get there sooner, soonest_search)
        out["earliest_random_final_s"] = earliest(instance, data, target, sample)
    return out


def table(summary: dict[str, Any]) -> str:
    inst = summary["instance"]
    lines = [f"instance {inst}, {summary['budget_epochs']} epochs (regret: mean normalized, paper | fixed)",
             f"{'arm':16} {'final':>15} {'at 10%':>15} {'at 25%':>15} {'trials':>7} {'drv ms/run':>10}"]
    for arm, row in summary["arms"].items():
        p, f = row["paper"], row["fixed"]
        lines.append(f"{arm:16} {p['final']:7.3f} {f['final']:7.3f} {p['at10']:7.3f} {f['at10']:7.3f} "
                     f"{p['at25']:7.3f} {f['at25']:7.3f} {row['trials']:7.0f} {row['driver_cpu_ms_per_run']:10.2f}")
    lines.append("paper (read from its plot): " + ", ".join(f"{k} {v}" for k, v in PAPER.get(inst, {}).items()))
    if summary.get("earliest_random_final_s") is not None or "random" in summary["arms"]:
        reach = ", ".join(f"{arm} {row['reached_random_final']} at {row['time_to_random_final_s']:.0f} s"
                          if row.get("time_to_random_final_s") is not None else f"{arm} never"
                          for arm, row in summary["arms"].items() if "reached_random_final" in row)
        soonest = summary.get("earliest_random_final_s")
        lines.append(f"reached Random's final regret (reps, median virtual time): {reach}; the soonest any of "
                     f"{summary['reference_sample']:,} random configurations gets there, trained alone: "
                     + (f"{soonest:.0f} s" if soonest is not None else "never"))
    return "\n".join(lines)


def markdown(summaries: list[dict[str, Any]]) -> str:
    """The arms' mean normalized regret (paper's normalization) at 100 %, 10 % and 25 % of the budget per
    instance, and the paper's rows, as a Markdown table (docs/search.md)."""
    insts = [s["instance"] for s in summaries]
    head = "| arm | " + " | ".join(f"{i} final | 10 % | 25 %" for i in insts) + " | trials |"
    lines = [head, "|---" * (2 + 3 * len(insts)) + "|"]
    arms = list(dict.fromkeys(a for s in summaries for a in s["arms"]))
    for arm in arms:
        cells, trials = [], []
        for s in summaries:
            row = s["arms"].get(arm)
            if row is None:
                cells += ["", "", ""]
                continue
            p = row["paper"]
            cells += [f"{p['final']:.3f}", f"{p['at10']:.3f}", f"{p['at25']:.3f}"]
            trials.append(f"{row['trials']:.0f}")
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {'/'.join(trials)} |")
    for name in PAPER["167168"]:
        cells = []
        for i in insts:
            cells += [f"{PAPER[i][name]}" if i in PAPER else "", "", ""]
        lines.append(f"| paper: {name} | " + " | ".join(cells) + " | |")
    return "\n".join(lines)


def plot(summaries: list[dict[str, Any]], path: Path, arms: list[str] | None = None) -> None:
    """The anytime mean normalized regret (paper's normalization, log scale) of each arm against the share
    of the budget used, one panel per instance, as a PNG (plotly; needs kaleido and a Chrome)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=len(summaries), subplot_titles=[f"LCBench {s['instance']}" for s in summaries])
    colors = ["#386cb0", "#fdb462", "#7fc97f", "#ef3b2c", "#662506", "#a6cee3", "#984ea3", "#1b9e77", "#e7298a",
              "#666666", "#bbbbbb", "#000000"]
    x = [k / 100 for k in range(1, 101)]
    names = arms or list(dict.fromkeys(a for s in summaries for a in s["arms"]))
    for col, s in enumerate(summaries, 1):
        for i, arm in enumerate(names):
            if arm not in s["arms"]:
                continue
            fig.add_trace(go.Scatter(x=x[9:], y=s["arms"][arm]["paper"]["anytime"][9:], mode="lines", name=arm,
                                     line={"color": colors[i % len(colors)], "shape": "hv"}, legendgroup=arm,
                                     showlegend=col == 1), row=1, col=col)
        fig.update_yaxes(type="log", row=1, col=col, title_text="mean normalized regret" if col == 1 else None)
        fig.update_xaxes(title_text="share of the budget (6,544 epochs)", row=1, col=col)
    fig.update_layout(width=420 * len(summaries), height=420, template="plotly_white",
                      legend={"orientation": "h", "y": -0.25})
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_image(str(path))
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instance", default="167168", help=f"an LCBench task id, or 'all' ({', '.join(INSTANCES)})")
    ap.add_argument("--arms", default=",".join(DEFAULT_ARMS))
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--first-rep", type=int, default=0, help="the first repetition's seed (a run of reps 15-29 "
                                                             "merges with one of 0-14: --recompute A.json,B.json)")
    ap.add_argument("--workers", type=int, default=1, help="concurrent trials (1 to 1,024)")
    ap.add_argument("--budget-epochs", type=int, default=BUDGET)
    ap.add_argument("--data", default=None, help="folder holding yahpo-lcbench/ (default: $HPOFLOW_BENCHMARKS or "
                                                   "../shared/benchmarks)")
    ap.add_argument("--reference", type=int, default=None, help="random configurations of the fixed "
                                                               "normalization (best and worst at 52 epochs) and of "
                                                               "the soonest time to Random's final regret (default "
                                                               "20,000; with --recompute, the file's)")
    ap.add_argument("--out", default=None, help="write every run and the summary as JSON")
    ap.add_argument("--recompute", default=None, help="--out file(s), comma-separated: recompute their summaries "
                                                      "from their runs")
    ap.add_argument("--markdown", action="store_true", help="with --recompute: the table of docs/search.md")
    ap.add_argument("--plot", default=None, help="with --recompute: the anytime regret of its arms as a PNG")
    ap.add_argument("--reach", type=float, default=None, metavar="ACCURACY",
                    help="with --recompute: each arm's repetitions that reach this accuracy and their median virtual "
                         "time to it (e.g. Random's final at one worker, to read runs with more workers against it)")
    ap.add_argument("--soonest-search", action="store_true",
                    help="with --recompute: how soon any configuration reaches Random's final regret (50,000 random "
                         "ones, then a local search on the surrogate; a few CPU-minutes an instance)")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=JSON",
                    help='an arm of your own: its search section, e.g. tpe+m2=\'{"algorithm": "tpe", "pruner": '
                         '{"type": "median", "warmup_steps": 1}}\'')
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args(argv)
    for d in a.define:
        name, _, text = d.partition("=")
        try:
            ARMS[name] = json.loads(text)
        except ValueError as exc:
            print(f"--define {d!r}: not NAME=JSON ({exc})", file=sys.stderr)
            return 2
    if a.list:
        for name, s in ARMS.items():
            print(f"{name:16} {json.dumps(s)}")
        return 0
    from hpoflow.engines.simulated.yahpo import benchmarks_dir

    data_dir = Path(a.data) if a.data else benchmarks_dir()
    if not (data_dir / "yahpo-lcbench" / "model.onnx").is_file() and not (data_dir / "model.onnx").is_file():
        print(f"skipped: no YAHPO LCBench surrogate under {data_dir} (give --data or $HPOFLOW_BENCHMARKS)")
        return 0
    data = str(data_dir)
    if a.recompute:
        # runs of one instance from several files are one table (normalized together), in file order;
        # a file's run of an arm and repetition already read from an earlier file is left out (same seed)
        merged: dict[str, dict[str, Any]] = {}
        for name in a.recompute.split(","):
            read = json.loads(Path(name).read_text())
            for inst, block in read["instances"].items():
                budget = int(block["summary"]["budget_epochs"])
                into = merged.setdefault(inst, {"runs": [], "budget": budget, "arms": set(),
                                                "reference": a.reference or int(block["summary"].get(
                                                    "reference_sample", 20_000))})
                if into["budget"] != budget:
                    print(f"--recompute: {name} has instance {inst} at {budget} epochs, an earlier file at "
                          f"{into['budget']}: give files of one budget", file=sys.stderr)
                    return 2
                new = [r for r in block["runs"] if (r["arm"], r["rep"]) not in into["arms"]]
                into["runs"].extend(new)
                into["arms"].update((r["arm"], r["rep"]) for r in new)
            del read
        summaries = []
        for inst, into in merged.items():
            s = summarize(into["runs"], inst, data, into["budget"], into["reference"])
            print(table(s))
            if a.reach is not None:
                parts = []
                for arm in s["arms"]:
                    times = [time_to(evaluations(r), a.reach) for r in into["runs"] if r["arm"] == arm]
                    got = [t for t in times if t is not None]
                    parts.append(f"{arm} {len(got)}/{len(times)}"
                                 + (f" at {statistics.median(got):.0f} s" if got else ""))
                print(f"reached accuracy {a.reach:g} (reps, median virtual time): {', '.join(parts)}")
            if a.soonest_search and "random" in s["arms"]:
                b, w = s["normalization"]["paper"]["best"], s["normalization"]["paper"]["worst"]
                found = soonest_search(inst, data, b - s["arms"]["random"]["paper"]["final"] * (b - w))
                print(f"Random's final regret (accuracy {found['target']:.2f}) is reached soonest in "
                      f"{found['random_soonest_s']:.1f} s by {found['random']:,} random configurations, in "
                      f"{found['searched_soonest_s']:.1f} s after a local search: {json.dumps(found['config'])}")
            summaries.append(s)
        if a.markdown:
            print(markdown(summaries))
        if a.plot:
            plot(summaries, Path(a.plot), [x for x in a.arms.split(",") if x] if a.arms != ",".join(DEFAULT_ARMS)
                 else None)
        return 0
    arms = [x for x in a.arms.split(",") if x]
    unknown = [x for x in arms if x not in ARMS]
    if unknown:
        print(f"unknown arm(s): {', '.join(unknown)}; the arms: {', '.join(ARMS)}", file=sys.stderr)
        return 2
    if not 1 <= a.workers <= 1024:
        print(f"--workers {a.workers}: give 1 to 1,024", file=sys.stderr)
        return 2
    instances = list(INSTANCES) if a.instance == "all" else [a.instance]
    doc: dict[str, Any] = {"protocol": {"budget_epochs": a.budget_epochs, "reps": a.reps, "workers": a.workers,
                                        "arms": {k: ARMS[k] for k in arms}}, "instances": {}}
    figures: dict[str, Any] = {}
    for inst in instances:
        runs = []
        for arm in arms:
            for rep in range(a.first_rep, a.first_rep + a.reps):
                runs.append(run_arm(inst, arm, rep, a.workers, a.budget_epochs, data))
            print(f"  {inst} {arm}: {a.reps} reps done", file=sys.stderr, flush=True)
        s = summarize(runs, inst, data, a.budget_epochs, a.reference or 20_000)
        print(table(s), flush=True)
        doc["instances"][inst] = {"summary": s, "runs": runs}
        for arm, row in s["arms"].items():
            figures[f"{inst}/{arm}/regret"] = round(row["paper"]["final"], 4)
            figures[f"{inst}/{arm}/regret_fixed"] = round(row["fixed"]["final"], 4)
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(doc))
    emit(figures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
