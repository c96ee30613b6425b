"""Training functions that do not import torch at module level (for the local engine's light workers)."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import sys
import time
from typing import Any


def torch_probe(ctx: Any) -> dict[str, float]:
    """Whether torch and NumPy were loaded before this function ran; then a draw from NumPy's global
    generator, a draw from torch's and torch's thread count (each seeded, and torch's threads set, by
    the runner the moment the library is imported)."""
    loaded_before = "torch" in sys.modules
    numpy_before = "numpy" in sys.modules
    np = importlib.import_module("numpy")
    np_draw = float(np.random.rand())
    torch = importlib.import_module("torch")  # a name no source shows: hpoflow cannot tell it needs torch

    return {"value": 0.0, "torch_was_loaded": float(loaded_before), "draw": float(torch.rand(1).item()),
            "threads": float(torch.get_num_threads()), "numpy_was_loaded": float(numpy_before),
            "np_draw": np_draw}


def forkservers_seen(ctx: Any) -> dict[str, float]:
    """How many forkservers the driver runs while this trial does (on a light worker: the driver's child,
    so its parent), and whether torch was loaded in this worker."""
    import psutil

    n = 0
    for p in psutil.Process(os.getppid()).children(recursive=True):
        with contextlib.suppress(psutil.Error):  # (a process that ended meanwhile)
            n += "multiprocessing.forkserver" in " ".join(p.cmdline())
    return {"value": float(n), "torch_was_loaded": float("torch" in sys.modules)}


def sim_cost(params: dict[str, Any], number: int) -> dict[str, Any]:
    """A cost model for the simulated engine: longer for larger x, the metric rising to 1 - x."""
    x = float(params["x"])
    return {"duration_s": 10.0 + 100.0 * x, "val_accuracy": 1.0 - x,
            "curve": [(1.0 - x) * k / 4 for k in range(1, 5)]}


def fail(ctx: Any) -> float:
    print("about to fail", flush=True)
    raise ValueError("boom from user code")


def sleepy(ctx: Any) -> float:
    time.sleep(float(ctx.options.get("seconds", 30)))
    return 1.0


def costly(ctx: Any) -> dict[str, float]:
    """Reports a learning curve and returns cost measurements like the built-in trainer's."""
    import time

    x = float(ctx.params["x"])
    for epoch in range(1, 4):
        ctx.report(epoch, value=x * epoch / 3)
        if ctx.should_stop():
            return {"value": x * epoch / 3}
        time.sleep(0.02)
    return {"value": x, "samples_per_s": 1000.0 * (1 + x), "step_time_s": 0.01 / (1 + x), "comm_fraction": 0.1 * x}


def slow(ctx: Any) -> dict[str, float]:
    """Returns ``params['x']`` after ``options['sleep']`` seconds (default 0.5), printing a line a step
    (so its rank log grows), and reporting each step; for studies a test disturbs while they run."""
    import time

    x = float(ctx.params["x"])
    steps = int(ctx.options.get("steps", 5))
    for step in range(steps):
        print(f"step {step} of trial {ctx.trial_number}", flush=True)
        ctx.report(step, value=x * (step + 1) / steps)
        time.sleep(float(ctx.options.get("sleep", 0.5)) / steps)
    return {"value": x}


def environment(ctx: Any) -> dict[str, float]:
    """Writes what this rank's process can see of credentials to ``trial_dir/seen<rank>.json``: its own
    environment, and the environment and command line of every ancestor process it may read."""
    import json
    import os
    from pathlib import Path

    seen: dict[str, Any] = {"environ": dict(os.environ), "ancestors": {}}
    pid = os.getppid()
    while pid > 1:
        entry: dict[str, str] = {}
        for what in ("environ", "cmdline"):
            try:
                entry[what] = Path(f"/proc/{pid}/{what}").read_bytes().decode(errors="replace")
            except OSError as exc:
                entry[what] = f"<{exc.strerror}>"
        seen["ancestors"][str(pid)] = entry
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    (Path(ctx.trial_dir) / f"seen{ctx.rank}.json").write_text(json.dumps(seen))
    return {"value": float(ctx.params.get("x", 0.0))}


def fills_the_disk(ctx: Any) -> dict[str, float]:
    """Trial ``options['at']`` fills the run directory's file system (``RUN_DIR/filler``, until it is
    full), prints, and sleeps ``options['hold']`` s (default: ``sleep``); the others sleep
    ``options['sleep']`` s. Returns ``params['x']``."""
    import time
    from pathlib import Path

    if ctx.trial_number == int(ctx.options.get("at", 2)):
        with open(Path(ctx.trial_dir).parent.parent / "filler", "ab") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        for _ in range(100):
            print("x" * 1000, flush=True)
        time.sleep(float(ctx.options.get("hold", ctx.options.get("sleep", 0.2))))
    else:
        time.sleep(float(ctx.options.get("sleep", 0.2)))
    return {"value": float(ctx.params["x"])}


