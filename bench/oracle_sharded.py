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

``startup_memory_mb`` (the peak until the model is built and wrapped) is printed beside the oracle's
start-up prediction where the trainer reports it.

``--cap-mb N`` caps each rank's address space (``RLIMIT_AS``) at what it holds when the trial's code
starts plus N MiB (``bench/_capped.py``: the built-in trainer as a ``training.function``), and asks the
precheck about the trial on a device of N MiB: a trial that needs more stops with an out-of-memory
error, and the precheck should refuse it. ``--gpt`` sizes the model and ``--batch`` the batch, e.g. the
issue's case, a GPT whose fp32 weights and Adam state (12 bytes a parameter, 286 MiB) exceed a cap of
170 MiB, on 4 ranks (docs/oracle.md has the figures):

    python bench/oracle_sharded.py --worlds 4 --strategies fsdp,allreduce --cap-mb 170 \
        --gpt layers=16,heads=4,width=360,context=16 --batch 8

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
from hpoflow.oracle import load_cluster
from hpoflow.oracle.catalog import DEVICES, PRESETS
from hpoflow.oracle.cluster import ClusterSpec
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
BENCH = os.path.dirname(os.path.abspath(__file__))


def _run(engine: LocalEngine, number: int, train: dict[str, Any], world: int, root: str) -> TrialResult:
    engine.submit(TrialRequest(number, {}, train, "val_loss", "minimize", f"{root}/{number}", processes=world,
                               cpus_per_process=1, timeout=3600, python_path=(BENCH,)))
    while True:
        for ev in engine.poll(None):
            if isinstance(ev, TrialResult):
                return ev


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def _options(text: str) -> dict[str, int]:
    """``layers=16,width=360`` as a mapping of integers."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    return {k.strip(): int(v) for k, v in pairs}


def _capped_cluster(cap_mb: float) -> ClusterSpec:
    """The laptop preset with a device of ``cap_mb`` MiB and nothing reserved: the cap, as the precheck sees it."""
    return load_cluster({**PRESETS["laptop"], "device": {**DEVICES["cpu"], "memory_bytes": cap_mb * _MIB,
                                                         "reserved_bytes": 0}})


def _mb(memory: dict[str, float], key: str) -> float | None:
    return (memory[key] - memory.get("reserved", 0.0)) / _MIB if key in memory else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of {', '.join(STRATEGIES)}")
    ap.add_argument("--gpt", default="", help="model options of the gpt, e.g. layers=16,width=360,context=16")
    ap.add_argument("--batch", type=int, default=GPT["batch_size"], help="batch per rank")
    ap.add_argument("--cap-mb", type=float, default=0.0,
                    help="cap each rank's address space at its start plus this many MiB (0: no cap)")
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
                    gpt = {**GPT, "model_options": {**GPT["model_options"], **_options(args.gpt)},
                           "batch_size": args.batch}
                    train = TrainConfig(**gpt, strategy=strategy, strategy_options=options).model_dump(mode="json")
                    if args.cap_mb:
                        train = {**train, "function": "_capped:train", "options": {"address_space_mb": args.cap_mb}}
                    res = _run(engine, n, train, world, root)
                    n += 1
                    m = res.metrics
                    judged = {k: v for k, v in train.items() if k not in ("function", "options")}
                    verdict = check_trial(judged, world, 0, _capped_cluster(args.cap_mb) if args.cap_mb else None)
                    memory = verdict.predicted.get("memory", {})
                    predicted_mb = _mb(memory, "total") if memory else None
                    row = {"strategy": label, "world_size": world, "oversubscribed": world > len(cores),
                           "status": res.status, "error": res.error, "verdict": verdict.reason,
                           "feasible": verdict.feasible, "cap_mb": args.cap_mb or None,
                           "model_options": gpt["model_options"], "batch_size": args.batch,
                           "peak_memory_mb": m.get("peak_memory_mb"), "predicted_memory_mb": predicted_mb,
                           "memory_ratio": _ratio(predicted_mb, m.get("peak_memory_mb")),
                           "startup_memory_mb": m.get("startup_memory_mb"),
                           "predicted_startup_mb": _mb(memory, "startup"),
                           "bytes_per_step": m.get("bytes_per_step"), "bytes_measured": m.get("bytes_measured"),
                           "predicted_bytes_per_step": verdict.predicted.get("bytes_per_step"),
                           "bytes_ratio": _ratio(verdict.predicted.get("bytes_per_step"), m.get("bytes_per_step")),
                           "predicted_breakdown_mb": {k: round(v / _MIB, 2) for k, v in memory.items()}}
                    rows.append(row)
                    print(f"{label:10s} p={world} {res.status:8s} {time.monotonic() - start:6.1f} s",
                          file=sys.stderr, flush=True)
    finally:
        engine.close()
    def mb(x: float | None) -> str:
        return "-" if x is None else format(x, ".1f")

    print(f"{'strategy':10s} {'p':>3s} {'status':9s} {'start MB':>8s} {'oracle':>7s} {'peak MB':>8s} "
          f"{'oracle MB':>9s} {'ratio':>6s} {'sent/step':>11s} {'oracle':>11s} {'ratio':>6s}  precheck")
    for r in rows:
        p = f"{r['world_size']}{'*' if r['oversubscribed'] else ''}"
        oom = r["status"] != "complete" and "can't allocate memory" in (r["error"] or "")
        print(f"{r['strategy']:10s} {p:>3s} {'OOM' if oom else r['status']:9s} {mb(r['startup_memory_mb']):>8s} "
              f"{mb(r['predicted_startup_mb']):>7s} {mb(r['peak_memory_mb']):>8s} "
              f"{mb(r['predicted_memory_mb']):>9s} {r['memory_ratio'] or 0:6.2f} "
              f"{r['bytes_per_step'] or 0:11.4g} {r['predicted_bytes_per_step'] or 0:11.4g} "
              f"{r['bytes_ratio'] or 0:6.3f}  {'admits' if r['feasible'] else 'refuses'}")
    if any(r["oversubscribed"] for r in rows):
        print("* oversubscribed: more ranks than cores (bytes and memory hold; times do not)")
    if args.cap_mb:
        print(f"each rank capped at its start + {args.cap_mb:g} MiB of address space; precheck on a device of "
              f"{args.cap_mb:g} MiB")
    done = [r for r in rows if r["status"] == "complete"]
    memory_ok = all(r["memory_ratio"] is not None and 0.75 <= r["memory_ratio"] <= 1.25 for r in done)
    bytes_ok = all(r["bytes_ratio"] is not None and 0.9 <= r["bytes_ratio"] <= 1.1 for r in done
                   if r["bytes_measured"] == 1.0)
    print(json.dumps({"bench": "oracle_sharded", "memory_within_25_percent": memory_ok,
                      "bytes_within_10_percent": bytes_ok, "cores": len(cores),
                      "load_average_1min": [round(load0, 2), round(os.getloadavg()[0], 2)],
                      "elapsed_s": round(time.monotonic() - start, 1), "rows": rows}))
    # under a cap a trial may stop out of memory: that is a finding, as long as the precheck refused it
    expected = all(r["status"] == "complete" or (args.cap_mb and not r["feasible"]) for r in rows)
    return 0 if expected else 1


if __name__ == "__main__":
    sys.exit(main())
