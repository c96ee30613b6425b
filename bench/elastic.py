"""Elastic trials in the drain tail: the same study with and without elasticity, real and simulated.

Real (this machine, 2 cores, the local engine): a random search of 5 built-in CNN trials (digits,
128 channels, global batch 256, 4 to 30 epochs) with two in flight; seed 6 draws 12, 5, 20, 15 and
20 epochs, so the last trial runs alone for a while (the issue's "study whose last trials run alone";
a fixed-size schedule is then about 0.8 busy). Once with ``processes: 1`` and
once with ``processes: {min: 1, max: 2}``, alternating, ``--repeats`` times: makespan, busy fraction
(core-seconds the trials held / cores x makespan), best value, and each trial's value against the
fixed-size run's (the same configurations: the sampler's draws do not depend on results).

Simulated: first the built-in CNN's strong scaling is measured on this machine (examples/digits.yaml's
configuration, 1 and 2 ranks, the same global batch): the speedup on 2 ranks becomes the simulated
scaling curve ("measured"), extended beyond 2 slots at the same efficiency per doubling; a second
curve keeps 90 % efficiency per doubling ("0.9/doubling", about what Goyal et al. 2017 report for
ResNet-50 on 8 to 256 GPUs). Then 1,000 log-normal trials (median 60 s, sigma 1) run on 64 and on
512 simulated slots (8,000 trials there) without and with elasticity (policy
``longest_remaining``, up to all the slots, ``resize_s`` per resize; a trial grows only where the
curve makes it faster): makespan, busy fraction (slot-seconds used / slots x makespan), best value.

    python bench/elastic.py [--repeats 3] [--resize-s 5] [--quick] [--no-real] [--no-simulated]

``--quick`` (the smoke test) takes every path once at sizes whose figures are not the study's: the real
study with 2 trials of 4 or 5 epochs of a 16-channel CNN, once fixed and once elastic; the scaling
measurement for 1 epoch; 100 simulated trials on 64 slots.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from _common import BENCH, emit, median


def real_spec(processes: Any, n_trials: int, max_epochs: int = 30, channels: int = 128) -> dict[str, Any]:
    return {
        "study": {"name": "elastic-real", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 1e-3, "high": 1e-2, "log": True},
                  "epochs": {"type": "int", "low": 4, "high": max_epochs}},
        "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": 2, "seed": 6},
        "training": {"model": "cnn", "model_options": {"channels": channels}, "dataset": "digits",
                     "epochs": "${epochs}", "batch_size": 256, "optimizer": "adam", "lr": "${lr}"},
        "resources": {"processes": processes},
        "oracle": {"enabled": False},
    }


def real_run(processes: Any, n_trials: int, max_epochs: int, channels: int) -> dict[str, Any]:
    import json

    from hpoflow.api import optimize

    with tempfile.TemporaryDirectory() as d:
        res = optimize(real_spec(processes, n_trials, max_epochs, channels), Path(d) / "run", handle_signals=False)
        makespan, best = res.summary.elapsed_s, res.best_value
        core_s, values, resizes = 0.0, {}, 0
        for f in sorted((Path(d) / "run" / "trials").glob("*/result.json")):
            r = json.loads(f.read_text())
            t = r["timings"]
            core_s += t.get("core_s", t["duration_s"])
            resizes += int(t.get("resizes", 0))
            values[r["number"]] = r["value"]
    return {"makespan_s": makespan, "busy": core_s / (2 * makespan), "best_value": best,
            "values": values, "resizes": resizes}


def real(repeats: int, n_trials: int, max_epochs: int = 30, channels: int = 128) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {"fixed": [], "elastic": []}
    for i in range(repeats):
        for label, processes in (("fixed", 1), ("elastic", {"min": 1, "max": 2})):
            r = real_run(processes, n_trials, max_epochs, channels)
            runs[label].append(r)
            print(f"real, repeat {i + 1}, {label}: makespan {r['makespan_s']:.1f} s, busy {r['busy']:.3f}, "
                  f"best {r['best_value']:.4f}, resizes {r['resizes']}", flush=True)
    out: dict[str, Any] = {}
    for label, rs in runs.items():
        out[label] = {"makespan_s": round(median([r["makespan_s"] for r in rs]), 2),
                      "busy": round(median([r["busy"] for r in rs]), 3),
                      "best_value": round(median([r["best_value"] for r in rs]), 4),
                      "resizes": median([float(r["resizes"]) for r in rs])}
    diffs = [abs(e["values"][n] - f["values"][n]) for f, e in zip(runs["fixed"], runs["elastic"], strict=True)
             for n in f["values"] if n in e["values"]]
    out["makespan_ratio"] = round(out["elastic"]["makespan_s"] / out["fixed"]["makespan_s"], 3)
    out["max_trial_value_diff"] = round(max(diffs), 4)
    print(f"real 2-core study, median of {repeats}: makespan {out['fixed']['makespan_s']} s -> "
          f"{out['elastic']['makespan_s']} s ({out['makespan_ratio']}x), busy {out['fixed']['busy']} -> "
          f"{out['elastic']['busy']}, best {out['fixed']['best_value']} / {out['elastic']['best_value']}, "
          f"largest per-trial value difference {out['max_trial_value_diff']}", flush=True)
    return out


def measured_speedup(epochs: int) -> tuple[float, dict[str, float]]:
    from hpoflow.scaling import run_scaling
    from hpoflow.spec import load_spec

    spec, _ = load_spec(BENCH.parent / "examples" / "digits.yaml")
    spec = spec.model_copy(update={"training": {**spec.training, "epochs": epochs}})
    with tempfile.TemporaryDirectory() as d:
        report = run_scaling(spec, [1, 2], modes=("strong",), run_dir=Path(d) / "scaling")
    x = {p.world_size: p.metrics["samples_per_s"] for p in report.points if p.status == "complete"}
    if 1 not in x or 2 not in x:
        raise RuntimeError(f"the scaling run did not complete: {report.to_dict()}")
    return x[2] / x[1], {"samples_per_s_1": round(x[1], 1), "samples_per_s_2": round(x[2], 1)}


def simulate(n: int, slots: int, elastic: dict[str, Any] | None) -> dict[str, float]:
    from hpoflow.api import optimize
    from hpoflow.engines.simulated.engine import SimulatedEngine
    from hpoflow.engines.simulated.options import SimulatedOptions

    opts = {"slots": slots, "lognormal": {"median_s": 60.0, "sigma": 1.0, "seed": 0}, "elastic": elastic}
    eng = SimulatedEngine(SimulatedOptions.model_validate(opts))
    spec = {"study": {"name": "elastic", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": slots, "seed": 0},
            "training": {"model": "cnn", "epochs": 10}, "oracle": {"enabled": False}}
    with tempfile.TemporaryDirectory() as d:
        res = optimize(spec, Path(d) / "run", engine=eng)
        best = res.study.best_value
    st = eng.stats()
    return {"makespan_s": round(st["makespan_s"], 1), "busy": round(st["busy"], 4), "resizes": st["resizes"],
            "best_value": round(best, 6)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resize-s", type=float, default=5.0, help="pause of one resize (checkpoint, regroup)")
    ap.add_argument("--epochs", type=int, default=3, help="epochs of the scaling measurement")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3, help="real runs of each kind (medians)")
    ap.add_argument("--no-real", action="store_true", help="skip the real 2-core study")
    ap.add_argument("--no-simulated", action="store_true", help="skip the simulated studies")
    a = ap.parse_args()
    out: dict[str, Any] = {}
    if not a.no_real:
        # quick: 2 trials of 4 or 5 epochs of a 16-channel CNN, once each way (the path, not the figures)
        out["real"] = real(1, 2, max_epochs=5, channels=16) if a.quick else real(a.repeats, 5)
    if a.no_simulated:
        emit(out)
        return
    s2, measured = measured_speedup(1 if a.quick else a.epochs)
    print(f"built-in CNN on this machine: 2-rank speedup {s2:.2f} (strong scaling) {measured}", flush=True)
    curve = [1.0, max(1.0, s2)]
    cases = [(100, 64)] if a.quick else [(1000, 64), (8000, 512)]
    out.update({"speedup_2": round(s2, 3), **measured, "resize_s": a.resize_s})
    for n, slots in cases:
        fixed = simulate(n, slots, None)
        row: dict[str, Any] = {"trials": n, "fixed": fixed}
        for label, shape in (("measured", {"scaling": curve}), ("0.9/doubling", {"efficiency": 0.9})):
            grown = simulate(n, slots, {"policy": "longest_remaining", "max_slots": slots, "resize_s": a.resize_s,
                                        **shape})
            row[label] = {**grown, "makespan_ratio": round(grown["makespan_s"] / fixed["makespan_s"], 3)}
            print(f"{n} trials on {slots} slots, scaling {label}: busy {fixed['busy']:.3f} -> {grown['busy']:.3f} "
                  f"elastic, makespan {fixed['makespan_s'] / 3600:.2f} h -> {grown['makespan_s'] / 3600:.2f} h "
                  f"({row[label]['makespan_ratio']}x), best {fixed['best_value']} / {grown['best_value']}",
                  flush=True)
        out[f"{slots}_slots"] = row
    emit(out)


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(BENCH))
    main()