def real_types(ctx: Any) -> Any:
    """Returns (and reports) its ``score`` as the number type ``ctx.params["kind"]`` names, directly or
    in a dict: NumPy scalars, Fraction, Decimal, and a bool (which is not a metric)."""
    import decimal
    import fractions

    import numpy as np

    kind = ctx.params["kind"]
    x = 0.25
    made: Any = {"float32": np.float32(x), "int64": np.int64(3), "float16": np.float16(x), "uint8": np.uint8(3),
                 "ndarray0": np.array(x), "fraction": fractions.Fraction(1, 4), "decimal": decimal.Decimal("0.25"),
                 "bool": True, "numpy_bool": np.bool_(True)}[kind.removeprefix("dict_")]
    if not kind.endswith("bool"):
        ctx.report(1, score=made, other=np.float64(1.5))
    return {"score": made, "note": "strings are not metrics"} if kind.startswith("dict_") else made


def sim_cost_real_types(params: dict[str, Any], number: int) -> dict[str, Any]:
    """A function cost model answering in NumPy and Fraction numbers."""
    import fractions

    import numpy as np

    x = float(params["x"])
    return {"duration_s": np.float32(10.0 + 100.0 * x),
            "val_accuracy": fractions.Fraction(1, 2) + fractions.Fraction(x) / 4, "steps": np.int64(7),
            "curve": [np.float32((1.0 - x) * k / 4) for k in range(1, 5)]}


def odd_metric_name(ctx: Any) -> dict[str, float]:
    """Returns a metric whose name holds an escape sequence (it would reach the terminal and trials.csv)."""
    return {"score": 1.0, "x\x1b[2J": 2.0}



def nap(ctx: Any) -> dict[str, float]:
    """A quick trial for studies shared by several drivers: sleeps ``options.seconds`` (default 0.3) and
    returns ``1 - (x - 0.5)^2``."""
    import time

    x = float(ctx.params["x"])
    time.sleep(float(ctx.options.get("seconds", 0.3)))
    return {"value": 1.0 - (x - 0.5) ** 2}


def energy_nap(ctx: Any) -> dict[str, float]:
    """Sleeps 0.1 + 0.6 * x seconds (the energy a counter sees grows with x) and returns ``1 - x``: lower
    values cost more energy, a trade-off for a study that minimises both."""
    import time

    x = float(ctx.params["x"])
    time.sleep(0.1 + 0.6 * x)
    return {"value": 1.0 - x}


def site_probe(ctx: Any) -> dict[str, float]:
    """Writes ``probe<rank>.json`` in the trial directory: the rank's CUDA_VISIBLE_DEVICES, node, gloo
    interface and the wall-clock interval it trained in (``SITE_PROBE_S`` s of sleep between two
    barriers, so the ranks of a trial overlap and trials side by side can be seen to). A 1-rank trial
    without a GPU never imports torch (1.5 CPU-s in each fresh rank process of a job step)."""
    import json
    import os
    import time

    if ctx.distributed:
        import torch.distributed as dist

        dist.barrier()
    start = time.time()
    time.sleep(float(os.environ.get("SITE_PROBE_S", "3")))
    if ctx.distributed:
        dist.barrier()
    info = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "start": start, "end": time.time(),
            "node": os.environ.get("SLURMD_NODENAME"), "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
            "step_gpus": os.environ.get("SLURM_STEP_GPUS"), "pid": os.getpid()}
    (ctx.trial_dir / f"probe{ctx.rank}.json").write_text(json.dumps(info))
    return {"ok": 1.0}


def behave(ctx: Any) -> dict[str, float]:
    """What the engine contract suite asks of a trial, from its params: ``mode`` ok | raise | crash |
    sleep, ``value``, ``sleep`` seconds, ``reports`` intermediate reports before the end; returns
    ``value`` and the rank's OMP_NUM_THREADS (placement)."""
    return behave_params(ctx.params, ctx.report, ctx.rank)


def behave_params(params: dict[str, Any], report: Any, rank: int = 0) -> dict[str, float]:
    for step in range(int(params.get("reports", 0))):
        report(step, value=float(step))
    if params.get("sleep"):
        time.sleep(float(params["sleep"]))
    mode = params.get("mode", "ok")
    if mode == "raise":
        raise ValueError("boom from user code")
    if mode == "crash" and rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    return {"value": float(params.get("value", 1.0)), "threads": float(os.environ.get("OMP_NUM_THREADS", "0"))}


def _square(x: int) -> int:
    return x * x


def pool_without_torch(ctx: Any) -> dict[str, float]:
    """A torch-free function (a light worker's, a spawned interpreter) that starts a spawn-context ``Pool``:
    the sum of squares 0..4 (30), and whether torch was loaded in this process."""
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(2) as pool:
        total = sum(pool.map(_square, range(5)))
    with mp.Pool(2) as pool:  # the default (fork) context too
        total += sum(pool.map(_square, range(5)))
    return {"score": float(total), "torch_loaded": float("torch" in sys.modules)}
