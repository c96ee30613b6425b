"""``hpoflow oracle``: predict a training configuration, or calibrate this machine.

    hpoflow oracle --model resnet50 --batch-size 32 --cluster p100-cluster [--devices 16]
                   [--strategy allreduce|ring|tree|ps|easgd|pipeline|zero1|fsdp] [--mtbf-hours H] [--json]
                   [--baseline SAMPLES_PER_S|RUN_DIR [--baseline-devices N]]
    hpoflow oracle calibrate [--out cluster.yaml] [--processes 2]

Arguments become typed objects (:class:`~hpoflow.oracle.model.Plan`, ``ClusterSpec``) here and
nowhere else. User errors print one line to stderr and return 2; a plan that does not fit the
device's memory prints its prediction, then the largest batch that fits, and returns 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hpoflow.oracle import CHECKPOINT_FORMATS
from hpoflow.oracle.catalog import ALGORITHMS, PRECISION_BYTES, PRESETS, STRATEGIES
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.plan import CHECKPOINTING, GRAD_DTYPES

__all__ = ["EXIT_DOES_NOT_FIT", "EXIT_USER_ERROR", "register"]

EXIT_USER_ERROR = 2
EXIT_DOES_NOT_FIT = 3  # the prediction ran: the plan does not fit the device's memory
_GIB = 2**30

_EPILOG = """worked example: ResNet-50 on ImageNet, 90 epochs, batch 32 per GPU on 64 P100s (16 nodes
of 4, NVLink inside, InfiniBand EDR between), the fastest all-reduce algorithm:

  hpoflow oracle --model resnet50 --cluster p100-cluster --devices 64 --batch-size 32

prints compute (forward, backward, optimizer), the all-reduce algorithm chosen and why, the
communication left exposed after the backward pass, step time, throughput, time to train,
memory per device (GiB) and the largest batch that fits, the speed-up and the bottleneck.
More: --precision bf16 --channels-last, --strategy ps --servers 4, --cluster my.yaml (see
docs/oracle.md), --json for one JSON object. --mtbf-hours 8760 (a node that fails once a
year) adds what a checkpoint costs and how often to take one (Young/Daly), with its overhead.
A 1.1B-parameter transformer sharded on 64 H100s:

  hpoflow oracle --model tinyllama-1.1b --strategy fsdp --param-dtype bf16 --optimizer adamw \
                 --batch-size 8 --cluster h100-cluster --devices 64

