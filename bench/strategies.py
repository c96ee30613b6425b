"""Benchmark the data-parallel strategies on this machine (real trials through the local engine).

For the digits CNN (~72k parameters) and a communication-heavy wide MLP on digits (~9.9M
parameters), every strategy at world sizes 1 and 2: throughput, communication fraction, bytes sent
per step (measured by the kernel's byte counter) next to the theoretical volume, and the final
validation accuracy. Prints a table, then ONE JSON line. About 2-4 minutes on 2 cores.

    python bench/strategies.py [--quick]
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
    "cnn": {"model": "cnn", "model_options": {}, "epochs": 5, "lr": 0.05, "batch_size": 32},
    "wide_mlp": {"model": "mlp", "model_options": {"hidden": 2200, "depth": 3}, "epochs": 2,
                 "lr": 0.02, "batch_size": 32},
}
STRATEGIES: list[tuple[str, str, dict[str, Any]]] = [  # label, strategy, options
    ("allreduce", "allreduce", {}),
    ("allreduce+fp16", "allreduce", {"compression": "fp16"}),
    ("parameter_server", "parameter_server", {"servers": 1}),
    ("easgd(tau=4)", "easgd", {"tau": 4}),
    ("local_sgd(H=8)", "local_sgd", {"period": 8}),
]
FORMULA = {"allreduce": "2(p-1)/p*M", "allreduce+fp16": "2(p-1)/p*M/2",
           "parameter_server": "server (p-1)*M; worker M (+M pulled)",
           "easgd(tau=4)": "2(p-1)/p*M/tau", "local_sgd(H=8)": "2(p-1)/p*M/H"}


def run_trial(engine: LocalEngine, number: int, cfg: TrainConfig, world: int, root: str
              ) -> TrialResult:
    engine.submit(TrialRequest(number, {}, cfg.model_dump(mode="json"), "val_accuracy", "maximize",
                               f"{root}/{number}", processes=world, cpus_per_process=1,
                               timeout=600))
    while True:
        for ev in engine.poll(None):
            if isinstance(ev, TrialResult):
                return ev


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1 epoch each (a smoke run)")
    args = ap.parse_args(argv)
    cores = machine_cores()
    worlds = [w for w in (1, 2) if w <= len(cores)]
    rows: list[dict[str, Any]] = []
    t_start = time.monotonic()
    engine = LocalEngine(gpus=[])
    n = 0
    try:
        with tempfile.TemporaryDirectory(prefix="hpoflow-bench-") as root:
            for model, mcfg in MODELS.items():
                for label, strategy, opts in STRATEGIES:
                    if model == "cnn" and label == "allreduce+fp16":
                        continue  # compression matters where communication does: the wide MLP
                    for world in worlds:
                        epochs = 1 if args.quick else mcfg["epochs"]
                        cfg = TrainConfig(**{**mcfg, "epochs": epochs}, dataset="digits",
                                          optimizer="sgd", momentum=0.9, strategy=strategy,
                                          strategy_options=opts)
                        res = run_trial(engine, n, cfg, world, root)
                        n += 1
                        m = res.metrics
                        row = {
                            "model": model, "strategy": label, "world_size": world,
                            "status": res.status, "model_bytes": m.get("model_bytes"),
                            "samples_per_s": m.get("samples_per_s"),
                            "step_time_s": m.get("step_time_s"),
                            "comm_fraction": m.get("comm_fraction"),
                            "bytes_per_step": m.get("bytes_per_step"),
                            "theory_bytes_per_step": m.get("theory_bytes_per_step"),
                            "bytes_measured": m.get("bytes_measured"),
                            "val_accuracy": m.get("val_accuracy"), "epochs": epochs,
                            "error": res.error,
                        }
                        rows.append(row)
                        print(f"{model:9s} {label:17s} p={world} {res.status:8s} "
                              f"{time.monotonic() - t_start:6.1f} s", file=sys.stderr, flush=True)
    finally:
        engine.close()
    _table(rows)
    print(json.dumps({"bench": "strategies", "cores": len(cores), "world_sizes": worlds,
                      "elapsed_s": round(time.monotonic() - t_start, 1), "rows": rows}))
    return 0 if all(r["status"] == "complete" for r in rows) else 1


def _f(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'model':9s} {'M MB':>6s} {'strategy':17s} {'p':>2s} {'samples/s':>10s} "
            f"{'step ms':>8s} {'comm %':>7s} {'sent/step':>11s} {'theory':>11s} {'ratio':>6s} "
            f"{'val acc':>7s}  theory formula (rank 0)")
    print(head)
    print("-" * len(head))
    for r in rows:
        meas, theo = r["bytes_per_step"], r["theory_bytes_per_step"]
        ratio = meas / theo if meas is not None and theo else None
        mb = None if r["model_bytes"] is None else r["model_bytes"] / 1e6
        print(f"{r['model']:9s} {_f(mb, '6.2f')} {r['strategy']:17s} {r['world_size']:2d} "
              f"{_f(r['samples_per_s'], '10.0f')} "
              f"{_f(None if r['step_time_s'] is None else 1e3 * r['step_time_s'], '8.1f')} "
              f"{_f(None if r['comm_fraction'] is None else 100 * r['comm_fraction'], '7.1f')} "
              f"{_f(meas, '11.4g')} {_f(theo, '11.4g')} {_f(ratio, '6.3f')} "
              f"{_f(r['val_accuracy'], '7.3f')}  "
              f"{FORMULA[r['strategy']] if r['world_size'] > 1 else '0 (p=1)'}")


if __name__ == "__main__":
    sys.exit(main())
