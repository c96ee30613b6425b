"""bf16 (and fp16) against fp32: the same transformer trial, the same seed, only training.precision differs.

Trains the built-in gpt (4 layers of width 256, AdamW, batch 16 x 64 characters per rank) on the chars
corpus with allreduce on 2 ranks through the local engine, once per precision, and prints the
validation perplexity after every epoch, the final relative difference to fp32, and samples/s. Then
ONE JSON line. Both runs sit on a plateau (perplexity ~22) for the first 2-4 epochs, so the default is 8
epochs: about 10 minutes on 2 quiet cores for fp32 and bf16 (35 at load 20); fp16 (``--fp16``) is emulated
on CPUs without fp16 arithmetic and takes about ten times as long.

    python bench/precision.py [--epochs 8] [--seed 0] [--fp16] [--strategy allreduce]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

from hpoflow.engines import TrialReport, TrialRequest, TrialResult
from hpoflow.engines.local import LocalEngine
from hpoflow.spec import TrainConfig

TRAIN: dict[str, Any] = {"model": "gpt", "model_options": {"layers": 4, "heads": 4, "width": 256, "context": 64},
                         "dataset": "chars", "batch_size": 16, "optimizer": "adamw", "lr": 3e-3,
                         "weight_decay": 0.01}


def run(engine: LocalEngine, number: int, cfg: TrainConfig, root: str) -> tuple[TrialResult, list[float]]:
    engine.submit(TrialRequest(number, {}, cfg.model_dump(mode="json"), "val_perplexity", "minimize",
                               f"{root}/{number}", processes=2, seed=cfg.seed, timeout=7200))
    curve: list[float] = []
    while True:
        for ev in engine.poll(None):
            if isinstance(ev, TrialReport):
                curve.append(float(ev.metrics["val_perplexity"]))
            elif isinstance(ev, TrialResult):
                return ev, curve


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", default="allreduce")
    ap.add_argument("--fp16", action="store_true", help="also fp16 (slow on CPUs without fp16 arithmetic)")
    args = ap.parse_args(argv)
    precisions = ["fp32", "bf16", *(["fp16"] if args.fp16 else [])]
    out: dict[str, dict[str, Any]] = {}
    t0 = time.monotonic()
    engine = LocalEngine(gpus=[], max_trials_per_worker=1)
    try:
        with tempfile.TemporaryDirectory(prefix="hpoflow-bench-") as root:
            for i, precision in enumerate(precisions):
                cfg = TrainConfig(**TRAIN, epochs=args.epochs, seed=args.seed, precision=precision,
                                  strategy=args.strategy)
                res, curve = run(engine, i, cfg, root)
                out[precision] = {"status": res.status, "curve": curve, "error": res.error,
                                  "val_perplexity": res.metrics.get("val_perplexity"),
                                  "samples_per_s": res.metrics.get("samples_per_s")}
                print(f"{precision}: {res.status} {time.monotonic() - t0:6.1f} s", file=sys.stderr, flush=True)
    finally:
        engine.close()
    ref = out["fp32"]["val_perplexity"]
    print(f"{'precision':9s} {'samples/s':>9s}  validation perplexity per epoch            final  vs fp32")
    for precision, r in out.items():
        final = r["val_perplexity"]
        diff = (final / ref - 1) if final and ref else None
        r["relative_to_fp32"] = diff
        curve = " ".join(f"{v:6.3f}" for v in r["curve"])
        print(f"{precision:9s} {r['samples_per_s'] or 0:9.1f}  {curve:40s} {final or float('nan'):6.3f}  "
              f"{'' if diff is None else f'{100 * diff:+.2f} %'}")
    print(json.dumps({"bench": "precision", "epochs": args.epochs, "seed": args.seed, "strategy": args.strategy,
                      "elapsed_s": round(time.monotonic() - t0, 1), "runs": out}))
    return 0 if all(r["status"] == "complete" for r in out.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
