"""The checkpoint study: format x model x world size, measured in real trials, and modelled on a cluster.

Formats: hpoflow's ``replica`` (every rank writes its whole state), ``rank0`` (rank 0 writes it once),
``dcp`` (``torch.distributed.checkpoint``: written once, split over the ranks) and ``safetensors``.
Models, each trained data-parallel (DDP over gloo, the local engine's warm workers, 1 thread per rank)
on fixed batches: the built-in digits CNN (Adam, batch 64 per rank, digits), ResNet-18 and ResNet-50
(SGD with momentum, batch 8 per rank of 3x64x64 images: the checkpoint does not depend on the image
size), a BERT-base-sized encoder (AdamW, batch 4 per rank of 32 tokens); the ResNets and BERT are
``hpoflow.oracle._zoo``'s definitions (torchvision is not a dependency). World sizes 1, 2 and 4 (on a
2-core machine 4 ranks share the cores: two per core).

Per trial (one model, one world size), after ``--warmup`` steps and ``--plain`` steps timed without
checkpoints (``step s``, the median), for each format in turn (after one untimed save of a tiny state:
imports and DCP's process group are one-time costs), at one step ``s``:

* **blocking save**: the save with ``async: false``, until it is on disk (the slowest rank's);
* **bytes**: every file of that checkpoint (every rank's);
* **async save**: the save with ``async: true`` (``dcp``: PyTorch's ``async_save``), then ``--every``
  (N) training steps, then the wait for the write: what training sees is the save call, the N steps'
  time beyond N plain steps (the writer competes for the cores and the GIL), and the final wait;
* **restore**: a fresh model and optimizer load the blocking checkpoint (``latest``, with every check,
  and ``load_state_dict``; the slowest rank's);
* **bitwise**: the restored copy trains the same N steps (same batches, RNG states restored) as the live
  one did after step ``s``: are the weights bitwise equal on every rank?

Overhead (a fraction of training time) for a checkpoint every N steps: cost / (N x step); every epoch:
cost / epoch, an epoch being the digits training set for the CNN (23, 12, 6 steps at 1, 2, 4 ranks)
and ``--epoch-steps`` steps for the others (the async cost over an epoch counts the final wait only as
far as the write outlasts the epoch).

Modelled (``hpoflow.oracle._checkpoint``): the same checkpoint on this machine (the laptop preset with
this directory's file system measured), and on ``--cluster`` at ``--cluster-devices`` GPUs: the time
to write it, what training waits (async: the staging copy), and the Young/Daly interval and overhead
at a node MTBF of ``--mtbf-hours``.

    python bench/checkpoint_study.py [--quick] [--models cnn,resnet18,resnet50,bert-base]
                                     [--worlds 1,2,4] [--formats replica,rank0,dcp,safetensors]

The last line is one JSON object: ``rows`` (one per model, world size and format), ``machine``,
``filesystem`` (measured) and ``cluster``.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import BENCH, emit

FORMATS = ("replica", "rank0", "dcp", "safetensors")
MODELS = ("cnn", "resnet18", "resnet50", "bert-base")
# per model: optimizer (the oracle's name), its lr, batch per rank, and the per-sample input
SETUP: dict[str, dict[str, Any]] = {
    "cnn": {"optimizer": "adam", "lr": 3e-3, "batch": 64},
    "resnet18": {"optimizer": "sgd", "lr": 0.1, "batch": 8, "shape": (3, 64, 64)},
    "resnet50": {"optimizer": "sgd", "lr": 0.1, "batch": 8, "shape": (3, 64, 64)},
    "bert-base": {"optimizer": "adamw", "lr": 1e-4, "batch": 4, "shape": (32,)},
}


# -- inside the trial (every rank) -----------------------------------------------------------------------
def _build(name: str, seed: int) -> tuple[Any, Any, Any]:
    """(model, optimizer factory, batch(step, rank) -> (x, y)) of one study model."""
    import torch

    torch.manual_seed(seed)
    setup = SETUP[name]
    if name == "cnn":
        from hpoflow.train.data import load_dataset
        from hpoflow.train.models import build_model

        data = load_dataset("digits", 0.2)
        model = build_model("cnn", data.input_shape, data.n_classes)
        n = len(data.x_train)

        def batch(step: int, rank: int, world: int) -> tuple[Any, Any]:
            b = setup["batch"]
            idx = (torch.arange(b) + (step * world + rank) * b) % n
            return data.x_train[idx], data.y_train[idx]
    else:
        from hpoflow.oracle._zoo import ZOO

        entry = ZOO[name]
        classes = entry.n_classes
        model = entry.builder(setup["shape"], classes)

        def batch(step: int, rank: int, world: int) -> tuple[Any, Any]:
            g = torch.Generator().manual_seed(1_000_003 * step + rank)
            b = setup["batch"]
            if entry.token_input:
                x = torch.randint(0, 30522, (b, *setup["shape"]), generator=g)
            else:
                x = torch.randn((b, *setup["shape"]), generator=g)
            return x, torch.randint(0, classes, (b,), generator=g)

    def optimizer(params: Any) -> Any:
        if setup["optimizer"] == "sgd":
            return torch.optim.SGD(params, lr=setup["lr"], momentum=0.9, weight_decay=1e-4)
        cls = torch.optim.AdamW if setup["optimizer"] == "adamw" else torch.optim.Adam
        return cls(params, lr=setup["lr"])

    return model, optimizer, batch


def _state(model: Any, opt: Any, step: int) -> dict[str, Any]:
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}


def measure(ctx: Any) -> dict[str, float]:
    """The trial function (``training.function: checkpoint_study:measure``); ``ctx.options``: model,
    formats, warmup, plain, every."""
    import hashlib

    import torch
    import torch.distributed as dist
    from torch import nn

    from hpoflow.train.checkpoint import capture_rng, make_checkpointer, restore_rng

    o = ctx.options
    distributed = ctx.distributed
    world = ctx.world_size if distributed else 1
    rank = ctx.rank if distributed else 0

    def slowest(x: float) -> float:
        if not distributed:
            return x
        t = torch.tensor([x], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def everywhere(ok: bool) -> bool:
        if not distributed:
            return ok
        t = torch.tensor([1 if ok else 0])
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def barrier() -> None:
        if distributed:
            dist.barrier()

    def gather(mine: list[int]) -> list[list[int]]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, mine)
        return [list(x) for x in out]

    def wrap(m: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(m) if distributed else m

    def digest(m: nn.Module) -> str:
        h = hashlib.sha256()
        for k, v in m.state_dict().items():
            h.update(k.encode())
            h.update(v.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    model, make_opt, batch = _build(o["model"], seed=0)
    net, opt = wrap(model), make_opt(model.parameters())

    def train(m: nn.Module, optimizer: Any, step: int) -> None:
        x, y = batch(step, rank, world)
        nn.functional.cross_entropy(m(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # no gradients held between steps (nor while saving)

    step = 0
    for _ in range(o["warmup"]):
        train(net, opt, step)
        step += 1
    plain = []
    for _ in range(o["plain"]):
        barrier()
        t0 = time.perf_counter()
        train(net, opt, step)
        plain.append(slowest(time.perf_counter() - t0))
        step += 1
    step_s = statistics.median(plain)
    out: dict[str, float] = {"step_s": step_s}
    every = int(o["every"])
    root = Path(o["directory"])
    for fmt in o["formats"]:
        kw = {"rank": rank, "world_size": world, "keep": 1}
        sync = make_checkpointer(fmt, {}, root / f"{fmt}-sync", background=False, **kw)
        later = make_checkpointer(fmt, {}, root / f"{fmt}-async", background=True, **kw)
        for cp in (sync, later):  # one-time costs out of the way (imports, DCP's process group)
            cp.save({"warm": torch.zeros(1)}, step - 1)
            cp.wait()

        barrier()
        t0 = time.perf_counter()
        sync.save(_state(model, opt, step), step, {"rng": capture_rng()})
        sync.wait()
        blocking = slowest(time.perf_counter() - t0)
        barrier()
        size = sum(p.stat().st_size for p in sync.step_files(step)) if rank == 0 else 0
        barrier()
        t0 = time.perf_counter()
        later.save(_state(model, opt, step), step, {"rng": capture_rng()})
        call = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(every):
            train(net, opt, step + 1 + i)
        steps_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        later.wait()
        waited = time.perf_counter() - t0
        slowdown = max(0.0, steps_s - every * step_s)
        seen = slowest(call + slowdown + waited)
        call, slowdown, waited = slowest(call), slowest(slowdown), slowest(waited)
        live = digest(model)
        del net, opt, model  # the restored copy goes on in their place (memory: one model at a time)
        # a fresh model and optimizer, restored from the blocking checkpoint, replay the same steps
        fresh, _, _ = _build(o["model"], seed=1)
        fresh_opt = make_opt(fresh.parameters())
        barrier()
        t0 = time.perf_counter()
        reader = make_checkpointer(fmt, {}, root / f"{fmt}-sync", background=False, **kw)
        found = reader.latest(gather if distributed else None)
        if found is None:
            raise RuntimeError(f"{fmt}: the checkpoint of step {step} was not found")
        fresh.load_state_dict(found[1]["model"])
        fresh_opt.load_state_dict(found[1]["optimizer"])
        restore = slowest(time.perf_counter() - t0)
        restore_rng(found[1]["rng"])
        del found
        model, opt, net = fresh, fresh_opt, wrap(fresh)
        for i in range(every):
            train(net, opt, step + 1 + i)
        bitwise = everywhere(digest(model) == live)
        for cp in (sync, later, reader):
            cp.close()
        out.update({f"{fmt}.bytes": float(size), f"{fmt}.blocking_s": blocking, f"{fmt}.async_call_s": call,
                    f"{fmt}.async_slowdown_s": slowdown, f"{fmt}.async_wait_s": waited,
                    f"{fmt}.async_seen_s": seen, f"{fmt}.restore_s": restore, f"{fmt}.bitwise": float(bitwise),
                    f"{fmt}.errors": float(sync.errors + later.errors)})
        barrier()
        if rank == 0:
            for d in (root / f"{fmt}-sync", root / f"{fmt}-async"):
                shutil.rmtree(d, ignore_errors=True)
        step += every
    return out


# -- the driver ---------------------------------------------------------------------------------------------
def _state_bytes(name: str) -> tuple[int, Any]:
    from hpoflow.oracle.facts import model_facts, optimizer_state_bytes

    shape = SETUP[name].get("shape")
    facts = model_facts(name, None if name != "bert-base" else (128,))
    opt = "adam" if SETUP[name]["optimizer"] in ("adam", "adamw") else "sgd"
    return facts.param_bytes + optimizer_state_bytes(facts.params, opt, 0.9), (facts, opt, shape)


def _enough_memory(name: str, world: int) -> tuple[bool, float]:
    """Whether ``world`` ranks of ``name`` fit in the available memory: per rank the weights, their
    gradients, DDP's buckets and the optimizer's state, and a copy of the state while it is saved or
    loaded (a BERT-base rank peaked at 2.85 x its state: 3.76 GB; the kernel's OOM killer ended a run of
    4 such ranks with 18 GB available)."""
    import psutil

    state, _ = _state_bytes(name)
    need = world * 3.0 * state + 1e9
    return need < psutil.virtual_memory().available, need


def _epoch_steps(name: str, world: int, epoch_steps: int) -> int:
    if name == "cnn":
        return -(-1437 // (SETUP["cnn"]["batch"] * world))  # the digits training set
    return epoch_steps


def _row(name: str, world: int, fmt: str, m: dict[str, float], every: int, epoch_steps: int) -> dict[str, Any]:
    step_s = m["step_s"]
    blocking, seen = m[f"{fmt}.blocking_s"], m[f"{fmt}.async_seen_s"]
    epoch = _epoch_steps(name, world, epoch_steps)
    # over an epoch the async write has (epoch - N) more steps to finish in the background
    seen_epoch = seen - min(m[f"{fmt}.async_wait_s"], max(0, epoch - every) * step_s)
    return {
        "model": name, "world": world, "format": fmt, "bytes": int(m[f"{fmt}.bytes"]), "step_s": step_s,
        "blocking_s": blocking, "async_call_s": m[f"{fmt}.async_call_s"], "async_seen_s": seen,
        "async_wait_s": m[f"{fmt}.async_wait_s"], "restore_s": m[f"{fmt}.restore_s"],
        "epoch_steps": epoch, "every": every,
        "overhead_epoch_sync": blocking / (epoch * step_s),
        "overhead_epoch_async": max(0.0, seen_epoch) / (epoch * step_s),
        "overhead_every_sync": blocking / (every * step_s), "overhead_every_async": seen / (every * step_s),
        "bitwise": bool(m[f"{fmt}.bitwise"]), "errors": int(m[f"{fmt}.errors"]),
    }


def _modelled(rows: list[dict[str, Any]], fs: dict[str, Any], cluster_name: str, devices: int,
              mtbf_hours: float) -> dict[str, Any]:
    """Add the oracle's columns to ``rows``: this machine, and ``cluster_name`` at ``devices``."""
    from hpoflow.oracle._checkpoint import advise, checkpoint_cost, filesystem_of
    from hpoflow.oracle.catalog import PRESETS
    from hpoflow.oracle.cluster import load_cluster

    here = load_cluster({**PRESETS["laptop"], "name": "this machine", "filesystem": fs})
    cluster = load_cluster(cluster_name)
    for r in rows:
        state, (facts, opt, _) = _state_bytes(r["model"])
        mine = checkpoint_cost(facts, here, r["world"], opt, 0.9, r["format"], async_save=False)
        far = checkpoint_cost(facts, cluster, devices, opt, 0.9, r["format"], async_save=True)
        advice = advise(far, mtbf_hours, step_s=1.0)
        r.update({"state_bytes": state, "model_blocking_s": mine.blocking_s, "cluster_write_s": far.write_s,
                  "cluster_blocking_s": far.blocking_s, "cluster_interval_s": advice.interval_s,
                  "cluster_overhead": advice.overhead})
    return {"name": cluster.name, "devices": devices, "mtbf_hours": mtbf_hours,
            "filesystem": filesystem_of(cluster).name}


