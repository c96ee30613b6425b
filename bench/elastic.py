"""Elastic trials in the drain tail: the same study with and without elasticity, simulated.

First the built-in CNN's strong scaling is measured on this machine (examples/digits.yaml's
configuration, 1 and 2 ranks, the same global batch): the speedup on 2 ranks becomes the simulated
scaling curve ("measured"), extended beyond 2 slots at the same efficiency per doubling; a second
curve keeps 90 % efficiency per doubling ("0.9/doubling", about what Goyal et al. 2017 report for
ResNet-50 on 8 to 256 GPUs). Then 1,000 log-normal trials (median 60 s, sigma 1) run on 64 and on
512 simulated slots (8,000 trials there) without and with elasticity (policy
``longest_remaining``, up to all the slots, ``resize_s`` per resize; a trial grows only where the
curve makes it faster): makespan, busy fraction (slot-seconds used / slots x makespan), best value.

Not here: elastic trials on the local engine (real processes regrouping at an epoch boundary); see
docs/performance.md.

    python bench/elastic.py [--resize-s 5] [--quick]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

from _common import BENCH, emit


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
    a = ap.parse_args()
    s2, measured = measured_speedup(1 if a.quick else a.epochs)
    print(f"built-in CNN on this machine: 2-rank speedup {s2:.2f} (strong scaling) {measured}", flush=True)
    curve = [1.0, max(1.0, s2)]
    cases = [(200, 64)] if a.quick else [(1000, 64), (8000, 512)]
    out: dict[str, Any] = {"speedup_2": round(s2, 3), **measured, "resize_s": a.resize_s}
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
