"""How much sooner adaptive search reaches a good model than the seed's grid search.

On examples/digits.yaml's space (lr log-uniform, batch size, optimizer, momentum when sgd, channels),
2 slots, with the trials' cost and learning curves from a synthetic response surface
(``bench_objectives:digits_surface``: 15 epochs, 9-23 s per trial) on the simulated engine, so many
seeds are affordable. Arms: the seed's approach, a fixed grid (lr in 5 decades, momentum 0.5/0.9;
90 points) whose results are collected per batch of 2 (each batch waits for its slowest trial); and
the asynchronous driver with random, TPE, GP and CMA-ES, each without pruning, with ASHA and with the
median pruner (CMA-ES and GP without pruning), and random and TPE with the schedulers that pause and
resume trials from checkpoints (``+promo``: promotion-type ASHA, ``+hb``: Hyperband; docs/schedulers.md;
``+promo_nl``: the same with TPE's constant liar off), and with population-based training (``+pbt``,
``+pb2``: 16 members, intervals of 3 epochs; ``+pbt48``: 48 members, about the grid's budget; on the
surface a member's accuracy after epoch e is the surface's for its current lr and momentum at e, so an
exploit carries the donor's progress in epochs, not its weights; ``+pb2`` is skipped with its reason
while ``hpoflow.search.pb2`` is absent). Every arm gets the grid's wall-clock budget (virtual).

Reported per arm, medians over seeds, for two targets: the grid's best value (strict: the grid's
maximum over 90 noisy results is partly luck) and a fixed "good model" accuracy (``--target``,
default 0.98, which the grid reaches in every seed): time to reach it, the ratio grid time / arm
time, and the best value within the budget; a plot of anytime best vs time is written
with plotly (the report's plotting library) when ``--plot`` names a PNG (needs kaleido).

    python bench/search_efficiency.py [--seeds 5] [--trials 200] [--plot docs/img/search_efficiency.png]
    python bench/search_efficiency.py --real [--seeds 3]   # the real CNN on digits, ~4 min per seed here
    python bench/search_efficiency.py --arms tpe+asha,tpe+promo,tpe+hb   # some arms only
    python bench/search_efficiency.py --arms tpe+promo,tpe+pbt,tpe+pb2   # PBT, PB2 (docs/schedulers.md)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _common import BENCH, emit

SPACE = {"lr": {"type": "float", "low": 3.0e-4, "high": 3.0e-2, "log": True},
         "batch_size": {"type": "categorical", "choices": [32, 64, 128]},
         "optimizer": {"type": "categorical", "choices": ["adam", "sgd"]},
         "momentum": {"type": "float", "low": 0.5, "high": 0.95, "when": {"optimizer": "sgd"}},
         "channels": {"type": "categorical", "choices": [16, 32]}}
GRID = {**SPACE, "lr": {"type": "categorical", "choices": [3.0e-4, 1.0e-3, 3.0e-3, 1.0e-2, 3.0e-2]},
        "momentum": {"type": "categorical", "choices": [0.5, 0.9], "when": {"optimizer": "sgd"}}}
PRUNERS = {"none": {"type": "none"}, "asha": {"type": "asha", "min_resource": 1, "reduction_factor": 3},
           "median": {"type": "median", "startup_trials": 5, "warmup_steps": 3}}
# search.scheduler arms (docs/schedulers.md): trials pause at rungs and resume from checkpoints
SCHEDULERS = {"promo": {"type": "asha", "min_resource": 1, "reduction_factor": 3},
              "hb": {"type": "hyperband", "min_resource": 1, "reduction_factor": 3},
              # population-based training: 16 members, intervals of 3 epochs, lr and momentum explored
              "pbt": {"type": "pbt", "population": 16, "interval": 3},
              "pb2": {"type": "pbt", "population": 16, "interval": 3, "explore": "pb2"},
              # a population that spends about the grid's budget (48 members x 15 epochs)
              "pbt48": {"type": "pbt", "population": 48, "interval": 3}}


def _search(algorithm: str, pruner: str, seed: int) -> dict[str, Any]:
    """The search section of an arm: ``pruner`` names a pruner (stopping) or a scheduler (promo, hb)."""
    search: dict[str, Any] = {"algorithm": algorithm, "max_concurrent": 2, "seed": seed}
    if pruner.removesuffix("_nl") in SCHEDULERS:
        search["scheduler"] = SCHEDULERS[pruner.removesuffix("_nl")]
        if pruner.endswith("_nl") and algorithm == "tpe":
            search["sampler_options"] = {"constant_liar": False}
    else:
        search["pruner"] = PRUNERS[pruner]
    return search


def run(algorithm: str, pruner: str, seed: int, n_trials: int) -> list[tuple[float, float | None, float]]:
    """(end time, value if complete, duration) of every trial, in submit order, virtual seconds."""
    from hpoflow.api import optimize
    from hpoflow.engines.simulated.engine import SimulatedEngine
    from hpoflow.engines.simulated.options import SimulatedOptions

    os.environ["HPOFLOW_BENCH_SEED"] = str(seed)
    grid = algorithm == "grid"
    search = _search(algorithm, pruner, seed)
    if not grid:
        search["n_trials"] = n_trials
    spec = {"study": {"name": "eff", "metric": "val_accuracy", "direction": "maximize"},
            "space": GRID if grid else SPACE, "search": search,
            "training": {"model": "cnn", "epochs": 15}, "oracle": {"enabled": False}}
    eng = SimulatedEngine(SimulatedOptions.model_validate({"slots": 2, "function": "bench_objectives:digits_surface"}),
                          cost=_interval_cost if SCHEDULERS.get(pruner, {}).get("type") == "pbt" else None)
    with tempfile.TemporaryDirectory() as d:
        res = optimize(spec, Path(d) / "run", engine=eng)
        out = []
        for t in sorted(res.study.trials, key=lambda t: t.number):
            tm = t.user_attrs.get("timings") or {}
            if "duration_s" not in tm:
                continue
            end = tm["started_at"] - eng.epoch_wall + tm["duration_s"]
            value = t.value if t.state.name == "COMPLETE" else None
            out.append((end, value, tm["duration_s"]))
    return out


def _interval_cost(request: Any) -> Any:
    """The surface for one PBT interval trial: its curve up to its ``training.epochs`` (the interval's end),
    its value the curve's there, its duration that many epochs' (the engine resumes it at its start)."""
    from bench_objectives import digits_surface

    from hpoflow.engines.simulated.costs import TrialCost

    out = digits_surface(dict(request.params), request.number)
    end = int(request.train.get("epochs") or 15)
    curve = list(out["curve"])[:end]  # type: ignore[call-overload]
    return TrialCost(float(out["duration_s"]) * end / 15, {"val_accuracy": curve[-1]},  # type: ignore[arg-type]
                     [{"val_accuracy": v} for v in curve])


def _skip(alg: str, pr: str) -> str:
    """Why an arm cannot run here ('' if it can): PB2 needs hpoflow.search.pb2."""
    import importlib.util

    if pr == "pb2" and importlib.util.find_spec("hpoflow.search.pb2") is None:
        return f"{alg}+pb2 skipped: explore pb2 needs hpoflow.search.pb2, which is not installed here"
    return ""


def run_real(algorithm: str, pruner: str, seed: int, n_trials: int, timeout_s: float | None,
             engine: Any) -> list[tuple[float, float | None, float]]:
    """The same on the real built-in CNN (examples/digits.yaml's training, the local engine): (end, value,
    duration) in wall-clock seconds from the study's first submit; ``timeout_s`` stops new trials."""
    from hpoflow.api import optimize

    grid = algorithm == "grid"
    search = _search(algorithm, pruner, seed)
    if not grid:
        search["n_trials"] = n_trials
    if timeout_s is not None:
        search["timeout"] = timeout_s
    training = {"model": "cnn", "model_options": {"channels": "${channels}"}, "dataset": "digits", "epochs": 15,
                "batch_size": "${batch_size}", "optimizer": "${optimizer}", "lr": "${lr}", "momentum": "${momentum}",
                "seed": seed}
    spec = {"study": {"name": "eff", "metric": "val_accuracy", "direction": "maximize"},
            "space": GRID if grid else SPACE, "search": search, "training": training,
            "resources": {"processes": 1, "cpus_per_process": 1}, "oracle": {"enabled": False}}
    with tempfile.TemporaryDirectory() as d:
        res = optimize(spec, Path(d) / "run", engine=engine)
        rows = []
        for t in sorted(res.study.trials, key=lambda t: t.number):
            tm = t.user_attrs.get("timings") or {}
            if "started_at" in tm and "duration_s" in tm:
                submit = tm["started_at"] - tm.get("launch_s", 0.0)
                rows.append((submit, t.value if t.state.name == "COMPLETE" else None, tm["duration_s"]))
    t0 = min(r[0] for r in rows)
    return [(sub - t0 + dur, v, dur) for sub, v, dur in rows]


REAL_ARMS = [("tpe", "asha"), ("tpe", "promo"), ("random", "none"), ("tpe", "pbt"), ("tpe", "pb2")]


def real(seeds: int, arms: list[tuple[str, str]] | None = None) -> None:
    """Grid (batches of 2) against TPE+ASHA (stopping), TPE with promotion-type ASHA and random on the real
    CNN, each given the grid's budget."""
    from hpoflow.engines.local import LocalEngine

    engine = LocalEngine(cores=[0, 1])
    engine.wait_warm()
    out: dict[str, dict[str, list[float]]] = {}
    grid_ttt: list[float] = []
    try:
        for seed in range(seeds):
            points = batched(run_real("grid", "none", seed, 0, None, engine))
            curve = anytime(points)
            budget, target = max(t for t, _ in points), curve[-1][1]
            grid_ttt.append(time_to(curve, target, budget))
            line = [f"seed {seed}: grid budget {budget:.0f} s, best {target:.4f} at {grid_ttt[-1]:.0f} s"]
            for alg, pr in [a for a in arms or REAL_ARMS if not _skip(*a)]:
                name = f"{alg}+{pr}" if pr != "none" else alg
                c = anytime([(t, v) for t, v, _ in run_real(alg, pr, seed, 1000, budget, engine)])
                r = out.setdefault(name, {"ttt": [], "best": []})
                r["ttt"].append(time_to(c, target, budget))
                r["best"].append(max((b for t, b in c if t <= budget), default=math.nan))
                line.append(f"{name} {r['ttt'][-1]:.0f} s (best {r['best'][-1]:.4f})")
            print("; ".join(line), flush=True)
    finally:
        engine.close()
    g = statistics.median(grid_ttt)
    table = {}
    for name, r in out.items():
        ttt = statistics.median(r["ttt"])
        table[name] = {"time_to_grid_best_s": round(ttt, 1) if math.isfinite(ttt) else None,
                       "ratio_vs_grid": round(g / ttt, 2) if math.isfinite(ttt) and ttt > 0 else 0.0,
                       "reached": sum(math.isfinite(x) for x in r["ttt"]),
                       "best_in_budget": round(statistics.median(r["best"]), 4)}
        print(f"{name:>10}: to the grid's best {table[name]['time_to_grid_best_s']} s vs grid {g:.0f} s = "
              f"{table[name]['ratio_vs_grid']}x ({table[name]['reached']}/{seeds} seeds); best within budget "
              f"{table[name]['best_in_budget']}")
    emit({"real": True, "seeds": seeds, "grid_time_to_best_s": round(g, 1), "arms": table})


def batched(trials: list[tuple[float, float | None, float]], slots: int = 2) -> list[tuple[float, float | None]]:
    """The grid as the seed ran it: batches of ``slots`` in order, each collected when its slowest ends."""
    out, clock = [], 0.0
    for i in range(0, len(trials), slots):
        batch = trials[i: i + slots]
        clock += max(d for _, _, d in batch)
        out.extend((clock, v) for _, v, _ in batch)
    return out


def anytime(points: list[tuple[float, float | None]]) -> list[tuple[float, float]]:
    best, out = -math.inf, []
    for t, v in sorted(points, key=lambda p: p[0]):
        if v is not None and v > best:
            best = v
            out.append((t, best))
    return out


def time_to(curve: list[tuple[float, float]], target: float, budget: float) -> float:
    return next((t for t, b in curve if b >= target - 1e-12 and t <= budget), math.inf)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--trials", type=int, default=200, help="trials of each adaptive arm (the budget cuts them)")
    ap.add_argument("--plot", help="write the anytime-best plot to this PNG")
    ap.add_argument("--target", type=float, default=0.98, help="the fixed target accuracy")
    ap.add_argument("--quick", action="store_true", help="2 seeds, few arms (a smoke run)")
    ap.add_argument("--arms", help="comma-separated arms instead of all, e.g. tpe+asha,tpe+promo,random "
                    "(promo: promotion-type ASHA, hb: Hyperband, both search.scheduler)")
    ap.add_argument("--real", action="store_true", help="the real built-in CNN on digits (local engine): grid "
                    "against TPE+ASHA and random, each given the grid's wall-clock budget")
    a = ap.parse_args()
    chosen = [(s.split("+")[0], s.split("+")[1] if "+" in s else "none") for s in a.arms.split(",")] if a.arms else None
    if a.real:
        real(a.seeds, chosen)
        return
    arms = [(alg, p) for alg in ("random", "tpe") for p in ("none", "asha", "median", "promo", "hb")]
    arms += [("gp", "none"), ("cmaes", "none"), ("tpe", "pbt"), ("tpe", "pb2")]
    if chosen:
        arms = chosen
    for alg, pr in list(arms):
        if _skip(alg, pr):
            print(_skip(alg, pr), flush=True)
            arms.remove((alg, pr))
    if a.quick:
        a.seeds, a.trials, arms = 2, 60, [("random", "none"), ("tpe", "asha"), ("tpe", "promo")]
    results: dict[str, dict[str, Any]] = {}
    curves: dict[str, list[list[tuple[float, float]]]] = {}
    grid_ttt: dict[str, list[float]] = {"grid_best": [], "fixed": []}
    budgets, targets = [], []
    for seed in range(a.seeds):
        grid_points = batched(run("grid", "none", seed, 0))
        grid = anytime(grid_points)
        budget = max(t for t, _ in grid_points)
        goals = {"grid_best": grid[-1][1], "fixed": a.target}
        budgets.append(budget)
        targets.append(goals["grid_best"])
        for k, goal in goals.items():
            grid_ttt[k].append(time_to(grid, goal, budget))
        curves.setdefault("grid (batches of 2)", []).append(grid)
        for alg, pr in arms:
            name = f"{alg}+{pr}" if pr != "none" else alg
            curve = anytime([(t, v) for t, v, _ in run(alg, pr, seed, a.trials)])
            curves.setdefault(name, []).append(curve)
            r = results.setdefault(name, {"grid_best": [], "fixed": [], "best": []})
            for k, goal in goals.items():
                r[k].append(time_to(curve, goal, budget))
            r["best"].append(max((b for t, b in curve if t <= budget), default=math.nan))
        print(f"seed {seed}: grid budget {budget:.0f} s, best {goals['grid_best']:.4f} (reached at "
              f"{grid_ttt['grid_best'][-1]:.0f} s), {a.target} at {grid_ttt['fixed'][-1]:.0f} s; "
              + ", ".join(f"{n} {r['grid_best'][-1]:.0f}/{r['fixed'][-1]:.0f} s" for n, r in results.items()),
              flush=True)
    g = {k: statistics.median(v) for k, v in grid_ttt.items()}
    table: dict[str, dict[str, Any]] = {}
    for name, r in results.items():
        row: dict[str, Any] = {"best_in_budget": round(statistics.median(r["best"]), 4)}
        for k in ("grid_best", "fixed"):
            ttt = statistics.median(r[k])
            row[k] = {"time_to_target_s": round(ttt, 1) if math.isfinite(ttt) else None,
                      "ratio_vs_grid": round(g[k] / ttt, 2) if math.isfinite(ttt) and ttt > 0 else 0.0,
                      "reached": sum(math.isfinite(x) for x in r[k])}
        table[name] = row
    for name, row in sorted(table.items(), key=lambda kv: -kv[1]["fixed"]["ratio_vs_grid"]):
        f, gb = row["fixed"], row["grid_best"]
        print(f"{name:>14}: to {a.target}: {f['time_to_target_s']} s vs grid {g['fixed']:.0f} s = "
              f"{f['ratio_vs_grid']}x ({f['reached']}/{a.seeds} seeds); to the grid's best: "
              f"{gb['time_to_target_s']} s vs {g['grid_best']:.0f} s = {gb['ratio_vs_grid']}x "
              f"({gb['reached']}/{a.seeds}); best within budget {row['best_in_budget']}")
    if a.plot:
        plot(curves, statistics.median(budgets), Path(a.plot))
    emit({"seeds": a.seeds, "grid_time_to_target_s": {k: round(v, 1) for k, v in g.items()},
          "grid_budget_s": round(statistics.median(budgets), 1), "fixed_target": a.target,
          "grid_best_median": round(statistics.median(targets), 4), "arms": table})


def plot(curves: dict[str, list[list[tuple[float, float]]]], budget: float, path: Path) -> None:
    """Median anytime best over seeds vs time, one line per arm (plotly, as the report draws)."""
    import plotly.graph_objects as go

    grid_t = [budget * i / 200 for i in range(201)]
    fig = go.Figure()
    for name, runs in curves.items():
        ys = []
        for t in grid_t:
            at = [max((b for s, b in c if s <= t), default=math.nan) for c in runs]
            at = [x for x in at if not math.isnan(x)]
            ys.append(statistics.median(at) if at else None)
        fig.add_trace(go.Scatter(x=grid_t, y=ys, mode="lines", name=name))
    fig.update_layout(title="anytime best val_accuracy (median over seeds), 2 slots", xaxis_title="seconds",
                      yaxis_title="best val_accuracy so far", yaxis_range=[0.9, 1.0], width=1000, height=560)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_image(str(path))
    print(f"wrote {path}")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(BENCH))
    main()
