"""Calibrate the oracle on this machine: measure the quantities the model uses, write a spec.

``processes`` worker processes (forked from the local engine's forkserver, one thread each, so one
process is one "device") form a real gloo group on 127.0.0.1. Rank 0 measures alone, then all ranks
together:

* sustained FLOP/s of a square fp32 matmul (the device's peak) and of a linear-layer and a
  3x3-convolution training workload (the ``efficiency`` and ``conv_efficiency`` of that peak);
* memory bandwidth (a large tensor copy);
* overheads of tiny training steps: per step, per dispatched ATen operator (from two probe
  networks of different depth) and per parameter tensor in ``optimizer.step``;
* the fixed cost of a convolution layer (a 1-channel 4x4 convolution probe);
* a size-dependent convolution efficiency table: forward + backward of single 3x3 convolutions
  on a fixed grid of sizes (about 6e4 to 8e8 training FLOPs per call), each timed alone,
  minus its operator overheads, as a fraction of the matmul peak (a convolution's fixed cost
  stays in its efficiency);
* a cost per element of memory-bound layers (:data:`LAYER_KINDS`: ReLU, GELU, pooling,
  normalisation, dropout) on :data:`ELEMENT_GRID` sizes, forward + backward;
* the cost per parameter of ``optimizer.step`` for SGD, SGD with momentum and Adam;
* the ``contention``: compute slow-down when every rank of the node is busy (alone and
  together alternated);
* the communication DDP adds to a step (DDP step minus plain step of one linear layer with
  64 B to 4 MiB of gradients), fitted to the ring model 2(p-1) alpha + 2(p-1)/p M / B with
  least squares on relative error: alpha and B as DDP over gloo actually sees them;
* the ``sync_wait`` table: how much longer that cost gets after a longer backward pass.

The probe workloads are generic (fixed sizes, not the user's model), so predictions made with the
result are predictions, not fits. Medians of repeated timings, paired where two timings are
subtracted; every process group is destroyed in ``finally`` (the ranks leave together).
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import yaml
from torch import nn
from torch.multiprocessing import ProcessRaisedException, start_processes  # type: ignore[attr-defined]
from torch.utils.flop_counter import FlopCounterMode

from hpoflow.fileio import write_atomic
from hpoflow.oracle._filesystem import measure_filesystem
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.facts import OpCounter, count_step_ops
from hpoflow.train.dist import destroy
from hpoflow.train.rendezvous import free_port

__all__ = ["calibrate", "timed", "write_cluster"]


def timed(fn: Callable[[], Any], repeats: int, warmup: int = 2, inner: int = 1) -> float:
    """Median seconds of one call of ``fn`` over ``repeats`` timings of ``inner`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def _train_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                opt: torch.optim.Optimizer) -> Callable[[], None]:
    def step() -> None:
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return step


def step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    """FLOPs of one training step's forward and backward (as autograd runs them) on ``x``."""
    with FlopCounterMode(display=False) as counter:
        nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def _probe_compute(scale: float) -> dict[str, float]:
    reps = max(3, int(7 * scale))
    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    matmul = 2 * n**3 / timed(lambda: a @ b, reps, inner=4)
    # training workloads, priced by the FLOPs their steps run (the first layer computes no
    # gradient of its input: 2 x its forward, the next 3 x)
    lin = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    x, y = torch.randn(64, 256), torch.randint(0, 256, (64,))
    t = timed(_train_step(lin, x, y, _sgd(lin)), reps, inner=4)
    linear = step_flops(lin, x, y) / t
    conv = nn.Sequential(nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                         nn.Linear(32 * 16 * 16, 10))
    xc, yc = torch.randn(32, 16, 16, 16), torch.randint(0, 10, (32,))
    t = timed(_train_step(conv, xc, yc, _sgd(conv)), reps, inner=2)
    convolution = step_flops(conv, xc, yc) / t
    big = torch.empty(8 * 2**20)
    dst = torch.empty_like(big)
    bandwidth = 2 * big.numel() * 4 / timed(lambda: dst.copy_(big), reps, inner=2)
    return {"matmul": matmul, "linear": linear, "conv": convolution, "mem_bw": bandwidth}


def _probe_net(depth: int) -> nn.Module:
    return nn.Sequential(*(nn.Linear(4, 4) for _ in range(depth)))


def _probe_overheads(scale: float) -> dict[str, float]:
    reps = max(5, int(15 * scale))
    x, y = torch.randn(4, 4), torch.randint(0, 4, (4,))
    times, ops, tensors = [], [], []
    for depth in (1, 24):
        net = _probe_net(depth)
        times.append(timed(_train_step(net, x, y, _sgd(net)), reps, inner=20))
        ops.append(count_step_ops(net, x, 4))
        tensors.append(len(list(net.parameters())))
    many = _probe_net(48)
    opt = _sgd(many)
    for p in many.parameters():
        p.grad = torch.zeros_like(p)

    def opt_only() -> None:
        opt.step()
        opt.zero_grad(set_to_none=False)
    per_tensor = timed(opt_only, reps, inner=10) / len(list(many.parameters()))
    per_op = max(0.0, (times[1] - times[0] - (tensors[1] - tensors[0]) * per_tensor)
                 / (ops[1] - ops[0]))
    step = max(0.0, times[0] - ops[0] * per_op - tensors[0] * per_tensor)
    conv = _probe_conv_call(scale, per_op, per_tensor)
    return {"per_op_s": per_op, "per_param_tensor_s": per_tensor, "step_s": step,
            "per_conv_s": conv}


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """y = a + c x minimising the squared *relative* error; a, c clipped at 0."""
    pts = [(1 / y**2, x, y) for x, y in zip(xs, ys, strict=True)]
    sw, sx = sum(w for w, _, _ in pts), sum(w * x for w, x, _ in pts)
    sxx = sum(w * x * x for w, x, _ in pts)
    sy, sxy = sum(w * y for w, _, y in pts), sum(w * x * y for w, x, y in pts)
    det = sw * sxx - sx * sx
    c = max(0.0, (sw * sxy - sx * sy) / det) if det else 0.0
    return max(0.0, (sy - c * sx) / sw), c


# DDP's cost is timed over this many consecutive steps, as training runs them: right after a
# barrier the ranks enter the all-reduce together and a step costs less (on 2 shared cores about
# 0.7 ms against 1.7 ms in steady state, where a rank that is ahead waits in gloo while its peer
# computes), so a short run after a barrier under-measures what training sees.
_STEADY_STEPS = 12


def _paired_ddp_cost(plain_step: Callable[[], None], ddp_step: Callable[[], None], first: bool,
                     inner: int = _STEADY_STEPS) -> tuple[float, float]:
    """(plain step seconds, DDP step minus plain step) timed back to back, each after a barrier
    (with warm-up steps when ``first``), each the mean of ``inner`` consecutive steps."""
    warmup = 2 if first else 0
    dist.barrier()
    plain = timed(plain_step, 1, warmup=warmup, inner=inner)
    dist.barrier()
    return plain, timed(ddp_step, 1, warmup=warmup, inner=inner) - plain


def _probe_comm(scale: float, world: int) -> dict[str, float]:
    """Time DDP steps of one bias-free n x n linear layer minus the same step without DDP, for
    gradients of 64 B to 4 MiB, and fit the alpha-beta ring model to that exposed cost."""
    reps = max(5, int(11 * scale))
    sizes, costs = [], []
    for n in (4, 64, 128, 256, 512, 1024):
        x, y = torch.randn(4, n), torch.randint(0, n, (4,))
        plain_net = nn.Linear(n, n, bias=False)
        plain_step = _train_step(plain_net, x, y, _sgd(plain_net))
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(n, n, bias=False))
        ddp_step = _train_step(ddp, x, y, _sgd(ddp))
        # plain and DDP timings alternate, so a drift of the machine's speed hits both; the
        # figure is the median of the paired differences
        diffs = [_paired_ddp_cost(plain_step, ddp_step, r == 0)[1] for r in range(reps)]
        sizes.append(4.0 * n * n)
        costs.append(max(statistics.median(diffs), 1e-6))
    fixed, per_byte = _fit_line(sizes, costs)
    hops = 2 * (world - 1)
    bandwidth = 2 * (world - 1) / world / per_byte if per_byte > 0 else 1e12
    return {"alpha": fixed / hops, "bandwidth": bandwidth}


def _probe_conv_call(scale: float, per_op: float, per_tensor: float) -> float:
    """Fixed cost of one convolution layer (forward + backward) beyond generic operators."""
    reps = max(5, int(15 * scale))
    x = torch.randn(4, 1, 4, 4)
    y = torch.randint(0, 4, (4,))
    nets = [nn.Sequential(nn.Flatten(), nn.Linear(16, 4)),
            nn.Sequential(nn.Conv2d(1, 1, 3, padding=1), nn.Flatten(), nn.Linear(16, 4))]
    t, ops, tensors = [], [], []
    for net in nets:
        t.append(timed(_train_step(net, x, y, _sgd(net)), reps, inner=20))
        ops.append(count_step_ops(net, x, 4))
        tensors.append(len(list(net.parameters())))
    extra = (ops[1] - ops[0]) * per_op + (tensors[1] - tensors[0]) * per_tensor
    return max(0.0, t[1] - t[0] - extra)


# the generic conv probe grid (not the sizes of any validated model): (batch, c_in, c_out, side) of a
# 3x3 same-padded convolution; training FLOPs per call 6 x batch x c_in x c_out x 9 x side^2 (about
# 6e4 ... 1.4e9).
# Channel counts from 16 up are powers of two, as in nearly every CNN: oneDNN computes in blocks
# of 16 channels on AVX-512 (8 on AVX2), so 24 channels run at about (24/32)^2 of the efficiency
# of 16 or 32 (measured here: 0.52 against 0.63-0.92), a loss such networks never pay
CONV_GRID = ((4, 2, 4, 6), (8, 4, 8, 10), (16, 16, 16, 12), (16, 32, 32, 14), (32, 32, 64, 20))
_MIN_EFF = 1e-4


def _auto_timed(fn: Callable[[], Any], repeats: int, target_s: float = 2e-3) -> float:
    """Like :func:`timed`, with ``inner`` chosen so one timing lasts about ``target_s``."""
    once = timed(fn, 3, warmup=2)
    return timed(fn, repeats, warmup=1, inner=max(1, min(200, int(target_s / max(once, 1e-7)))))


def _call_time(layer: nn.Module, x: torch.Tensor, reps: int, per_op: float) -> float:
    """Seconds of one forward + backward call of ``layer`` on ``x`` (input needing its gradient,
    as for an inner layer), timed alone, minus its operator dispatch overheads."""
    x = x.requires_grad_(True)
    grad = torch.randn_like(layer(x).detach())
    params = list(layer.parameters())

    def step() -> None:
        x.grad = None
        for p in params:
            p.grad = None
        layer(x).backward(grad)
    counter = OpCounter()
    with counter:
        step()
    return _auto_timed(step, reps) - counter.count * per_op


def _layer_efficiency(layer: nn.Module, x: torch.Tensor, reps: int, peak: float,
                      fixed_s: float, per_op: float) -> tuple[float, float]:
    """(training FLOPs of one call, efficiency) of ``layer`` on ``x``: :func:`_call_time` minus
    ``fixed_s``, as a fraction of ``peak``."""
    flops = FlopCounterMode(display=False)
    with flops:
        layer(x)
    work = 3.0 * flops.get_total_flops()
    rest = _call_time(layer, x, reps, per_op) - fixed_s
    eff = work / (peak * rest) if rest > 0 else 1.0
    return work, min(1.0, max(_MIN_EFF, eff))


def _probe_tables(scale: float, peak: float, per_op: float) -> dict[str, list[tuple[float, float]]]:
    reps = max(3, int(7 * scale))
    # the fixed cost of a convolution call stays in its efficiency: a priced conv layer adds no
    # separate per_conv_s in the model (see hpoflow.oracle.model)
    conv = [_layer_efficiency(nn.Conv2d(ci, co, 3, padding=1), torch.randn(b, ci, s, s), reps, peak,
                              0.0, per_op) for b, ci, co, s in CONV_GRID]
    # No linear table is calibrated: in validation a linear table over-predicted the small MLP (ratio
    # 1.2-1.5 where the single linear efficiency gives ~0.8); see docs/oracle.md section 7. The model
    # still prices a "linear" table given in a cluster YAML.
    return {"conv": sorted(conv)}


# generic memory-bound layers, each timed forward + backward on (batch, channels, side, side)
# inputs of ELEMENT_GRID (1e3 ... 1e6 elements per call); keys are lower-case class names, as in
# ModelFacts.other_layers
LAYER_KINDS: dict[str, Callable[[int, int], nn.Module]] = {
    "relu": lambda c, s: nn.ReLU(),
    "gelu": lambda c, s: nn.GELU(),
    "maxpool2d": lambda c, s: nn.MaxPool2d(2),
    "avgpool2d": lambda c, s: nn.AvgPool2d(2),
    "batchnorm2d": lambda c, s: nn.BatchNorm2d(c),
    "layernorm": lambda c, s: nn.LayerNorm(s),
    "dropout": lambda c, s: nn.Dropout(0.1),
}
ELEMENT_GRID = ((4, 4, 8), (8, 8, 16), (16, 16, 24), (32, 32, 32))
_MIN_ELEMENT_S = 1e-13


def _probe_layer_costs(scale: float, per_op: float) -> dict[str, list[tuple[float, float]]]:
    """Seconds per input element of each :data:`LAYER_KINDS` layer (forward + backward, input
    needing its gradient, minus operator overheads) on each :data:`ELEMENT_GRID` size."""
    reps = max(3, int(7 * scale))
    out: dict[str, list[tuple[float, float]]] = {}
    for kind, make in LAYER_KINDS.items():
        rows = []
        for b, c, side in ELEMENT_GRID:
            x = torch.randn(b, c, side, side)
            rest = _call_time(make(c, side).train(), x, reps, per_op)
            rows.append((float(x.numel()), max(_MIN_ELEMENT_S, rest / x.numel())))
        out[kind] = sorted(rows)
    return out


def _probe_optimizer(scale: float, per_tensor: float) -> dict[str, float]:
    """Seconds per parameter of ``optimizer.step`` for SGD, SGD with momentum and Adam, on four
    parameter tensors of 2^18 elements (minus the per-tensor overhead)."""
    reps = max(3, int(7 * scale))
    out = {}
    makers: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]] = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
        "momentum": lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3),
    }
    for key, make in makers.items():
        params: list[torch.Tensor] = [nn.Parameter(torch.randn(1 << 18)) for _ in range(4)]
        for p in params:
            p.grad = torch.randn_like(p)
        opt = make(params)
        t = _auto_timed(opt.step, reps)
        out[key] = max(0.0, (t - 4 * per_tensor) / (4 << 18))
    return out


def _contention_workloads() -> list[Callable[[], Any]]:
    """Generic compute of about a millisecond each: a 256^3 matmul, a linear and a 3x3-conv
    training step."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    lin = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256))
    conv = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(16 * 8 * 8, 10))
    return [lambda: a @ b,
            _train_step(lin, torch.randn(32, 256), torch.randint(0, 256, (32,)), _sgd(lin)),
            _train_step(conv, torch.randn(16, 8, 16, 16), torch.randint(0, 10, (16,)), _sgd(conv))]


def _probe_contention(scale: float, rank: int) -> float:
    """Compute slow-down when every rank of the node computes at once: rank 0 times each
    workload alone (the others wait in a barrier), then every rank times it together, in
    alternation, so a drift of the machine's speed hits both sides; the median of the
    busy / alone ratios (at least 1)."""
    rounds = max(3, int(5 * scale))
    ratios = []
    for _ in range(rounds):
        for work in _contention_workloads():
            dist.barrier()
            alone = _auto_timed(work, 5) if rank == 0 else 0.0
            dist.barrier()
            busy = _auto_timed(work, 5)
            if rank == 0:
                ratios.append(busy / alone)
    return max(1.0, statistics.median(ratios)) if ratios else 1.0


class _GradThenCompute(nn.Module):
    """One bias-free n x n linear layer, then ``k`` parameter-free (64 x n) @ (n x n) + tanh
    layers: the compute of a step grows with k while its gradients stay n x n floats, and (as
    in a real network, whose first layer's gradient comes last) the gradients are complete only
    at the end of the backward pass, so DDP's all-reduce cannot start before it."""

    def __init__(self, k: int, n: int) -> None:
        super().__init__()
        self.k, self.fixed = k, torch.randn(n, n) / n**0.5  # a plain tensor: DDP never syncs it
        self.fc = nn.Linear(n, n, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc(x)
        for _ in range(self.k):
            x = torch.tanh(x @ self.fixed)
        return x


def _probe_sync_wait(scale: float, world: int) -> list[tuple[float, float]]:
    """How much longer DDP's gradient all-reduce takes after a longer backward pass.

    :class:`_GradThenCompute` with 256 KiB of gradients and k = 0, 2, 8, 32 compute layers
    (about 0.3 to 15 ms of compute): the DDP step minus the plain step is the exposed cost of
    DDP; beyond its value at k = 0 (what the communication probe measured) it is the wait. Each
    repetition times every k back to back (plain, then DDP), so a drift of the machine's speed
    hits them alike; the table holds, per k, (median plain step time, median of the paired
    extra costs, at least 0). Empty on a group of one.
    """
    if world < 2:
        return []
    reps = max(5, int(20 * scale))
    n = 256
    x, y = torch.randn(64, n), torch.randint(0, n, (64,))
    steps = []
    for k in (0, 2, 8, 32):
        plain_net = _GradThenCompute(k, n)
        ddp = nn.parallel.DistributedDataParallel(_GradThenCompute(k, n))
        steps.append((_train_step(plain_net, x, y, _sgd(plain_net)), _train_step(ddp, x, y, _sgd(ddp))))
    plains: list[list[float]] = [[] for _ in steps]
    extras: list[list[float]] = [[] for _ in steps]
    for r in range(reps):
        costs = []
        for i, (plain_step, ddp_step) in enumerate(steps):
            t, cost = _paired_ddp_cost(plain_step, ddp_step, r == 0)
            costs.append(cost)
            plains[i].append(t)
        for i, c in enumerate(costs):
            extras[i].append(c - costs[0])
    return sorted((statistics.median(t), max(0.0, statistics.median(e))) for t, e in zip(plains, extras, strict=True))


def _worker(rank: int, world: int, port: int, out_dir: str, scale: float) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    result: dict[str, Any] = {}
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                                rank=rank, world_size=world)
    try:
        if rank == 0:  # alone: the figures of one busy device
            result.update(_probe_compute(scale))
            result.update(_probe_overheads(scale))
            tables = _probe_tables(scale, result["matmul"], result["per_op_s"])
            layer_cost = _probe_layer_costs(scale, result["per_op_s"])
            optimizer = _probe_optimizer(scale, result["per_param_tensor_s"])
            Path(out_dir, "tables.json").write_text(json.dumps(
                {"efficiency": tables, "layer_cost": layer_cost, "optimizer": optimizer}))
        if world > 1:
            result["contention"] = _probe_contention(scale, rank)
            dist.barrier()
            result.update(_probe_comm(scale, world))
            result["sync_wait"] = _probe_sync_wait(scale, world)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    finally:
        destroy()  # collects the probes' DDP reducers, then the ranks leave together


def _start_ranks(processes: int, port: int, out_dir: str, scale: float) -> None:
    """Run ``_worker`` in ``processes`` ranks and wait for them all (an error in one raises torch's
    ``ProcessRaisedException`` here). The ranks fork from the local engine's forkserver, preloading what
    the engine's does (torch and its lazy imports: ``use_engine_preload``), started as the engine starts
    it (``ensure_forkserver``: SIGINT blocked, as ``hpoflow.oracle.precheck`` starts its service); a
    spawned rank was a fresh interpreter importing torch again (~1.5 CPU-s each)."""
    from hpoflow.engines.local import ensure_forkserver, use_engine_preload

    use_engine_preload()
    ensure_forkserver()
    start_processes(_worker, args=(processes, port, out_dir, scale), nprocs=processes, join=True,
                    start_method="forkserver")


def _machine_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError):
        return 8e9


def calibrate(processes: int = 2, scale: float = 1.0) -> ClusterSpec:
    """Measure this machine with ``processes`` single-thread ranks; return its cluster spec.

    ``scale`` multiplies the number of repetitions (0.2 for a quick smoke test).
    """
    if processes < 1:
        raise OracleError(f"processes must be >= 1, but got {processes}; use 2 on a laptop")
    with tempfile.TemporaryDirectory(prefix="hpoflow-calibrate-") as out:
        try:
            _start_ranks(processes, free_port(), out, scale)
        except ProcessRaisedException as exc:
            raise OracleError(
                f"calibration with {processes} gloo processes on 127.0.0.1 failed: "
                f"{str(exc).strip().splitlines()[-1]}; try --processes 1 to skip communication"
            ) from exc
        m = json.loads(Path(out, "rank0.json").read_text())
        tables = json.loads(Path(out, "tables.json").read_text())
        filesystem = measure_filesystem(Path(out), size=max(16, int(256 * scale)) << 20)
    loop = {"name": "loopback gloo (measured)", "bandwidth": m.get("bandwidth", 1e9),
            "latency": m.get("alpha", 0.0),
            "source": "measured: DDP step minus plain step, 64 B to 4 MiB of gradients, "
                      "alpha-beta fit" if processes > 1 else
            "not measured (1 process); placeholder"}
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    spec = {
        "name": f"calibrated-{socket.gethostname()}",
        "nodes": 1,
        "devices_per_node": processes,
        "device": {
            "name": "this machine, one thread per process",
            "peak_flops": {"fp32": m["matmul"]},
            "memory_bytes": _machine_memory() / processes,
            "memory_bandwidth": m["mem_bw"],
            "efficiency": min(1.0, m["linear"] / m["matmul"]),
            "conv_efficiency": min(1.0, m["conv"] / m["matmul"]),
            "efficiency_table": {k: [tuple(r) for r in v] for k, v in tables["efficiency"].items()},
            "layer_cost": {k: [tuple(r) for r in v] for k, v in tables["layer_cost"].items()},
            "contention": m.get("contention", 1.0),
            "source": f"measured by hpoflow oracle calibrate on {when}: 512^3 matmul peak, "
                      "linear and 3x3-conv training probes, 32 MiB copy, "
                      "3x3-conv layers of several sizes (efficiency_table)",
        },
        "intra_node": loop,
        "inter_node": loop,
        # CPU ranks: gloo's thread competes with backward for the same cores, so no hiding
        "overlap": 0.0,
        "backend": "gloo",
        # the wait for the slower rank is the measured sync_wait table; gloo's fixed cost per
        # collective is inside the measured alpha
        "overheads": {"collective_s": 0.0, "step_jitter": 0.0, "step_s": m["step_s"], "per_op_s": m["per_op_s"],
                      "per_param_tensor_s": m["per_param_tensor_s"],
                      "per_conv_s": m["per_conv_s"],
                      "optimizer_per_param_s": tables["optimizer"],
                      "sync_wait": [tuple(r) for r in m.get("sync_wait", [])]},
        "filesystem": filesystem,  # the temporary directory's: checkpoints elsewhere may differ
        "source": f"hpoflow oracle calibrate, {processes} process(es), {when}",
    }
    return ClusterSpec.model_validate(spec)


def write_cluster(spec: ClusterSpec, path: str | Path) -> Path:
    """Write ``spec`` as YAML that :func:`~hpoflow.oracle.cluster.load_cluster` reads back."""
    target = Path(path)
    write_atomic(target, yaml.safe_dump(spec.model_dump(), sort_keys=False))
    return target
