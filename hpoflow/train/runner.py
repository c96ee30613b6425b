"""One rank of one trial, from job description to result: the same code for every engine.

``run_rank`` sets up threads, devices and the process group, runs the training function (the
built-in trainer or the user's ``module:function``), and always destroys the process group. It
returns the rank's outcome as plain data; it raises nothing.

torch is imported only by what needs it: the built-in trainer, a process group (several ranks), a
GPU, or the user's own code. A process that has not imported torch yet (a light worker of the local
engine) runs a torch-free function at once; if the function imports torch later, torch is seeded
and given the rank's thread count the moment its import completes (``_when_imported``).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import logging
import math
import os
import random
import signal
import sys
import threading
import time
import traceback
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from hpoflow.errors import NonFiniteLoss
from hpoflow.spec import TrainConfig, import_plugins
from hpoflow.train.context import PauseRequest, TrialContext, metric_dict, real_number
from hpoflow.train.energy import meter_for_rank
from hpoflow.train.faults import collective_lost
from hpoflow.train.transport import Channel, NullChannel
from hpoflow.train.usage import UsageSampler
from hpoflow.trial import (
    GPU_RESERVE_ENV,
    GPU_SHARE_ENV,
    RankJob,
    RankOutcome,
    TrialRequest,
    gpu_reserve_mib,
    memory_fraction,
)

log = logging.getLogger(__name__)

__all__ = ["load_function", "log_to_stderr", "run_rank"]


def load_function(ref: str, python_path: tuple[str, ...] = ()) -> Callable[[TrialContext], Any]:
    """Import ``module:function``; ``python_path`` entries are put in front of ``sys.path``."""
    for p in reversed(python_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    module_name, _, attr = ref.partition(":")
    module = importlib.import_module(module_name)
    fn = getattr(module, attr)
    if not callable(fn):
        raise TypeError(f"{ref} is not callable")
    return typing.cast("Callable[[TrialContext], Any]", fn)


class _WhenImported(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A one-shot import hook: run ``then(module)`` right after module ``name`` has been imported."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self.name, self.then = name, then
        self._loader: importlib.abc.Loader | None = None
        self.began: float | None = None  # perf_counter when the import began, and ended
        self.ended: float | None = None

    def find_spec(self, fullname: str, path: Any = None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        self.began = time.perf_counter()
        self.remove()
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        self._loader, spec.loader = spec.loader, self
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec) if self._loader is not None else None

    def exec_module(self, module: ModuleType) -> None:
        if self._loader is None:  # pragma: no cover - find_spec always sets it first
            raise ImportError(f"no loader for {self.name}")
        if module.__spec__ is not None:  # later reloads go straight to the real loader
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self.then(module)
        self.ended = time.perf_counter()

    def paid_since(self, t0: float) -> float | None:
        """Seconds of the import that fell after ``t0`` (None: not imported after it)."""
        if self.began is None or self.ended is None or self.ended <= t0:
            return None
        return self.ended - max(self.began, t0)

    def install(self) -> None:
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)


def _torch_setup(seed: int, threads: int) -> Callable[[ModuleType], None]:
    def setup(torch: ModuleType) -> None:
        torch.set_num_threads(threads)
        accelerator = getattr(torch, "accelerator", None)  # (torch >= 2.6)
        if accelerator is not None and not accelerator.is_available():
            # No CUDA, MPS, XPU or other device here: torch.manual_seed would only queue a lazy seed for
            # each device kind, each with a stack trace (~0.1-0.4 ms a trial); the CPU generator's seed is
            # the same either way.
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)
    return setup


def _numpy_setup(seed: int) -> Callable[[ModuleType], None]:
    def setup(np: ModuleType) -> None:
        np.random.seed(seed % (2**32))
    return setup


def _when_imported(name: str, then: Callable[[ModuleType], None]) -> _WhenImported | None:
    """``then(module)`` now if ``name`` is imported, else the moment it is (the hook returned)."""
    module = sys.modules.get(name)
    if module is not None:
        then(module)
        return None
    hook = _WhenImported(name, then)
    hook.install()
    return hook


def _seed_everything(seed: int, threads: int) -> tuple[_WhenImported | None, _WhenImported | None]:
    """Seed Python's, NumPy's and torch's generators and give torch the rank's threads; NumPy's and
    torch's part, when that library is not imported yet, the moment it is (the hooks returned, torch's
    then NumPy's, to remove after): a light worker imports neither for a function that uses neither
    (NumPy's import is about a quarter of a light worker's start: 0.1 of 0.38 CPU-s)."""
    random.seed(seed)
    numpy_hook = _when_imported("numpy", _numpy_setup(seed))
    return _when_imported("torch", _torch_setup(seed, max(1, threads))), numpy_hook


def _final_metrics(ret: Any, ctx: TrialContext) -> dict[str, float]:
    """What a training function's return value says: a mapping's real-valued entries (others, such
    as strings or bools, are not metrics and are left out), a real number as the study's metric, or
    (returning None) the last report. Real: ``hpoflow.train.context.real_number``."""
    if isinstance(ret, Mapping):
        return metric_dict(ret, strict=False, where="the training function's result")
    value = real_number(ret)
    if value is not None:
        return {ctx.metric: value}
    if ret is None and ctx.reports:
        return dict(ctx.reports[-1][1])
    return {}


def _on_pause_signal(pause: PauseRequest) -> Any:
    """SIGUSR1 asks this rank to pause (the engine's request to stop soon with a checkpoint; srun
    forwards it to every task of a step). The previous handler, to put back; None off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGUSR1, lambda signum, frame: pause.set())


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 200 else f"{text[:200]}... ({type(value).__name__})"


