"""``hpoflow oracle``: predict a training configuration, or calibrate this machine.

    hpoflow oracle --model resnet50 --batch-size 32 --cluster p100-cluster [--devices 16]
                   [--strategy ring|tree|ps|easgd|pipeline] [--json]
    hpoflow oracle calibrate [--out cluster.yaml] [--processes 2]

Arguments become typed objects (:class:`~hpoflow.oracle.model.Plan`, ``ClusterSpec``) here and
nowhere else. User errors print one line to stderr and return 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from hpoflow.oracle.catalog import PRECISION_BYTES, PRESETS, STRATEGIES
from hpoflow.oracle.errors import OracleError

__all__ = ["EXIT_DOES_NOT_FIT", "register"]

EXIT_DOES_NOT_FIT = 3  # the prediction ran: the plan does not fit the device's memory

_EXAMPLE = """example (ResNet-50, ImageNet, 90 epochs, batch 32 per GPU on 256 P100s in 32 nodes of 8):
  hpoflow oracle --model resnet50 --cluster p100-cluster --devices 256 --batch-size 32 --epochs 90
  hpoflow oracle --model resnet50 --cluster p100-cluster --batch-size 256 --json   # too big: exit 3

exit codes: 0 the plan fits; 3 it does not fit the device's memory (the largest batch that fits is
printed); 2 a user error (unknown model, bad value)."""


def _add_predict_args(p: argparse.ArgumentParser, keep_parent: bool = False) -> None:
    """The prediction options; on the ``predict`` subcommand (``keep_parent``) they default to nothing,
    so options written before ``predict`` (``hpoflow oracle --model X predict``) are kept."""
    p.add_argument("--model", help="a built-in model (mlp, cnn, resnet18, resnet50, vgg16, bert-base, ...; an "
                                    "unknown name lists them all) or module:function")
    p.add_argument("--batch-size", type=int, default=32, help="samples per device (per replica "
                   "for pipeline); default 32")
    p.add_argument("--cluster", default="laptop",
                   help=f"preset ({', '.join(PRESETS)}) or cluster YAML file; default laptop")
    p.add_argument("--devices", type=int, help="devices to use; default all of the cluster")
    p.add_argument("--strategy", choices=STRATEGIES, default="ring")
    p.add_argument("--servers", type=int, default=1, help="parameter servers (ps, easgd)")
    p.add_argument("--period", type=int, default=4, help="EASGD communication period tau")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages k")
    p.add_argument("--micro-batches", type=int, help="pipeline micro-batches (default 4k)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--precision", choices=tuple(PRECISION_BYTES), default="fp32")
    p.add_argument("--overlap", type=float, help="fraction of backward hiding communication "
                   "(default: the cluster's)")
    p.add_argument("--input-shape", help="per-sample input shape, e.g. 3,224,224 (or 128)")
    p.add_argument("--classes", type=int, help="output classes")
    p.add_argument("--dataset-size", type=int, default=1_281_167,
                   help="training samples per epoch (default: ImageNet-1k 1,281,167)")
    p.add_argument("--epochs", type=float, default=90.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    if keep_parent:
        for action in p._actions:
            if action.dest != "help":
                action.default = argparse.SUPPRESS

def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``oracle`` subcommand (default: predict; ``calibrate``) to ``subparsers``."""
    oracle = subparsers.add_parser(
        "oracle", help="predict step time, time-to-train, memory and bottleneck per strategy",
        description=__doc__.splitlines()[0], epilog=_EXAMPLE, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_predict_args(oracle)
    sub = oracle.add_subparsers(dest="oracle_command", metavar="{predict,calibrate}")
    predict = sub.add_parser("predict", help="predict one configuration (the default)", epilog=_EXAMPLE,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_predict_args(predict, keep_parent=True)
    cal = sub.add_parser("calibrate", help="measure this machine and write a cluster YAML")
    cal.add_argument("--out", default="cluster.yaml", help="YAML to write (default cluster.yaml)")
    cal.add_argument("--processes", type=int, default=2, help="gloo processes (default 2)")
    cal.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke test)")
    oracle.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry of ``hpoflow oracle``; returns the exit code (2 on a user error)."""
    action: Callable[[argparse.Namespace], int] = (
        _calibrate if getattr(args, "oracle_command", None) == "calibrate" else _predict
    )
    try:
        return action(args)
    except OracleError as exc:
        print(f"hpoflow oracle: error: {exc}", file=sys.stderr)
        return 2


def _shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(",") if part.strip())
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise OracleError(
            f"--input-shape must be positive integers separated by commas, but got {text!r}; "
            "e.g. --input-shape 3,224,224"
        )
    return shape


def _predict(args: argparse.Namespace) -> int:
    from hpoflow.oracle.cluster import load_cluster
    from hpoflow.oracle.facts import model_facts
    from hpoflow.oracle.model import Plan, predict

    if not args.model:
        from hpoflow.oracle.facts import BUILTIN_MODELS

        raise OracleError(
            "hpoflow oracle needs --model, but none was given; e.g. hpoflow oracle --model "
            f"resnet50 --cluster p100-cluster (models: {', '.join(BUILTIN_MODELS)})"
        )
    cluster = load_cluster(args.cluster)
    facts = model_facts(args.model, _shape(args.input_shape), args.classes, args.precision)
    plan = Plan(
        batch_size=args.batch_size, devices=args.devices, strategy=args.strategy,
        optimizer=args.optimizer, momentum=args.momentum, precision=args.precision,
        overlap=args.overlap, servers=args.servers, period=args.period, stages=args.stages,
        micro_batches=args.micro_batches, dataset_size=args.dataset_size, epochs=args.epochs,
    )
    pred = predict(facts, cluster, plan)
    if args.json:
        print(json.dumps({**pred.to_dict(), "facts": facts.to_dict()}))
    else:
        _print_table(pred.to_dict(), facts.to_dict())
    if not pred.fits:
        print(f"hpoflow oracle: batch {plan.batch_size} per device does not fit the device's memory "
              f"({pred.memory_per_device_bytes / 2**30:.2f} GiB needed, {pred.memory_available_bytes / 2**30:.2f} GiB "
              f"available); the largest batch that fits is {pred.max_batch_per_device}", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def _fmt_time(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3f} ms"


def _print_table(p: dict[str, Any], f: dict[str, Any]) -> None:
    from rich.table import Table

    from hpoflow.term import console as make_console

    t = Table(title=f"{p['model']} on {p['cluster']}: {p['strategy']}, {p['devices']} devices "
                    f"({p['nodes']} nodes), batch {p['batch_per_device']}/device")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    rows = [
        ("parameters", f"{f['params'] / 1e6:.2f} M"),
        ("forward per sample", f"{f['forward_macs'] / 1e9:.3f} GMACs "
                               f"({f['forward_flops'] / 1e9:.3f} GFLOPs)"),
        ("compute per step", _fmt_time(p["compute_s"])),
        ("communication per step", _fmt_time(p["comm_s"])),
        ("exposed communication", _fmt_time(p["exposed_comm_s"])),
        *([("wait for the slowest device", _fmt_time(p["sync_wait_s"]))] if p.get("sync_wait_s") else []),
        ("step time", _fmt_time(p["step_s"])),
        ("throughput", f"{p['throughput']:.1f} samples/s"),
        ("epoch", _fmt_time(p["epoch_s"])),
        ("time to train", _fmt_time(p["time_to_train_s"])),
        ("memory per device", f"{p['memory_per_device_bytes'] / 2**30:.2f} of "
                              f"{p['memory_available_bytes'] / 2**30:.2f} GiB"),
        ("largest batch that fits", str(p["max_batch_per_device"])),
        ("speed-up (weak scaling)", f"{p['speedup']:.1f}x, efficiency "
                                    f"{p['scaling_efficiency']:.0%}"),
        ("bottleneck", p["bottleneck"]),
        ("max speed-up (global batch fixed)", f"{p['max_speedup']:.1f}x at "
                                              f"{p['max_speedup_devices']} devices"),
        ("90% of it reached at", f"{p['useful_devices']} devices"),
    ]
    for name, value in rows:
        t.add_row(name, value)
    make_console().print(t)


def _calibrate(args: argparse.Namespace) -> int:
    from hpoflow.oracle.calibration import calibrate, write_cluster

    spec = calibrate(args.processes, scale=0.3 if args.quick else 1.0)
    path = write_cluster(spec, args.out)
    dev = spec.device
    print(f"wrote {path}: {dev.peak_flops['fp32'] / 1e9:.1f} GFLOP/s peak per process, "
          f"all-reduce alpha {spec.intra_node.latency * 1e6:.0f} us, "
          f"bandwidth {spec.intra_node.bandwidth / 1e6:.0f} MB/s")
    return 0