From a measurement at a small scale (Goyal et al.'s 8 P100s: 138 images/s each):

  hpoflow oracle --model resnet50 --cluster p100-cluster --devices 64 --baseline 138 --baseline-devices 8

exit codes: 0 the plan fits; 3 it does not fit the device's memory (the largest batch that
fits is printed); 2 a user error (unknown model or cluster, a bad value)."""


def _add_predict_args(p: argparse.ArgumentParser, keep_parent: bool = False) -> None:
    """The prediction options. On the ``predict`` subcommand (``keep_parent``) they default to
    nothing, so options written before it (``hpoflow oracle --model X predict``) are kept."""
    p.add_argument("--model", help="a built-in model (mlp, cnn, resnet18, resnet50, vgg16, bert-base, ...; an "
                                    "unknown name lists them all) or module:function")
    p.add_argument("--batch-size", type=int, default=32, help="samples per device (per replica "
                   "for pipeline); default 32")
    p.add_argument("--cluster", default="laptop",
                   help=f"preset ({', '.join(PRESETS)}) or cluster YAML file; default laptop")
    p.add_argument("--devices", type=int, help="devices to use (>= 1); default all of the cluster")
    p.add_argument("--strategy", choices=STRATEGIES, default="allreduce",
                   help="allreduce (default: the fastest algorithm), ring/tree (NCCL's, forced), ps, easgd, pipeline, "
                        "zero1 (optimizer state sharded), fsdp (parameters, gradients and optimizer state sharded)")
    p.add_argument("--no-reshard-after-forward", dest="reshard_after_forward", action="store_false",
                   help="fsdp: keep each unit's gathered parameters from forward to backward")
    p.add_argument("--param-dtype", choices=GRAD_DTYPES, default="fp32",
                   help="fsdp: the mixed-precision policy's param_dtype (parameters gathered and computed in it)")
    p.add_argument("--reduce-dtype", choices=GRAD_DTYPES,
                   help="fsdp: the dtype gradients are reduce-scattered in (default: --param-dtype)")
    p.add_argument("--cpu-offload", action="store_true",
                   help="fsdp: sharded parameters, gradients and optimizer state in host memory")
    p.add_argument("--activation-checkpointing", choices=CHECKPOINTING, default="none",
                   help="recompute activations in backward: full (each unit keeps its input), op (torchtitan's "
                        "selective policy); default none")
    p.add_argument("--checkpoint-interval", type=int, default=1,
                   help="full checkpointing of every k-th unit (torchtitan's selective layer); default 1")
    p.add_argument("--algorithm", choices=("auto", *ALGORITHMS), default="auto",
                   help="all-reduce algorithm of --strategy allreduce (default auto: the fastest)")
    p.add_argument("--grad-dtype", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="dtype of the gradients on the wire (fp16/bf16: DDP compression hooks); default fp32")
    p.add_argument("--bucket-mb", type=float, default=25.0,
                   help="DDP bucket_cap_mb (0: one all-reduce per parameter tensor); default 25")
    p.add_argument("--servers", type=int, default=1, help="parameter servers (ps)")
    p.add_argument("--period", type=int, default=4, help="EASGD communication period tau")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages k")
    p.add_argument("--micro-batches", type=int, help="pipeline micro-batches (default 4k)")
    p.add_argument("--optimizer", choices=("sgd", "adam", "adamw"), default="sgd")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--precision", choices=tuple(PRECISION_BYTES), default="fp32",
                   help="fp32, tf32 (fp32 storage, TF32 matrix units), fp16/bf16 (mixed precision); default fp32")
    p.add_argument("--channels-last", action="store_true",
                   help="activations in NHWC (torch.channels_last): tensor-core convolutions skip transposes")
    p.add_argument("--overlap", type=float, help="fraction of communication that can hide under the "
                   "backward pass (default: the cluster's)")
    p.add_argument("--input-shape", help="per-sample input shape, e.g. 3,224,224 (or 128)")
    p.add_argument("--classes", type=int, help="output classes")
    p.add_argument("--dataset-size", type=int,
                   help="training samples per epoch (default: the model family's, printed: ImageNet-1k for image "
                        "classifiers, SST-2 for bert-base, 20 tokens per parameter for language models)")
    p.add_argument("--epochs", type=float, help="epochs (default: the model family's, printed)")
    p.add_argument("--baseline", help="samples/s per device measured at a small scale, or a run directory whose "
                   "trials.csv has them: calibrates the device time, extrapolates the rest")
    p.add_argument("--baseline-devices", type=int, help="devices the --baseline number was measured on (default 1)")
    p.add_argument("--mtbf-hours", type=float,
                   help="a node's mean time between failures (hours): print the checkpoint cost, the Young/Daly "
                        "interval sqrt(2 x cost x MTBF) and its expected overhead")
    p.add_argument("--checkpoint-format", choices=CHECKPOINT_FORMATS, default="replica",
                   help="format priced with --mtbf-hours (training.checkpoint.format); default replica")
    p.add_argument("--checkpoint-sync", action="store_true",
                   help="price blocking saves (default: async, training.checkpoint.async's default)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    if keep_parent:
        for action in p._actions:
            if action.dest != "help":
                action.default = argparse.SUPPRESS


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``oracle`` subcommand (default: predict; ``calibrate``) to ``subparsers``."""
    oracle = subparsers.add_parser(
        "oracle", help="predict step time, time-to-train, memory and bottleneck per strategy",
        description=__doc__.splitlines()[0], epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_predict_args(oracle)
    sub = oracle.add_subparsers(dest="oracle_command", metavar="{predict,calibrate}")
    predict = sub.add_parser("predict", help="predict one configuration (the default)", epilog=_EPILOG,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_predict_args(predict, keep_parent=True)
    cal = sub.add_parser("calibrate", help="measure this machine and write a cluster YAML")
    cal.add_argument("--out", default="cluster.yaml", help="YAML to write (default cluster.yaml)")
    cal.add_argument("--processes", type=int, default=2, help="gloo processes (default 2)")
    cal.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke test)")
    oracle.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Entry of ``hpoflow oracle``; returns the exit code (2 on a user error, 3 when the plan
    does not fit)."""
    action: Callable[[argparse.Namespace], int] = (
        _calibrate if getattr(args, "oracle_command", None) == "calibrate" else _predict
    )
    try:
        return action(args)
    except OracleError as exc:
        print(f"hpoflow oracle: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


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
    from hpoflow.oracle.advice import advise
    from hpoflow.oracle.baseline import calibrate_scale, read_baseline
    from hpoflow.oracle.cluster import load_cluster
    from hpoflow.oracle.defaults import training_length
    from hpoflow.oracle.facts import model_facts
    from hpoflow.oracle.model import Plan, predict

    if not args.model:
        from hpoflow.oracle.facts import BUILTIN_MODELS

        raise OracleError(
            "hpoflow oracle needs --model, but none was given; e.g. hpoflow oracle --model "
            f"resnet50 --cluster p100-cluster (models: {', '.join(BUILTIN_MODELS)})"
        )
    for flag, value in (("--dataset-size", args.dataset_size), ("--epochs", args.epochs),
                        ("--baseline-devices", args.baseline_devices)):
        if value is not None and value <= 0:
            raise OracleError(f"{flag} must be > 0, but got {value!r}; change {flag}")
    if getattr(args, "mtbf_hours", None) is not None and not args.mtbf_hours > 0:
        raise OracleError(f"--mtbf-hours must be > 0 (a node's mean time between failures), but got "
                          f"{args.mtbf_hours}; e.g. --mtbf-hours 8760 for a node that fails once a year")
    cluster = load_cluster(args.cluster)
    plan = Plan(
        batch_size=args.batch_size, devices=args.devices, strategy=args.strategy, algorithm=args.algorithm,
        optimizer=args.optimizer, momentum=args.momentum, precision=args.precision, grad_dtype=args.grad_dtype,
        bucket_mb=args.bucket_mb, channels_last=args.channels_last, overlap=args.overlap, servers=args.servers,
        period=args.period, stages=args.stages, micro_batches=args.micro_batches,
        reshard_after_forward=args.reshard_after_forward, param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype, cpu_offload=args.cpu_offload,
        activation_checkpointing=args.activation_checkpointing, checkpoint_interval=args.checkpoint_interval,
    ).validate(cluster)  # bad values fail here, before the model is measured
    baseline = read_baseline(args.baseline, args.baseline_devices) if args.baseline else None
    shape = _shape(args.input_shape)

    def facts_for(precision: str, param_dtype: str) -> Any:
        return model_facts(args.model, shape, args.classes, precision, param_dtype=param_dtype)

    facts = facts_for(args.precision, plan.compute_dtype)
    assumed = training_length(facts)
    plan = replace(plan, dataset_size=args.dataset_size or assumed.dataset_size,
                   epochs=args.epochs or assumed.epochs)
    assumptions = {"training": assumed.why if args.dataset_size is None and args.epochs is None else
                   f"--dataset-size {plan.dataset_size:,}, --epochs {plan.epochs:g}"}
    if args.dataset_size is not None and args.epochs is None:
        assumptions["training"] = f"--dataset-size {plan.dataset_size:,}; {plan.epochs:g} epochs ({assumed.why})"
    elif args.epochs is not None and args.dataset_size is None:
        assumptions["training"] = f"{plan.dataset_size:,} samples ({assumed.why}); --epochs {plan.epochs:g}"
    if baseline is not None:
        scale = calibrate_scale(facts, cluster, plan, baseline)
        plan = replace(plan, compute_scale=scale)
        at = f" at batch {baseline.batch_size}" if baseline.batch_size else ""
        assumptions["baseline"] = (f"{baseline.samples_per_s:.4g} samples/s per device on {baseline.devices} "
                                   f"device(s){at} ({baseline.source}): device time x{scale:.3f} of the model's")
    pred = predict(facts, cluster, plan)
    advice = advise(facts, cluster, plan, pred, facts_for)
    checkpoint = _checkpoint(args, facts, cluster, plan, pred.cost.step_s)
    if args.json:
        print(json.dumps({**pred.to_dict(), "facts": facts.to_dict(), "assumptions": assumptions,
                          "advice": [a.to_dict() for a in advice],
                          **({"checkpoint": checkpoint} if checkpoint else {})}))
    else:
        _print_table(pred.to_dict(), facts.to_dict(), assumptions, [a.to_dict() for a in advice])
        if checkpoint:
            _print_checkpoint(checkpoint, pred.to_dict())
    if not pred.fits:
        print(f"hpoflow oracle: does not fit: batch {plan.batch_size} per device needs "
              f"{pred.memory_per_device_bytes / _GIB:.2f} GiB of the {pred.memory_available_bytes / _GIB:.2f} GiB "
              f"of a {cluster.device.name}; the largest batch that fits is {pred.max_batch_per_device} "
              f"(--batch-size {pred.max_batch_per_device})", file=sys.stderr)
        return EXIT_DOES_NOT_FIT
    return 0


def _checkpoint(args: argparse.Namespace, facts: Any, cluster: Any, plan: Any, step_s: float) -> dict[str, Any]:
    """The checkpoint cost and the Young/Daly advice (``--mtbf-hours``), or {} without it."""
    if getattr(args, "mtbf_hours", None) is None:
        return {}
    from hpoflow.oracle import advise, checkpoint_cost

    cost = checkpoint_cost(facts, cluster, plan.devices, plan.optimizer, plan.momentum,
                           getattr(args, "checkpoint_format", "replica"), not getattr(args, "checkpoint_sync", False))
    return {**cost.to_dict(), **advise(cost, args.mtbf_hours, step_s).to_dict()}


def _print_checkpoint(c: dict[str, Any], p: dict[str, Any]) -> None:
    from rich.table import Table

    from hpoflow.term import console as make_console

    mode = "async" if c["async_save"] else "blocking"
    t = Table(title=f"checkpoints: {c['format']} ({mode}) on {c['filesystem']}, node MTBF "
                    f"{c['node_mtbf_s'] / 3600:g} h")
    t.add_column("quantity")
    t.add_column("value", justify="right", overflow="fold", max_width=90)
    rows = [
        ("state (weights + optimizer)", f"{c['state_bytes'] / 1e9:.3f} GB"),
        ("written per checkpoint", f"{c['bytes_written'] / 1e9:.3f} GB by {c['writers']} writer(s)"),
        ("on disk after", _fmt_time(c["write_s"])),
        ("training waits per checkpoint", _fmt_time(c["blocking_s"])),
        ("restart reads it in", _fmt_time(c["restore_s"])),
        ("job MTBF", f"{_fmt_time(c['job_mtbf_s'])} ({c['nodes']} node(s))"),
        ("checkpoint every (Young/Daly)", f"{_fmt_time(c['interval_s'])} = {c['interval_steps']:.0f} steps = "
                                          f"{c['interval_s'] / p['epoch_s']:.3g} epochs" if p["fits"] else
         _fmt_time(c["interval_s"])),
        ("expected overhead", f"{c['overhead']:.3%} of the run (checkpoints {c['overhead_checkpoints']:.3%}, "
                              f"work redone and restarts after failures {c['overhead_failures']:.3%})"),
    ]
    for name, value in rows:
        t.add_row(name, value)
    make_console().print(t)


def _fmt_time(s: float) -> str:
    if s >= 3600:
        return f"{s / 3600:.2f} h"
    if s >= 60:
        return f"{s / 60:.1f} min"
    if s >= 1:
        return f"{s:.2f} s"
    return f"{s * 1e3:.3f} ms"


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n:.0f} B"


def _comm_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    algorithms = ", ".join(f"{a} {_fmt_time(c)}" for a, c in sorted(p["algorithm_costs"].items(), key=lambda x: x[1]))
    sharded = p["strategy"] in ("zero1", "fsdp")
    rows = []
    if (p["algorithm"] and not sharded) or p["strategy"] == "zero1":
        rows += [("all-reduce", f"{p['algorithm']}, {p['collectives']} bucket(s)"), ("why", p["algorithm_note"])]
    if p["strategy"] == "fsdp":
        rows.append(("collectives", f"{p['collectives']} all-gathers and reduce-scatters (ring), prefetched one "
                                    "unit ahead"))
    if len(p["algorithm_costs"]) > 1:
        rows.append(("all-reduce algorithms (per step)", algorithms))
    rows += [("communication per step", f"{_fmt_time(p['comm_s'])}; sent per device {_fmt_bytes(p['bytes_per_step'])}"
              + (f", per node across the network {_fmt_bytes(p['network_bytes_per_node'])}"
                 if p["network_bytes_per_node"] else "")
              + (f" (network shared: bandwidth / {p['congestion']:.3g})" if p["congestion"] > 1 else "")),
             ("exposed after the backward pass", _fmt_time(p["exposed_comm_s"]))]
    return rows


def _memory_rows(p: dict[str, Any]) -> list[tuple[str, str]]:
    mem, fits = p["memory"], p["fits"]
    gathered = mem.get("gathered_params", 0.0) + mem.get("gathered_grads", 0.0)
    return [
        ("memory per device", f"{p['memory_per_device_bytes'] / _GIB:.2f} of "
                              f"{p['memory_available_bytes'] / _GIB:.2f} GiB" + ("" if fits else "  DOES NOT FIT")),
        ("  of which", f"activations {mem['activations'] / _GIB:.2f}, weights+grads+buckets "
                       f"{(mem['weights'] + mem['gradients'] + mem['ddp_buckets']) / _GIB:.2f}, optimizer "
                       f"{mem['optimizer_state'] / _GIB:.2f}"
                       + (f", gathered units {gathered / _GIB:.2f}" if gathered else "")
                       + f", allocator+reserved {(mem['allocator'] + mem['reserved']) / _GIB:.2f} GiB"),
        *([("  at start-up", f"{mem['startup'] / _GIB:.2f} GiB (the model built and wrapped), more than the "
                             f"step's {mem['step'] / _GIB:.2f} GiB")] if mem.get("startup", 0.0) > mem.get("step", 0.0)
          else []),
        ("largest batch that fits", str(p["max_batch_per_device"])),
    ]


def _print_table(p: dict[str, Any], f: dict[str, Any], assumptions: dict[str, str],
                 advice: list[dict[str, Any]]) -> None:
    from rich.table import Table
    from rich.text import Text

    from hpoflow.term import console as make_console

    t = Table(title=f"{p['model']} on {p['cluster']}: {p['strategy']}, {p['devices']} devices "
                    f"({p['nodes']} nodes), batch {p['batch_per_device']}/device")
    t.add_column("quantity")
    t.add_column("value", justify="right", overflow="fold", max_width=90)
    fits = p["fits"]
    unfit = "(does not fit in memory)"
    tokens = int(f.get("tokens_per_sample") or 1)
    per_token = f" ({p['throughput'] * tokens / p['devices']:,.0f} tokens/s per device)" if tokens > 1 else ""
    rows = [
        ("parameters", f"{f['params'] / 1e6:.2f} M"),
        ("forward per sample", f"{f['forward_macs'] / 1e9:.3f} GMACs "
                               f"({f['forward_flops'] / 1e9:.3f} GFLOPs)"),
        ("compute per step", f"{_fmt_time(p['compute_s'])} (forward {_fmt_time(p['forward_s'])}, backward "
                             f"{_fmt_time(p['backward_s'])}, optimizer {_fmt_time(p['optimizer_s'])}"
                             + (f", recomputed {_fmt_time(p['recompute_s'])}" if p.get("recompute_s") else "") + ")"),
        *_comm_rows(p),
        *([("wait for the slowest device", _fmt_time(p["sync_wait_s"]))] if p.get("sync_wait_s") else []),
        *([("wait for the input pipeline", _fmt_time(p["loader_wait_s"]))] if p.get("loader_wait_s") else []),
        ("step time", _fmt_time(p["step_s"]) if fits else unfit),
        ("throughput", f"{p['throughput']:.1f} samples/s{per_token}" if fits else unfit),
        ("epoch", _fmt_time(p["epoch_s"]) if fits else unfit),
        ("time to train", _fmt_time(p["time_to_train_s"]) if fits else unfit),
        *_memory_rows(p),
        ("speed-up (weak scaling)", f"{p['speedup']:.1f}x, efficiency "
                                    f"{p['scaling_efficiency']:.0%}"),
        ("bottleneck", p["bottleneck"]),
        ("max speed-up (global batch fixed)", f"{p['max_speedup']:.1f}x at "
                                              f"{p['max_speedup_devices']} devices"),
        ("90% of it reached at", f"{p['useful_devices']} devices"),
        *((f"assumed: {k}", v) for k, v in assumptions.items()),
        *(("advice" if i == 0 else "", f"{a['change']}: " + ("fits; " if not fits else "")
           + f"{a['gain']:+.0%} samples/s ({a['why']})") for i, a in enumerate(advice[:4])),
    ]
    for name, value in rows:
        t.add_row(Text(name), Text(value))  # plain text: values may contain brackets
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
