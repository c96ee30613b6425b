"""Pruning pays: examples/digits.yaml with and without its median pruner (examples/digits_pruned.yaml).

Both studies run the same TPE search (same seed) on the local engine, one after the other, in the same
process; the figure is the wall-time ratio and the difference in best val_accuracy.

    python bench/pruning.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import emit, median

ROOT = Path(__file__).resolve().parent.parent


def run(example: str, seed: int) -> tuple[float, float, int]:
    import yaml

    from hpoflow.api import optimize
    from hpoflow.engines.local import LocalEngine

    spec = yaml.safe_load((ROOT / "examples" / example).read_text())
    spec["search"]["seed"] = seed
    engine = LocalEngine()
    engine.wait_warm()  # both arms start warm
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        res = optimize(spec, Path(d) / "run", engine=engine)
        wall = time.perf_counter() - t0
        best = float(res.best_value or 0.0)
    engine.close()
    return wall, best, res.summary.n_pruned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=1, help="seeds 42, 43, ... (each runs both arms)")
    a = ap.parse_args()
    rows = []
    for i in range(a.repeats):
        seed = 42 + i
        full = run("digits.yaml", seed)
        pruned = run("digits_pruned.yaml", seed)
        rows.append((full, pruned))
        print(f"seed {seed}: without pruning {full[0]:.1f} s best {full[1]:.4f}; with pruning {pruned[0]:.1f} s "
              f"best {pruned[1]:.4f} ({pruned[2]} of 12 trials pruned)", flush=True)
    speedup = median([f[0] / p[0] for f, p in rows])
    acc_diff = median([p[1] - f[1] for f, p in rows])
    print(f"median: pruning makes the study {speedup:.2f}x faster; best val_accuracy differs by {acc_diff:+.4f}")
    emit({
        "wall_s_without": round(median([f[0] for f, _ in rows]), 2),
        "wall_s_with": round(median([p[0] for _, p in rows]), 2),
        "speedup": round(speedup, 3),
        "best_without": round(median([f[1] for f, _ in rows]), 4),
        "best_with": round(median([p[1] for _, p in rows]), 4),
        "best_diff": round(acc_diff, 4),
        "n_pruned": median([float(p[2]) for _, p in rows]),
        "repeats": a.repeats,
    })


if __name__ == "__main__":
    main()
