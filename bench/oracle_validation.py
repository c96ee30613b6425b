"""Validate the oracle on this machine: predicted vs measured training step time.

1. Calibrate (generic probes, see ``hpoflow.oracle.calibration``) or load ``--calibration FILE``.
2. Rounds of (measure, calibrate): each round is predicted from the calibrations just before and
   just after its measurements (geometric mean), so a drift of the shared machine's speed
   cancels to first order; the figure is each case's median ratio over the rounds.
3. For each built-in model (mlp, cnn on digits-shaped input; ``--big`` adds resnet18 on 3x32x32)
   and world size 1 and 2: run real training steps (world 2: DDP over gloo on 127.0.0.1, one
   thread per rank), take the median step time, and compare it with the oracle's prediction.
4. Print a table and, last, one JSON line with each case's ratio predicted / measured: the median
   over the rounds, the interquartile range (IQR: the middle half of the rounds) and the spread
   (lowest and highest round), and the machine's load (1-minute load average before and after,
   hypervisor steal): on a shared machine one round can land far from the rest, so the median and
   IQR are the figures to read, not a single round.

Nothing here is fitted to these measurements: the calibration measures only generic workloads.
Run: ``python bench/oracle_validation.py [--calibration FILE] [--batch-size 32] [--big]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo  # what a rank's first optimizer imports (~1 s): once, in the forkserver
import torch.distributed as dist
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table
from torch import nn

from hpoflow.oracle import ClusterSpec, Plan, calibrate, load_cluster, model_facts, predict
from hpoflow.oracle.calibration import write_cluster
from hpoflow.oracle.facts import resolve_model
from hpoflow.train.dist import destroy
from hpoflow.train.rendezvous import free_port

Case = tuple[str, tuple[int, ...] | None]
CASES: list[Case] = [("mlp", None), ("cnn", None)]
BIG: list[Case] = [("resnet18", (3, 32, 32))]


def _measure(rank: int, world: int, port: int, name: str, shape: tuple[int, ...] | None,
             batch: int, steps: int, out: str) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(rank)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
    try:
        builder, in_shape, classes, _ = resolve_model(name, shape, 10 if shape else None, {})
        model: nn.Module = builder()
        if world > 1:
            model = nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        x = torch.randn(batch, *in_shape)
        y = torch.randint(0, classes, (batch,))

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        for _ in range(5):
            step()
        inner = max(1, steps // 10)
        samples = []
        for _ in range(10):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(inner):
                step()
            samples.append((time.perf_counter() - t0) / inner)
        Path(out, f"{rank}.json").write_text(json.dumps(statistics.median(samples)))
    finally:
        destroy()  # the ranks leave together (see hpoflow.train.dist.destroy)


# What the forkserver imports once, before it forks the ranks. Named, not left to multiprocessing's
# default preload of ``__main__``: Python 3.11's forkserver never runs that (it looks for a ``main_path``
# key that the preparation data calls ``init_main_from_path``), so every rank imported torch again
# (~2.3 CPU-s each, 6 ranks a round here).
FORKSERVER_PRELOAD = ["__main__", "torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel",
                      "hpoflow.oracle.facts", "hpoflow.train.dist"]


def measured_step(name: str, shape: tuple[int, ...] | None, world: int, batch: int,
                  steps: int) -> float:
    with tempfile.TemporaryDirectory() as out:
        # forked from a forkserver that imported torch once (FORKSERVER_PRELOAD), instead of one interpreter
        # per rank and case importing torch again: the ranks measure the same steps either way
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
        mp.start_processes(_measure, args=(world, free_port(), name, shape, batch, steps, out),
                           nprocs=world, join=True, start_method="forkserver")
        return max(json.loads(Path(out, f"{r}.json").read_text()) for r in range(world))


def _cpu_ticks() -> list[int]:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return []


def _steal_fraction(a: list[int], b: list[int]) -> float | None:
    """Share of CPU time the hypervisor gave to other guests meanwhile (/proc/stat steal)."""
    if len(a) < 8 or len(b) < 8:
        return None
    delta = [y - x for x, y in zip(a, b, strict=True)]
    return round(delta[7] / sum(delta), 4) if sum(delta) else None


def _spread(values: list[float]) -> dict[str, float]:
    """Median, quartiles (IQR) and extremes of one case's per-round ratios."""
    ordered = sorted(values)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": round(statistics.median(ordered), 3), "q1": round(q1, 3), "q3": round(q3, 3),
            "iqr": round(q3 - q1, 3), "min": round(ordered[0], 3), "max": round(ordered[-1], 3)}


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _measure_all(cases: list[Case], args: argparse.Namespace, console: Console,
                 reverse: bool = False) -> dict[str, float]:
    """Measure every (case, world size); ``reverse`` runs them in the opposite order, so a drift
    of the machine within a round does not always favour the same cases."""
    runs = [(name, shape, world) for name, shape in cases for world in (1, 2)]
    out = {}
    for name, shape, world in reversed(runs) if reverse else runs:
        facts = model_facts(name, shape, 10 if shape else None)
        steps = args.steps if facts.train_flops * args.batch_size < 5e9 else 20
        console.print(f"  measuring {name} at world size {world}...")
        out[f"{name}@{world}"] = measured_step(name, shape, world, args.batch_size, steps)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibration", help="cluster YAML from `hpoflow oracle calibrate` (then one round)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=100, help="timed steps per case")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of (measure every case, calibrate), after a first calibration; each round is "
                         "predicted from the calibrations before and after it and the figure is each case's "
                         "median ratio. "
                         "This machine's speed drifts over seconds to minutes (shared cores), so a calibration "
                         "and a measurement taken minutes apart can disagree by 2x; interleaving them and "
                         "taking medians compares like with like")
    ap.add_argument("--big", action="store_true", help="add resnet18 on 3x32x32 inputs")
    args = ap.parse_args(argv)
    console = Console(stderr=True)
    rounds = 1 if args.calibration else max(1, args.rounds)
    per_case: dict[str, list[tuple[float, float, str]]] = {}
    cluster_name = ""
    cases = CASES + (BIG if args.big else [])
    steal0 = _cpu_ticks()
    load0 = _load()

    def calibration(r: int) -> ClusterSpec:
        if args.calibration:
            return load_cluster(args.calibration)
        console.print(f"calibration {r + 1}/{rounds + 1} (generic probes, 2 gloo processes on 127.0.0.1)...")
        cluster = calibrate(2)
        path = write_cluster(cluster, Path(tempfile.gettempdir(), "hpoflow-oracle-cal.yaml"))
        console.print(f"calibration written to {path}")
        return cluster

    # calibrations bracket the measurements (C0 M1 C1 M2 C2 ...) and each round's prediction is
    # the geometric mean of the predictions from the calibration before and after it: a drift of
    # the machine's speed during a round then cancels to first order
    before = calibration(0)
    for r in range(rounds):
        measured = _measure_all(cases, args, console, reverse=r % 2 == 1)
        after = before if args.calibration else calibration(r + 1)
        cluster_name = after.name
        for name, shape in cases:
            facts = model_facts(name, shape, 10 if shape else None)
            for world in (1, 2):
                plan = Plan(batch_size=args.batch_size, devices=world, optimizer="sgd", momentum=0.9)
                p0, p1 = predict(facts, before, plan), predict(facts, after, plan)
                pred = (p0.cost.step_s * p1.cost.step_s) ** 0.5
                per_case.setdefault(f"{name}@{world}", []).append((pred, measured[f"{name}@{world}"],
                                                                   p1.bottleneck))
        before = after
    steal = _steal_fraction(steal0, _cpu_ticks())
    load1 = _load()
    table = Table(title=f"oracle validation on {cluster_name} ({rounds} round(s); load {load0} -> {load1})")
    for col in ("case", "batch/rank", "predicted ms", "measured ms", "median ratio", "IQR", "spread",
                "ratios per round", "bottleneck"):
        table.add_column(col, justify="left" if col in ("case", "bottleneck", "ratios per round") else "right")
    ratios: dict[str, float] = {}
    spread: dict[str, dict[str, float]] = {}
    per_round: dict[str, list[float]] = {}
    for case, rows in per_case.items():
        each = [p / m for p, m, _ in rows]
        spread[case] = _spread(each)
        ratios[case] = spread[case]["median"]
        per_round[case] = [round(x, 3) for x in each]
        s = spread[case]
        table.add_row(case, str(args.batch_size), f"{statistics.median(p for p, _, _ in rows) * 1e3:.3f}",
                      f"{statistics.median(m for _, m, _ in rows) * 1e3:.3f}", f"{s['median']:.2f}",
                      f"{s['q1']:.2f}-{s['q3']:.2f}", f"{s['min']:.2f}-{s['max']:.2f}",
                      " ".join(f"{x:.2f}" for x in each), rows[-1][2])
    console.print(table)
    ok = all(0.75 <= r <= 1.25 for r in ratios.values())
    print(json.dumps({"ratios": ratios, "within_0.75_1.25": ok, "spread": spread, "cluster": cluster_name,
                      "rounds": rounds, "per_round": per_round,
                      "per_round_ms": {case: [[round(p * 1e3, 3), round(m * 1e3, 3)] for p, m, _ in rows]
                                       for case, rows in per_case.items()},
                      "load_average_1min": [load0, load1], "cpu_steal_fraction": steal}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
