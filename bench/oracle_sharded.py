"""The oracle's sharded pricing against real trials: peak memory per rank and bytes per step.

For the built-in transformer (``gpt``: 4 layers of width 256, context 64, 3.2M parameters; AdamW,
batch 16 per rank, the ``chars`` corpus, fp32, one epoch) with allreduce, zero1, fsdp and fsdp
without resharding after forward, at 2 and 4 gloo ranks (4 ranks on 2 cores share them; memory
and bytes hold, times do not), run a real trial through the local engine (fresh worker processes,
so each trial's peak is its own) and ask the oracle about the same trial the way the driver's
precheck does (:func:`hpoflow.oracle.feasibility.check_trial` on the ``laptop`` preset). Compares:

* ``peak_memory_mb`` (the largest rank's resident-set high-water mark above its start, less the
  library code it mapped meanwhile: what training added) with the predicted memory per rank without
  ``reserved`` (the CUDA context and library workspaces a CPU rank does not have);
* ``bytes_per_step`` (what rank 0 wrote per step, the kernel's byte counter) with the predicted
  bytes per step (gloo reduce-scatters as an all-reduce: both sides count it so).

Prints a table, then ONE JSON line with each row and its ratios. About 10 minutes on 2 idle cores.

    python bench/oracle_sharded.py [--worlds 2,4] [--strategies allreduce,zero1,fsdp,fsdp-keep]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from hpoflow.engines.local import LocalEngine
from hpoflow.engines.machine import machine_cores
from hpoflow.oracle.feasibility import check_trial
from hpoflow.spec import TrainConfig
from hpoflow.trial import TrialRequest, TrialResult

GPT: dict[str, Any] = {"model": "gpt", "model_options": {"layers": 4, "heads": 4, "width": 256, "context": 64},
                       "epochs": 1, "lr": 3e-3, "batch_size": 16, "dataset": "chars", "optimizer": "adamw",
                       "precision": "fp32"}
STRATEGIES: dict[str, tuple[str, dict[str, Any]]] = {
    "allreduce": ("allreduce", {}), "zero1": ("zero1", {}), "fsdp": ("fsdp", {}),
    "fsdp-keep": ("fsdp", {"reshard_after_forward": False}),
}
_MIB = 2**20


def _run(engine: LocalEngine, number: int, cfg: TrainConfig, world: int, root: str) -> TrialResult:
    engine.submit(TrialRequest(number, {}, cfg.model_dump(mode="json"), "val_loss", "minimize",
                               f"{root}/{number}", processes=world, cpus_per_process=1, timeout=1800))
    while True:
        for ev in engine.poll(None):
            if isinstance(ev, TrialResult):
                return ev


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of {', '.join(STRATEGIES)}")
    args = ap.parse_args(argv)
    worlds = [int(w) for w in args.worlds.split(",") if w]
    labels = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in labels if s not in STRATEGIES]
    if unknown or not worlds or min(worlds) < 1:
        ap.error(f"strategies among {', '.join(STRATEGIES)} (got {unknown}), world sizes >= 1 (got {worlds})")
    cores = machine_cores()
    slots = [cores[i % len(cores)] for i in range(max(max(worlds), len(cores)))]  # beyond the cores: shared
    engine = LocalEngine(cores=slots, gpus=[], max_trials_per_worker=1)  # fresh workers: each trial's own peak
    rows: list[dict[str, Any]] = []
    start, load0 = time.monotonic(), os.getloadavg()[0]
    n = 0
    try:
        with tempfile.TemporaryDirectory(prefix="hpoflow-bench-") as root:
            for world in worlds:
                for label in labels:
                    strategy, options = STRATEGIES[label]
                    cfg = TrainConfig(**GPT, strategy=strategy, strategy_options=options)
                    res = _run(engine, n, cfg, world, root)
                    n += 1
                    m = res.metrics
                    verdict = check_trial(cfg.model_dump(mode="json"), world, 0, None)
                    memory = verdict.predicted.get("memory", {})
                    predicted_mb = (memory["total"] - memory.get("reserved", 0.0)) / _MIB if memory else None
                    row = {"strategy": label, "world_size": world, "oversubscribed": world > len(cores),
                           "status": res.status, "error": res.error, "verdict": verdict.reason,
                           "peak_memory_mb": m.get("peak_memory_mb"), "predicted_memory_mb": predicted_mb,
                           "memory_ratio": _ratio(predicted_mb, m.get("peak_memory_mb")),
                           "bytes_per_step": m.get("bytes_per_step"), "bytes_measured": m.get("bytes_measured"),
                           "predicted_bytes_per_step": verdict.predicted.get("bytes_per_step"),
                           "bytes_ratio": _ratio(verdict.predicted.get("bytes_per_step"), m.get("bytes_per_step")),
                           "predicted_breakdown_mb": {k: round(v / _MIB, 2) for k, v in memory.items()}}
                    rows.append(row)
                    print(f"{label:10s} p={world} {res.status:8s} {time.monotonic() - start:6.1f} s",
                          file=sys.stderr, flush=True)
    finally:
        engine.close()
    print(f"{'strategy':10s} {'p':>3s} {'peak MB':>8s} {'oracle MB':>9s} {'ratio':>6s} "
          f"{'sent/step':>11s} {'oracle':>11s} {'ratio':>6s}")
    for r in rows:
        p = f"{r['world_size']}{'*' if r['oversubscribed'] else ''}"
        peak = r["peak_memory_mb"]
        print(f"{r['strategy']:10s} {p:>3s} {'-' if peak is None else format(peak, '.1f'):>8s} "
              f"{r['predicted_memory_mb'] or 0:9.1f} {r['memory_ratio'] or 0:6.2f} "
              f"{r['bytes_per_step'] or 0:11.4g} {r['predicted_bytes_per_step'] or 0:11.4g} "
              f"{r['bytes_ratio'] or 0:6.3f}")
    if any(r["oversubscribed"] for r in rows):
        print("* oversubscribed: more ranks than cores (bytes and memory hold; times do not)")
    memory_ok = all(r["memory_ratio"] is not None and 0.75 <= r["memory_ratio"] <= 1.25 for r in rows)
    bytes_ok = all(r["bytes_ratio"] is not None and 0.9 <= r["bytes_ratio"] <= 1.1 for r in rows
                   if r["bytes_measured"] == 1.0)
    print(json.dumps({"bench": "oracle_sharded", "memory_within_25_percent": memory_ok,
                      "bytes_within_10_percent": bytes_ok, "cores": len(cores),
                      "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
                      "elapsed_s": round(time.monotonic() - start, 1), "rows": rows}))
    return 0 if all(r["status"] == "complete" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
