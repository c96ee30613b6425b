"""``hpoflow scaling SPEC --world-sizes 1,2,4``: one configuration at several world sizes."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import yaml

__all__ = ["register"]


@dataclass(frozen=True)
class ScalingArgs:
    """The command's arguments, typed once."""

    spec: str
    world_sizes: tuple[int, ...]
    params: dict[str, Any]
    modes: tuple[str, ...]
    run_dir: str | None
    oversubscribe: bool
    as_json: bool


def _world_sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers like 1,2,4, got "
                                         f"{text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1, got {text!r}")
    return sizes


def _param(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected name=value, got {text!r}")
    return key.strip(), yaml.safe_load(value)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "scaling", help="measure throughput and scaling efficiency over world sizes",
        description="Train the spec's training with fixed parameters (the first choice or low end "
                    "of each, or --params) at several world sizes with the local engine; report "
                    "throughput, weak and strong scaling efficiency and communication fraction.")
    p.add_argument("spec", help="study spec (YAML)")
    p.add_argument("--world-sizes", type=_world_sizes, default=(1, 2), metavar="1,2,4",
                   help="world sizes to run (default 1,2)")
    p.add_argument("--params", type=_param, nargs="*", default=[], metavar="NAME=VALUE",
                   help="fix search parameters (default: first choice / low end)")
    p.add_argument("--mode", choices=["both", "weak", "strong"], default="both",
                   help="weak: per-rank batch fixed; strong: global batch fixed (default both)")
    p.add_argument("--run-dir", help="where the runs' logs go (default: a temporary directory)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more ranks than cores (ranks share cores; flagged in the output)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_run)


def _parse(ns: argparse.Namespace) -> ScalingArgs:
    modes = ("weak", "strong") if ns.mode == "both" else (ns.mode,)
    return ScalingArgs(ns.spec, tuple(ns.world_sizes), dict(ns.params), modes, ns.run_dir,
                       bool(ns.oversubscribe), bool(ns.json))


def _run(ns: argparse.Namespace) -> int:
    return run(_parse(ns))


def run(args: ScalingArgs) -> int:
    from hpoflow.scaling import ScalingPoint, run_scaling
    from hpoflow.spec import load_spec
    from hpoflow.term import console as make_console

    spec, _ = load_spec(args.spec)
    err = make_console(stderr=True)

    def progress(p: ScalingPoint) -> None:
        if not args.as_json:
            err.print(f"{p.mode} w={p.world_size}: {p.status} in {p.duration_s:.1f} s", highlight=False)

    report = run_scaling(spec, args.world_sizes, params=args.params, modes=args.modes,
                         run_dir=args.run_dir, oversubscribe=args.oversubscribe, on_point=progress)
    if args.as_json:
        print(json.dumps({"spec": args.spec, **report.to_dict()}))
    else:
        _print_table(report)
    return 0 if all(p.status == "complete" for p in report.points) else 1


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _print_table(report: Any) -> None:
    from rich.table import Table

    from hpoflow.term import console as make_console

    title = (f"scaling of strategy {report.strategy} with {report.params} "
             f"({report.machine_cores} cores)")
    table = Table(title=title)
    for col in ("mode", "ranks", "batch/rank", "global batch", "samples/s", "speedup",
                "efficiency", "step s", "comm %", "bytes/step", "val acc", "status"):
        table.add_column(col, justify="left" if col in ("mode", "status") else "right")
    for p in report.points:
        m = p.metrics
        over = " *" if len(set(p.cores)) < p.world_size else ""
        table.add_row(
            p.mode, f"{p.world_size}{over}", str(p.batch_size), str(p.global_batch),
            _fmt(m.get("samples_per_s"), ".0f"), _fmt(p.speedup, ".2f"),
            _fmt(None if p.efficiency is None else 100 * p.efficiency, ".0f") + "%",
            _fmt(m.get("step_time_s"), ".4f"),
            _fmt(None if "comm_fraction" not in m else 100 * m["comm_fraction"], ".1f"),
            _fmt(m.get("bytes_per_step"), ".3g"), _fmt(m.get("val_accuracy"), ".3f"),
            p.status if p.error is None else f"{p.status}: {p.error[:60]}",
        )
    console = make_console()
    console.print(table)
    if report.oversubscribed:
        console.print("* oversubscribed: more ranks than cores, ranks share cores; these rows "
                      "measure contention, not scaling", style="yellow")