def _machine() -> dict[str, Any]:
    import psutil
    import torch

    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": len(os.sched_getaffinity(0)),
            "memory_gb": round(psutil.virtual_memory().total / 1e9, 1), "python": platform.python_version(),
            "torch": torch.__version__, "os": platform.platform()}


def _table(rows: list[dict[str, Any]], skipped: list[str]) -> None:
    head = (f"{'model':<10}{'W':>2} {'format':<12}{'MB':>8}{'step s':>8}{'save s':>8}{'async s':>8}"
            f"{'restore':>8}{'ovh/ep s':>9}{'ovh/ep a':>9}{'ovh/N s':>8}{'ovh/N a':>8}{'bitwise':>8}"
            f"{'model s':>8}{'clus w s':>9}{'clus a s':>9}{'YD min':>7}{'YD ovh':>7}")
    print(head)
    for r in rows:
        print(f"{r['model']:<10}{r['world']:>2} {r['format']:<12}{r['bytes'] / 1e6:>8.1f}{r['step_s']:>8.3f}"
              f"{r['blocking_s']:>8.3f}{r['async_seen_s']:>8.3f}{r['restore_s']:>8.3f}"
              f"{r['overhead_epoch_sync']:>9.2%}{r['overhead_epoch_async']:>9.2%}{r['overhead_every_sync']:>8.1%}"
              f"{r['overhead_every_async']:>8.1%}{'yes' if r['bitwise'] else 'no':>8}"
              f"{r.get('model_blocking_s', float('nan')):>8.3f}{r.get('cluster_write_s', float('nan')):>9.3f}"
              f"{r.get('cluster_blocking_s', float('nan')):>9.4f}{r.get('cluster_interval_s', float('nan')) / 60:>7.1f}"
              f"{r.get('cluster_overhead', float('nan')):>7.2%}")
    for s in skipped:
        print(f"skipped: {s}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the CNN at 1 and 2 ranks, few steps (a smoke test)")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--worlds", default="1,2,4")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--plain", type=int, default=5, help="steps timed without checkpoints")
    ap.add_argument("--every", type=int, default=10, help="N: steps after the async save (and replayed)")
    ap.add_argument("--epoch-steps", type=int, default=100, help="an epoch of the ResNets and BERT, in steps")
    ap.add_argument("--cluster", default="v100-cluster")
    ap.add_argument("--cluster-devices", type=int, default=64)
    ap.add_argument("--mtbf-hours", type=float, default=8760.0, help="a node's MTBF for the Young/Daly column")
    ap.add_argument("--dir", default=None, help="where the checkpoints go (default: a temporary directory)")
    args = ap.parse_args()
    models = ["cnn"] if args.quick else [m for m in args.models.split(",") if m]
    worlds = [1, 2] if args.quick else [int(w) for w in args.worlds.split(",")]
    formats = [f for f in args.formats.split(",") if f]
    warmup, plain, every = (1, 2, 3) if args.quick else (args.warmup, args.plain, args.every)
    unknown = sorted(set(models) - set(MODELS)) + sorted(set(formats) - set(FORMATS))
    if unknown:
        raise SystemExit(f"unknown model or format {unknown}; models: {', '.join(MODELS)}; formats: "
                         f"{', '.join(FORMATS)}")

    from hpoflow.engines.local import LocalEngine
    from hpoflow.engines.machine import machine_cores
    from hpoflow.oracle._filesystem import measure_filesystem
    from hpoflow.spec import TrainConfig
    from hpoflow.trial import TrialRequest, TrialResult

    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="hpoflow-ckpt-study-"))
    fs = measure_filesystem(base / "fs-probe", size=(16 if args.quick else 256) << 20, repeats=1 if args.quick else 3)
    cores = machine_cores()
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    t_start = time.time()
    try:
        number = 0
        for name in models:
            for world in worlds:
                fits, need = _enough_memory(name, world)
                if not fits:
                    skipped.append(f"{name} on {world} ranks: needs ~{need / 1e9:.0f} GB of memory")
                    continue
                # a fresh engine per trial (fresh worker processes: no memory left over from a bigger
                # model); more ranks than cores share them (core ids repeated: two ranks per core)
                engine = LocalEngine(cores=[cores[i % len(cores)] for i in range(world)])
                trial_dir = base / f"{name}-w{world}"
                options = {"model": name, "formats": formats, "warmup": warmup, "plain": plain, "every": every,
                           "directory": str(trial_dir / "ck")}
                train = TrainConfig(function="checkpoint_study:measure", options=options).model_dump(mode="json")
                req = TrialRequest(number=number, params={}, train=train, metric="step_s", direction="minimize",
                                   trial_dir=str(trial_dir), processes=world, timeout=7200,
                                   python_path=(str(BENCH),))
                number += 1
                t0 = time.time()
                try:
                    engine.submit(req)
                    res = None
                    while res is None:
                        res = next((e for e in engine.poll(None) if isinstance(e, TrialResult)), None)
                finally:
                    engine.close()
                if res.status != "complete":  # e.g. a rank killed by the OOM killer: say so, go on
                    skipped.append(f"{name} on {world} ranks: {res.status}: {res.error}")
                    print(f"# {name} on {world} rank(s): {res.status}: {res.error}\n{res.stderr_tail}", flush=True)
                    shutil.rmtree(trial_dir, ignore_errors=True)
                    continue
                for fmt in formats:
                    rows.append(_row(name, world, fmt, res.metrics, every, args.epoch_steps))
                print(f"# {name} on {world} rank(s): {time.time() - t0:.0f} s", flush=True)
                shutil.rmtree(trial_dir, ignore_errors=True)
    finally:
        if not args.dir:
            shutil.rmtree(base, ignore_errors=True)
    cluster = _modelled(rows, fs, args.cluster, args.cluster_devices, args.mtbf_hours)
    machine = _machine()
    print(f"machine: {machine['cpu']}, {machine['cores']} cores, {machine['memory_gb']} GB, torch "
          f"{machine['torch']}; checkpoints on a file system measured at {fs['bandwidth'] / 1e6:.0f} MB/s "
          f"(write + fsync, one process); {time.time() - t_start:.0f} s in all")
    print(f"N = {every} steps; epoch: digits for the CNN, {args.epoch_steps} steps for the others; modelled: "
          f"this machine ('model s', blocking), {cluster['name']} at {cluster['devices']} GPUs on "
          f"{cluster['filesystem']} ('clus w s' written, 'clus a s' async wait), Young/Daly at node MTBF "
          f"{args.mtbf_hours:g} h")
    _table(rows, skipped)
    emit({"rows": rows, "skipped": skipped, "machine": machine, "filesystem": fs, "cluster": cluster,
          "every": every, "epoch_steps": args.epoch_steps, "quick": args.quick})


if __name__ == "__main__":
    main()
