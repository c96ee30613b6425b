"""Training functions used by tests through ``training.function: trainfns:NAME``."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from hpoflow.fileio import write_atomic
from hpoflow.train import TrialContext

# torch-free trials live with the light functions (a 1-rank trial of them starts no torch); the
# names stay here too, for the specs and requests that say trainfns:fail or trainfns:sleepy
if TYPE_CHECKING or __package__:  # imported as tests.trainfns
    from tests.trainfns_light import behave_params
    from tests.trainfns_light import fail as fail
    from tests.trainfns_light import sleepy as sleepy
else:  # as trainfns, with the tests directory on the path
    from trainfns_light import behave_params
    from trainfns_light import fail as fail
    from trainfns_light import sleepy as sleepy

CALLS = 0  # module global: must start at 0 in every trial (no state leaks between trials)


def ddp_identical(ctx: TrialContext) -> dict[str, float]:
    """Real DDP training of a small net on per-rank different data; returns how far the ranks'
    weights differ (all-gathered) and how far they moved."""
    torch.manual_seed(1234 + ctx.rank)  # different init per rank: DDP must broadcast rank 0's
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    net = DistributedDataParallel(model) if ctx.distributed else model
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(ctx.rank)  # each rank its own shard
    for _ in range(20):
        x = torch.randn(32, 8, generator=g)
        y = x.sum(1, keepdim=True)
        opt.zero_grad()
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(ctx.world_size)]
    if ctx.distributed:
        dist.all_gather(gathered, flat)
    else:
        gathered = [flat]
    spread = max(float((t - gathered[0]).abs().max()) for t in gathered)
    ctx.report(1, loss=float(loss))
    return {"loss": float(loss), "weight_spread": spread, "moved": float((flat - start).abs().max()),
            "world": float(ctx.world_size)}


def crash_rank1(ctx: TrialContext) -> float:
    """Rank 1 dies by SIGKILL mid-collective; rank 0 must not hang."""
    if ctx.rank == 1:
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 blocks here until the engine kills it
    return 1.0


def rank1_dies_rank0_errs(ctx: TrialContext) -> float:
    """Rank 1 dies by SIGKILL once rank 0 is in this function (past the process group's set-up, which
    a peer dying under it fails instead); rank 0 raises once rank 1 is gone (as its next collective
    would), having written ``erred`` just before: a test can wait until both ends are there to read at
    once."""
    pid_file = ctx.trial_dir / "pid1"
    if ctx.rank == 0:
        (ctx.trial_dir / "in0").write_text("")
    else:
        while not (ctx.trial_dir / "in0").exists():
            time.sleep(0.01)
        write_atomic(pid_file, str(os.getpid()), durable=False)
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_until_dead(pid_file)
    (ctx.trial_dir / "erred").write_text("")
    raise RuntimeError("Connection closed by peer (rank 1 is gone)")


def rank1_ends_late_rank0_errs(ctx: TrialContext) -> float:
    """Rank 1 dies by SIGKILL, but the engine learns it only 0.3 s later: a child of rank 1 keeps its
    descriptors (its pipe to the engine among them) that long, and rank 1 stops (SIGSTOP) the
    forkserver, its parent, which would report its exit, until the child resumes it (SIGCONT) and
    exits. Rank 0 raises as soon as rank 1 is dead: its error reaches the engine first (as a rank's
    "Connection closed by peer" can on a loaded machine, while its killed peer's exit is not through).
    For warm workers only (forked from the forkserver)."""
    pid_file = ctx.trial_dir / "pid1"
    if ctx.rank == 0:
        (ctx.trial_dir / "in0").write_text("")
    else:
        forkserver = os.getppid()
        if "forkserver" not in " ".join(psutil.Process(forkserver).cmdline()):
            raise RuntimeError("rank 1 is not a forkserver's child (a light worker?)")
        while not (ctx.trial_dir / "in0").exists():
            time.sleep(0.01)
        if os.fork() == 0:  # the child: holds rank 1's descriptors, then resumes the forkserver
            time.sleep(0.3)
            os.kill(forkserver, signal.SIGCONT)
            os._exit(0)
        os.kill(forkserver, signal.SIGSTOP)
        write_atomic(pid_file, str(os.getpid()), durable=False)
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_until_dead(pid_file)  # a zombie here: the forkserver that would reap it is stopped
    raise RuntimeError("Connection closed by peer (rank 1 is gone)")


def _wait_until_dead(pid_file: Path) -> None:
    """Until the process whose pid ``pid_file`` will hold is dead (a zombie, or reaped already)."""
    while not pid_file.exists():
        time.sleep(0.01)
    with contextlib.suppress(psutil.NoSuchProcess):  # gone: reaped already
        peer = psutil.Process(int(pid_file.read_text()))
        while peer.status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.01)


def hog_memory(ctx: TrialContext) -> float:
    """Holds ``options.mb`` MB of private memory (every page written) for ``options.hold_s`` seconds."""
    size = int(ctx.options["mb"]) * 2**20
    block = bytearray(size)
    block[::4096] = b"\x01" * len(range(0, size, 4096))  # write each page: calloc'd pages are not yet held
    time.sleep(float(ctx.options["hold_s"]))
    return float(len(block) > 0)


def counter(ctx: TrialContext) -> dict[str, float]:
    global CALLS
    CALLS += 1
    return {"calls": float(CALLS), "threads": float(torch.get_num_threads()),
            "seed_draw": float(torch.rand(1).item())}


def env_probe(ctx: TrialContext) -> dict[str, float]:
    path = ctx.trial_dir / f"env{ctx.rank}.txt"
    path.write_text(
        f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}\n{sorted(os.sched_getaffinity(0))}\n"
        f"{os.environ.get('OMP_NUM_THREADS')}\n"
    )
    if ctx.distributed:
        dist.barrier()
    return {"ok": 1.0}


def share_probe(ctx: TrialContext) -> dict[str, float]:
    """Four trials sharing a GPU meet: each writes ``arrived<trial>`` into ``options.meet`` and waits (up to
    ``options.wait_s``) until ``options.trials`` have arrived, so it only finishes if they all ran at once;
    then writes ``share.json`` (its GPU environment and how many it saw arrive) in its trial directory."""
    import json

    meet = Path(str(ctx.options["meet"]))
    (meet / f"arrived{ctx.trial_number}").write_text(str(time.time()))
    want, deadline = int(ctx.options.get("trials", 4)), time.monotonic() + float(ctx.options.get("wait_s", 90))
    while len(list(meet.glob("arrived*"))) < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(list(meet.glob('arrived*')))} of {want} trials ran at once")
        time.sleep(0.05)
    info: dict[str, Any] = {k: os.environ.get(k) for k in (
        "CUDA_VISIBLE_DEVICES", "HPOFLOW_GPU_SHARE", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE",
        "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")}
    info["arrived"] = len(list(meet.glob("arrived*")))
    (ctx.trial_dir / "share.json").write_text(json.dumps(info))
    return {"ok": 1.0}


def spawn_child_and_sleep(ctx: TrialContext) -> float:
    """Starts a grandchild process, then sleeps: cancel must kill both."""
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    write_atomic(ctx.trial_dir / "grandchild.pid", str(child.pid), durable=False)  # never read half-written
    time.sleep(60)
    return 1.0


def report_epochs(ctx: TrialContext) -> dict[str, Any]:
    value = float(ctx.params.get("x", 0.0))
    for step in range(1, 6):
        ctx.report(step, score=value * step)
        if ctx.should_stop():
            return {"score": value * step}
        time.sleep(0.02)
    return {"score": value * 5}


def allreduce_loop(ctx: TrialContext) -> dict[str, float]:
    """A DDP-like trial: collectives for ``options.seconds`` (a killed peer breaks them)."""
    t_end = time.monotonic() + float(ctx.options.get("seconds", 1.0))
    total = 0.0
    while True:
        # every rank agrees when to stop (the first one out of time), so all make the same number of
        # collectives: ranks that start at different moments must not stop at different steps
        go = torch.tensor([1.0 if time.monotonic() < t_end else 0.0])
        if ctx.distributed:
            dist.all_reduce(go, op=dist.ReduceOp.MIN)
        if go.item() == 0.0:
            break
        t = torch.ones(1)
        if ctx.distributed:
            dist.all_reduce(t)
        total += float(t)
        time.sleep(0.02)
    return {"score": float(ctx.params.get("x", 0.0)), "steps": total}


def prune_probe(ctx: TrialContext) -> dict[str, float]:
    """Reports every step; each rank records the step at which it learned it was pruned."""
    for step in range(1, 21):
        if ctx.distributed:
            dist.all_reduce(torch.ones(1))  # a collective per step, as in training
        ctx.report(step, score=float(step))
        if ctx.should_stop():
            (ctx.trial_dir / f"stopped{ctx.rank}.txt").write_text(str(step))
            return {"score": float(step)}
        time.sleep(0.01)
    return {"score": 20.0}


def slow_reports(ctx: TrialContext) -> dict[str, float]:
    """``options.steps`` steps of ``options.step_s`` s of sleep, each with a collective and a report (a
    pruning decision when the study prunes): a trial's steady state at almost no CPU."""
    steps, step_s = int(ctx.options.get("steps", 100)), float(ctx.options.get("step_s", 0.2))
    for step in range(1, steps + 1):
        time.sleep(step_s)
        if ctx.distributed:
            dist.all_reduce(torch.ones(1))
        ctx.report(step, loss=1.0 / step)
        if ctx.should_stop():
            break
    return {"loss": 1.0 / steps}


def behave(ctx: TrialContext) -> dict[str, float]:
    """``trainfns_light.behave`` (the engine contract's trial) on a worker that has torch: defined here,
    not imported, so that a spec's check of ``trainfns:behave`` finds it in this module's source."""
    return behave_params(ctx.params, ctx.report, ctx.rank)


def hold_group(ctx: TrialContext) -> float:
    """Holds the trial's process group for ``params['hold']`` seconds (writes its pid first), so a test
    can look at what the ranks listen on."""
    write_atomic(ctx.trial_dir / f"pid{ctx.rank}", str(os.getpid()), durable=False)
    dist.barrier()
    time.sleep(float(ctx.params.get("hold", 3.0)))
    dist.barrier()
    return 1.0


def allreduce_volume(ctx: TrialContext) -> dict[str, float]:
    """``options.steps`` all-reduces of ``options.floats`` float32 values (a known network volume)."""
    t = torch.ones(int(ctx.options["floats"]), dtype=torch.float32)
    for _ in range(int(ctx.options["steps"])):
        dist.all_reduce(t)
    return {"loss": 0.0}


def elastic_epochs(ctx: TrialContext) -> dict[str, float]:
    """An elastic user function: ``epochs`` epochs of ``work_s`` seconds, split over the ranks (more
    ranks are faster; with ``split: false`` each rank's share grows with the ranks, as when talking
    costs more than it saves: k ranks take k times as long, a margin no load can hide), a real
    all-reduce per epoch, a checkpoint at every boundary, and each epoch's world size recorded in the checkpoint and,
    at the end, in ``sizes.json``."""
    import json

    state = ctx.load_checkpoint() or {"epoch": 0, "sizes": [], "total": 0.0}
    epochs, work_s = int(ctx.options["epochs"]), float(ctx.options["work_s"])
    for epoch in range(int(state["epoch"]), epochs):
        time.sleep(work_s / ctx.world_size if ctx.options.get("split", True) else work_s * ctx.world_size)
        if ctx.attempt == 0 and ctx.rank == 1 and epoch + 1 == ctx.options.get("kill_rank1_at"):
            os._exit(9)  # a lost rank in the middle of an epoch (the first attempt only)
        t = torch.tensor([1.0])
        if ctx.distributed:
            dist.all_reduce(t)
        state = {"epoch": epoch + 1, "sizes": [*state["sizes"], ctx.world_size],
                 "total": float(state["total"]) + float(t.item()) / ctx.world_size}
        ctx.report(epoch + 1, loss=1.0 / (epoch + 1))
        ctx.save_checkpoint(state, step=epoch + 1)
        if ctx.should_stop():
            break
    if ctx.rank == 0 and not ctx.resizing:
        (ctx.trial_dir / "sizes.json").write_text(json.dumps(state["sizes"]))
    return {"loss": 1.0 / max(1, int(state["epoch"])), "epochs_done": float(state["epoch"]),
            "total": float(state["total"])}


def tensor_result(ctx: TrialContext) -> Any:
    """Returns (and reports) ``score`` as a 0-d tensor, a one-element tensor or a tensor in a dict."""
    kind = ctx.params["kind"]
    score = torch.tensor(0.25, requires_grad=True) * 1.0  # a loss-like tensor still attached to a graph
    made: Any = {"tensor0": score, "tensor1": score.reshape(1), "dict_tensor0": score,
                 "int_tensor": torch.tensor(3), "bool_tensor": torch.tensor(True)}[kind]
    if kind != "bool_tensor":
        ctx.report(1, score=made)
    return {"score": made} if kind.startswith("dict_") else made


def paced_epochs(ctx: TrialContext) -> dict[str, float]:
    """Epochs of ``options.epoch_s`` s of sleep (default 0.7 s, about one epoch of the digits CNN on the
    test machine), each ended as the built-in trainer ends one: an all-reduce across the ranks (a rank
    whose peer is gone fails there), rank 0's report of ``val_accuracy``, a checkpoint on every rank
    (``training.checkpoint``: keep, async), then ``should_stop()`` (a pause returns with that checkpoint).
    Resumes from the newest checkpoint valid on every rank and returns ``resumed_from_epoch`` as the
    built-in trainer does. For the tests of where and when trials run, stop and rerun (node loss,
    walltime, job arrays), which need epochs that take time, not CPU."""
    state = ctx.load_checkpoint()
    start = int(state["epoch"]) if state is not None else 0
    epoch_s = float(ctx.options.get("epoch_s", 0.7))
    accuracy = 0.0
    for epoch in range(start + 1, ctx.config.epochs + 1):
        time.sleep(epoch_s)
        done = torch.tensor([float(epoch)])
        if ctx.distributed:
            dist.all_reduce(done)
        accuracy = 1.0 - 1.0 / (epoch + 1.0)
        ctx.report(epoch, val_accuracy=accuracy, ranks_epochs=float(done.item()))
        ctx.save_checkpoint({"epoch": epoch}, step=epoch)
        if ctx.should_stop():
            break
    ctx.flush_checkpoints()
    return {"val_accuracy": accuracy, "resumed_from_epoch": float(ctx.resumed_step or 0)}