def log_to_stderr(level: int = logging.INFO) -> None:
    """Send the "hpoflow" logger's records to stderr (a rank's log file; the CLI's terminal), once."""
    logger = logging.getLogger("hpoflow")
    if not any(getattr(h, "_hpoflow_stderr", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("hpoflow: %(message)s"))
        handler._hpoflow_stderr = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    logger.setLevel(level)


def _usage(sampler: UsageSampler, req: TrialRequest, rank: int) -> dict[str, float]:
    """Stop the rank's usage sampler (before the process group goes: its sockets are counted) and
    keep the summary in the trial directory as ``usage_rank<r>.json``."""
    summary = sampler.stop()
    if summary:
        try:
            Path(req.trial_dir).mkdir(parents=True, exist_ok=True)
            (Path(req.trial_dir) / f"usage_rank{rank}.json").write_text(json.dumps(summary))
        except OSError as exc:
            log.warning("rank %d: usage not written: %s", rank, exc)
    return summary


def _cap_gpu_share(req: TrialRequest, rank: int, use_cuda: bool) -> None:
    """A rank that shares its GPU with ranks of other trials (its engine set ``HPOFLOW_GPU_SHARE``)
    keeps to its share less a reserve (``HPOFLOW_GPU_SHARE_RESERVE_MIB``) for what no cap counts (its CUDA
    context, NCCL's buffers): where MPS limits its memory (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, set by
    the engine) that is the cap; otherwise torch's caching allocator is capped to that part of device 0
    (the rank's one GPU), and a share too small to hold the reserve fails the trial, naming both. Without
    CUDA in this process (a CPU stand-in GPU) nothing is applied. What was applied goes to the rank log
    and to ``gpu_share_rank<r>.json`` in the trial directory."""
    text = os.environ.get(GPU_SHARE_ENV)
    if not text:
        return
    share = float(text)
    reserve = gpu_reserve_mib(os.environ)
    mps_memory = os.environ.get("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
    fraction = cap_mib = None
    if mps_memory:
        applied = "mps"
    elif use_cuda:
        import torch

        total_mib = torch.cuda.get_device_properties(0).total_memory / 2**20
        fraction = memory_fraction(share, total_mib, reserve)
        if fraction <= 0:
            raise ValueError(
                f"a {share:g} share of GPU {os.environ.get('CUDA_VISIBLE_DEVICES')} is {total_mib * share:.0f} MiB of "
                f"{total_mib:.0f} MiB, which does not hold the {reserve} MiB each sharer keeps outside its memory cap "
                f"for its CUDA context ({GPU_RESERVE_ENV}). Fix: a larger share (resources.gpus_per_process), or a "
                f"smaller {GPU_RESERVE_ENV} where the contexts are known to fit")
        torch.cuda.set_per_process_memory_fraction(fraction, 0)
        applied = "torch"
        cap_mib = round(total_mib * fraction, 1)
    else:
        applied = "none: CUDA is not available in this process"
    record = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"), "share": share,
              "reserve_mib": reserve, "memory_fraction": fraction, "memory_cap_mib": cap_mib, "applied": applied,
              "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
              "mps_pinned_device_mem_limit": mps_memory}
    log.info("rank %d: a %g share of GPU %s, capped by %s (%s MiB kept outside the cap)", rank, share,
             record["cuda_visible_devices"], applied, reserve)
    try:
        Path(req.trial_dir).mkdir(parents=True, exist_ok=True)
        (Path(req.trial_dir) / f"gpu_share_rank{rank}.json").write_text(json.dumps(record))
    except OSError as exc:
        log.warning("rank %d: gpu_share_rank%d.json not written: %s", rank, rank, exc)


def run_rank(job: RankJob, channel: Channel | None = None) -> RankOutcome:
    """Run one rank to the end. Exceptions in training become an ``error`` outcome."""
    log_to_stderr()
    # CUDA numbers GPUs fastest first unless told otherwise; NVML, nvidia-smi and SLURM by PCI bus id. With
    # this (before CUDA starts here or in a command trial's program), an index names one GPU to all of them.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    req = job.request
    channel = channel or NullChannel()
    use_cuda = False
    command = req.train.get("command") is not None  # the rank supervises the user's program: no GPU of its own
    zygote = None
    if command:  # a warm program is forked now, before this process has threads or a process group
        from hpoflow.train.command import prefork

        zygote = prefork(req.train, job.threads)
    if req.gpus_per_process > 0 and not command:
        import torch

        use_cuda = torch.cuda.is_available()
    hook, numpy_hook = _seed_everything(req.seed, job.threads)
    # energy (hpoflow.train.energy): the rank's own GPUs, and the node's CPU counter at its local rank 0
    energy = meter_for_rank(job.local_rank, max(1, job.world_size // max(1, req.nodes)), req.cpus_per_process,
                            req.gpus_per_process)
    usage = UsageSampler(cuda_device=0 if use_cuda else None, energy=energy, tree=command)  # a program's processes
    if os.environ.get("HPOFLOW_USAGE", "1") != "0":  # HPOFLOW_USAGE=0: no system usage sampled
        usage.start()
    ctx: TrialContext | None = None
    finished = False  # every rank that ends without an exception leaves the group with its peers
    pause = PauseRequest()
    old_usr1 = _on_pause_signal(pause)
    try:
        if not command:  # a command trial's program gets only the engine's MPS limits (its environment)
            _cap_gpu_share(req, job.rank, use_cuda)
        failed = import_plugins(req.plugins, req.python_path)
        if failed:
            raise ImportError(failed[0][1])
        config = TrainConfig.model_validate(req.train)
        ctx = TrialContext(
            params=dict(req.params), config=config, trial_number=req.number, trial_dir=Path(req.trial_dir),
            rank=job.rank, world_size=job.world_size, local_rank=job.local_rank,
            device_name="cuda:0" if use_cuda else "cpu",
            metric=req.metric, pruning=req.pruning, channel=channel, attempt=req.attempt,
            checkpoint_dir=Path(req.checkpoints), elastic=req.elastic, base_world=req.base_processes,
            seed=req.seed, pause_request=pause,
        )
        if job.world_size > 1:
            from hpoflow.train import dist as hdist

            hdist.init_process_group(job.rank, job.world_size, job.master_addr, job.master_port,
                                     use_cuda, job.pg_timeout_s, job.store_path, job.announce_path)
        # The trial's clock starts with the user's code (its module's import included). A cold torch
        # import inside it (a light worker: a function that gave no sign of torch) is timed apart as
        # cold_start_s and left out of run_s, so durations compare across trials.
        started_at = time.time()
        loaded = time.perf_counter()
        fn: Callable[[TrialContext], Any]
        if config.command is not None:
            from hpoflow.train.command import run_command

            fn = functools.partial(run_command, job=job, zygote=zygote)
            zygote = None  # run_command owns it now
        elif config.function:
            fn = load_function(config.function, req.python_path)
        else:
            from hpoflow.train.builtin import train_builtin

            fn = train_builtin
        t0 = time.perf_counter()
        ret = fn(ctx)
        run_s = time.perf_counter() - t0
        cold = None
        if hook is not None:
            cold = hook.paid_since(loaded)
            run_s = max(0.0, run_s - (hook.paid_since(t0) or 0.0))
        metrics = _final_metrics(ret, ctx)
        pruned = ctx._prune
        value = metrics.get(req.metric)
        if ctx.resizing and not pruned:  # left at a boundary, checkpointed: the engine restarts it resized
            finished = True
            return RankOutcome("resized", metrics, started_at=started_at, run_s=run_s, cold_start_s=cold,
                               usage=_usage(usage, req, job.rank))
        if ctx.pausing and not pruned:  # stopped at a step with a checkpoint: a rerun resumes from it
            finished = True
            return RankOutcome("paused", metrics, started_at=started_at, run_s=run_s, cold_start_s=cold,
                               usage=_usage(usage, req, job.rank))
        if job.rank == 0 and not pruned:
            if value is None:
                raise KeyError(
                    f"the training function returned no {req.metric!r} (study.metric); it returned "
                    f"{sorted(metrics) or _short(ret)}. Fix: return a dict with {req.metric!r}, or a number (int, "
                    "float, a NumPy scalar, a 0-d tensor; a bool is not a metric)"
                )
            if not math.isfinite(value):
                raise NonFiniteLoss(f"{req.metric} is {value}")
        finished = True
        return RankOutcome("pruned" if pruned else "ok", metrics, started_at=started_at, run_s=run_s,
                           cold_start_s=cold, usage=_usage(usage, req, job.rank))
    except (Exception, SystemExit) as exc:  # a trial never raises through the engine
        tb = traceback.format_exc()
        with contextlib.suppress(OSError):  # the rank log's disk is full: the outcome still goes back
            sys.stderr.write(tb)
            sys.stderr.flush()
        # A broken collective (a peer died: gloo, NCCL; hpoflow.train.faults) is a lost rank: worth retrying, and
        # so is a command trial's program killed by a signal hpoflow did not send (CommandError.retryable).
        # User errors are not.
        retryable = getattr(exc, "retryable", False) is True or (
            job.world_size > 1 and collective_lost(type(exc).__name__, str(exc)))
        return RankOutcome("error", {}, error=f"{type(exc).__name__}: {exc}", error_type=type(exc).__name__,
                           retryable=retryable, usage=_usage(usage, req, job.rank))
    finally:
        if zygote is not None:  # the trial failed before its program started
            zygote.discard()
        if old_usr1 is not None:
            signal.signal(signal.SIGUSR1, old_usr1)
        if ctx is not None:
            try:
                ctx.flush_checkpoints()  # an async save still being written must land first
            except Exception as exc:  # a failed write is reported, never raised from here
                log.warning("rank %d: last checkpoint not written: %s", job.rank, exc)
        for h in (hook, numpy_hook):
            if h is not None:
                h.remove()
        if "torch.distributed" in sys.modules:  # else no process group can exist
            from hpoflow.train import dist as hdist

            hdist.destroy(leave_together=finished)
        with contextlib.suppress(OSError):  # (a full disk under the rank log)
            sys.stdout.flush()
            sys.stderr.flush()
