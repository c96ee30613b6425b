"""Benchmark the data-parallel strategies on this machine (real trials through the local engine).

For the digits CNN (~72k parameters) and a communication-heavy wide MLP on digits (~9.9M
parameters), every replicated strategy at world sizes 1 and 2; for the built-in transformer (gpt, 4
layers of width 256, 3.2M parameters, Adam, on the chars corpus) allreduce, zero1 and fsdp at world
sizes 1, 2 and 4 (4 ranks on 2 cores share them: oversubscribed, starred): throughput, communication
fraction, bytes sent per step (measured by the kernel's byte counter) next to the theoretical volume
(all-reduce, ZeRO's broadcast of each rank's share, FSDP's all-gathers and reduce-scatters), the peak
memory per rank (``peak_memory_mb``: what training added to the rank's resident set, the largest
rank) and the final validation accuracy (the transformer: its validation perplexity). Every trial
runs on fresh worker processes. Prints a table, then ONE JSON line. About 15 minutes on 2 cores;
``--models gpt`` runs the transformer rows only.

    python bench/strategies.py [--quick] [--models cnn,wide_mlp,gpt]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from typing import Any

from hpoflow.engines.local import LocalEngine
from hpoflow.engines.machine import machine_cores
from hpoflow.spec import TrainConfig
from hpoflow.trial import TrialRequest, TrialResult

MODELS: dict[str, dict[str, Any]] = {
    "cnn": {"model": "cnn", "model_options": {}, "epochs": 5, "lr": 0.05, "batch_size": 32,
            "dataset": "digits", "optimizer": "sgd", "momentum": 0.9},
    "wide_mlp": {"model": "mlp", "model_options": {"hidden": 2200, "depth": 3}, "epochs": 2,
                 "lr": 0.02, "batch_size": 32, "dataset": "digits", "optimizer": "sgd", "momentum": 0.9},
    "gpt": {"model": "gpt", "model_options": {"layers": 4, "heads": 4, "width": 256, "context": 64}, "epochs": 1,
            "lr": 3e-3, "batch_size": 16, "dataset": "chars", "optimizer": "adam"},
}
WORLDS = {"cnn": (1, 2), "wide_mlp": (1, 2), "gpt": (1, 2, 4)}
STRATEGIES: list[tuple[str, str, dict[str, Any]]] = [  # label, strategy, options
    ("allreduce", "allreduce", {}),
    ("allreduce+fp16", "allreduce", {"compression": "fp16"}),
    ("parameter_server", "parameter_server", {"servers": 1}),
    ("easgd(tau=4)", "easgd", {"tau": 4}),
    ("local_sgd(H=8)", "local_sgd", {"period": 8}),
    ("zero1", "zero1", {}),
    ("fsdp", "fsdp", {}),
    ("fsdp(keep)", "fsdp", {"reshard_after_forward": False}),
]
ROWS = {  # the strategies benchmarked per model
    "cnn": ("allreduce", "parameter_server", "easgd(tau=4)", "local_sgd(H=8)"),
    "wide_mlp": ("allreduce", "allreduce+fp16", "parameter_server", "easgd(tau=4)", "local_sgd(H=8)"),
    "gpt": ("allreduce", "zero1", "fsdp", "fsdp(keep)"),
}
FORMULA = {"allreduce": "2(p-1)/p*M", "allreduce+fp16": "2(p-1)/p*M/2",
           "parameter_server": "server (p-1)*M; worker M (+M pulled)",
           "easgd(tau=4)": "2(p-1)/p*M/tau", "local_sgd(H=8)": "2(p-1)/p*M/H",
           "zero1": "2(p-1)/p*M + (p-1)*M_r (its share)",
           "fsdp": "2x AG (p-1)/p*M + RS 2(p-1)/p*M (gloo)", "fsdp(keep)": "AG (p-1)/p*M + RS 2(p-1)/p*M (gloo)"}


def run_trial(engine: LocalEngine, number: int, cfg: TrainConfig, world: int, root: str
              ) -> TrialResult:
    engine.submit(TrialRequest(number, {}, cfg.model_dump(mode="json"), "val_loss", "minimize",
                               f"{root}/{number}", processes=world, cpus_per_process=1,
                               timeout=600))
    while True:
        for ev in engine.poll(None):
            if isinstance(ev, TrialResult):
                return ev


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch each (a smoke run)")
    ap.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    args = ap.parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s) {unknown}; valid: {', '.join(MODELS)}")
    cores = machine_cores()
    top = max(w for m in models for w in WORLDS[m])
    slots = [cores[i % len(cores)] for i in range(max(top, len(cores)))]  # beyond the cores: shared
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic()
    engine = LocalEngine(cores=slots, gpus=[], max_trials_per_worker=1)  # fresh workers: fair peak memory
    options = {label: (strategy, opts) for label, strategy, opts in STRATEGIES}
    n = 0
    try:
        with tempfile.TemporaryDirectory(prefix="hpoflow-bench-") as root:
            for model in models:
                mcfg = MODELS[model]
                for label in ROWS[model]:
                    strategy, opts = options[label]
                    for world in WORLDS[model]:
                        epochs = 1 if args.quick else mcfg["epochs"]
                        cfg = TrainConfig(**{**mcfg, "epochs": epochs}, strategy=strategy, strategy_options=opts)
                        res = run_trial(engine, n, cfg, world, root)
                        n += 1
                        m = res.metrics
                        row = {
                            "model": model, "strategy": label, "world_size": world,
                            "oversubscribed": world > len(cores),
                            "status": res.status, "model_bytes": m.get("model_bytes"),
                            "samples_per_s": m.get("samples_per_s"),
                            "step_time_s": m.get("step_time_s"),
                            "comm_fraction": m.get("comm_fraction"),
                            "bytes_per_step": m.get("bytes_per_step"),
                            "theory_bytes_per_step": m.get("theory_bytes_per_step"),
                            "bytes_measured": m.get("bytes_measured"),
                            "peak_memory_mb": m.get("peak_memory_mb"),
                            "val_accuracy": m.get("val_accuracy"),
                            "val_perplexity": m.get("val_perplexity"), "epochs": epochs,
                            "error": res.error,
                        }
                        rows.append(row)
                        print(f"{model:9s} {label:17s} p={world} {res.status:8s} "
                              f"{time.monotonic() - t_start:6.1f} s", file=sys.stderr, flush=True)
    finally:
        engine.close()
    _table(rows)
    within = [abs(r["bytes_per_step"] / r["theory_bytes_per_step"] - 1) <= 0.10 for r in rows
              if r["model"] == "gpt" and r["world_size"] > 1 and r["bytes_per_step"] and r["theory_bytes_per_step"]]
    print(json.dumps({"bench": "strategies", "cores": len(cores), "models": models,
                      "gpt_bytes_within_10_percent": all(within) if within else None,
                      "elapsed_s": round(time.monotonic() - t_start, 1), "rows": rows}))
    return 0 if all(r["status"] == "complete" for r in rows) else 1


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':9s} {'M MB':>6s} {'strategy':17s} {'p':>3s} {'samples/s':>10s} "
            f"{'step ms':>8s} {'comm %':>7s} {'sent/step':>11s} {'theory':>11s} {'ratio':>6s} "
            f"{'peak MB':>8s} {'val acc':>7s} {'val ppl':>7s}  theory formula (rank 0)")
    print(head)
    print("-" * len(head))
    for r in rows:
        meas, theo = r["bytes_per_step"], r["theory_bytes_per_step"]
        ratio = meas / theo if meas is not None and theo else None
        mb = None if r["model_bytes"] is None else r["model_bytes"] / 1e6
        p = f"{r['world_size']}{'*' if r.get('oversubscribed') else ''}"
        print(f"{r['model']:9s} {_f(mb, '6.2f')} {r['strategy']:17s} {p:>3s} "
              f"{_f(r['samples_per_s'], '10.0f')} "
              f"{_f(None if r['step_time_s'] is None else 1e3 * r['step_time_s'], '8.1f')} "
              f"{_f(None if r['comm_fraction'] is None else 100 * r['comm_fraction'], '7.1f')} "
              f"{_f(meas, '11.4g')} {_f(theo, '11.4g')} {_f(ratio, '6.3f')} "
              f"{_f(r.get('peak_memory_mb'), '8.1f')} {_f(r['val_accuracy'], '7.3f')} "
              f"{_f(r.get('val_perplexity'), '7.2f')}  "
              f"{FORMULA[r['strategy']] if r['world_size'] > 1 else '0 (p=1)'}")
    if any(r.get("oversubscribed") for r in rows):
        print("* oversubscribed: more ranks than cores, ranks share cores (bytes and memory hold; times do not)")


if __name__ == "__main__":
    sys.exit(main())
