"""Ask-ahead: a slow sampler on short trials, with and without asking while every slot is busy.

A study of ``--trials`` trials of a synthetic objective (a sleep of ``--trial-s`` seconds, the value a
smooth function of the parameters) on a ``ThreadEngine`` of 2 slots, searched by Optuna's GP sampler
(its ask takes tens of milliseconds and grows with the study), once with ``search.ask_ahead: false``
(a freed slot waits for the ask) and once with ``true`` (the next trial was asked while both slots
ran), alternating, ``--repeats`` times: makespan, busy fraction (trial-seconds / 2 x makespan), the
median ask time, and the best value (ask-ahead samples without the very last result).

    python bench/ask_ahead.py [--trials 40] [--trial-s 0.2] [--repeats 3]
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import emit, median


def objective(params: dict[str, Any], reporter: Any, trial_s: float = 0.05) -> float:
    time.sleep(trial_s)
    x, y = params["x"], params["y"]
    return math.sin(3 * x) * math.cos(2 * y) + 0.1 * (x - 0.3) ** 2


def run(ask_ahead: bool, n: int, trial_s: float, seed: int) -> dict[str, float]:
    from hpoflow.api import optimize
    from hpoflow.engines.threads import ThreadEngine

    spec = {"study": {"name": "ask-ahead", "metric": "value", "direction": "minimize"},
            "space": {"x": {"type": "float", "low": -2.0, "high": 2.0},
                      "y": {"type": "float", "low": -2.0, "high": 2.0}},
            "search": {"algorithm": "gp", "n_trials": n, "max_concurrent": 2, "seed": seed, "ask_ahead": ask_ahead},
            "training": {"function": "bench_objectives:sleep50"}, "oracle": {"enabled": False}}
    engine = ThreadEngine(lambda p, r: objective(p, r, trial_s), slots=2)
    with tempfile.TemporaryDirectory() as d:
        res = optimize(spec, Path(d) / "run", engine=engine, handle_signals=False)
        best = res.best_value
    engine.close()
    makespan = res.summary.elapsed_s
    return {"makespan_s": makespan, "busy": n * trial_s / (2 * makespan), "best_value": float(best or 0.0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=40)
    ap.add_argument("--trial-s", type=float, default=0.2)
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    for i in range(a.repeats):
        for label, flag in (("off", False), ("on", True)):
            r = run(flag, a.trials, a.trial_s, seed=i)
            runs[label].append(r)
            print(f"repeat {i + 1}, ask_ahead {label}: makespan {r['makespan_s']:.2f} s, busy {r['busy']:.3f}, "
                  f"best {r['best_value']:.4f}", flush=True)
    out: dict[str, Any] = {}
    for label, rs in runs.items():
        out[label] = {k: round(median([r[k] for r in rs]), 4) for k in ("makespan_s", "busy", "best_value")}
    out["makespan_ratio"] = round(out["on"]["makespan_s"] / out["off"]["makespan_s"], 3)
    print(f"GP on 2 slots, {a.trials} trials of {a.trial_s} s, median of {a.repeats}: makespan "
          f"{out['off']['makespan_s']} s -> {out['on']['makespan_s']} s ({out['makespan_ratio']}x), busy "
          f"{out['off']['busy']} -> {out['on']['busy']}, best {out['off']['best_value']} / {out['on']['best_value']}")
    emit(out)


if __name__ == "__main__":
    main()
