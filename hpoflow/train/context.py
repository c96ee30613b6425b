"""``TrialContext``: what a training function (built-in or the user's) receives inside a trial."""

from __future__ import annotations

import decimal
import math
import numbers
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.spec import TrainConfig, unprintable
from hpoflow.train.transport import Channel, NullChannel

if TYPE_CHECKING:
    import torch

    from hpoflow.train.checkpoint import CheckpointFormat

__all__ = ["PauseRequest", "TrialContext", "metric_dict", "real_number"]


class PauseRequest:
    """Set when the engine asks the trial to stop soon with a checkpoint (a walltime warning, a
    preemption): by SIGUSR1 to the rank process (``hpoflow.train.runner`` installs the handler), or
    by the rank's watcher of the attempt's ``PAUSE`` file. Safe to set from a signal handler."""

    def __init__(self) -> None:
        self.requested = False

    def set(self) -> None:
        self.requested = True


def _plain(value: Any) -> float | None:
    """A number that is not an array: any ``numbers.Real`` (int, float, ``Fraction``), a ``Decimal``,
    or a NumPy scalar of an integer or floating dtype. Beyond a float's range: +-inf."""
    if isinstance(value, bool):
        return None
    np = sys.modules.get("numpy")  # a NumPy scalar exists only where NumPy is imported
    if np is not None and isinstance(value, np.generic):
        if value.dtype.kind not in "iuf":  # bool_, complex, datetime, str
            return None
    elif not isinstance(value, numbers.Real | decimal.Decimal):
        return None
    try:
        return float(value)
    except OverflowError:  # 10**400, Fraction(10**400)
        return math.inf if value > 0 else -math.inf
    except (ValueError, TypeError):  # Decimal("sNaN")
        return math.nan


def _one_element(value: Any) -> bool:
    if getattr(value, "ndim", None) == 0:
        return True
    numel = getattr(value, "numel", None)  # torch
    if callable(numel):
        try:
            return bool(numel() == 1)
        except Exception:
            return False
    return getattr(value, "size", None) == 1  # NumPy, JAX


def real_number(value: Any) -> float | None:
    """``value`` as a float when it is a real number, else None: a ``numbers.Real`` (int, float,
    ``fractions.Fraction``), a ``decimal.Decimal``, a NumPy scalar of an integer or floating dtype, or
    an array or tensor of one element (NumPy, torch, JAX...: ``.item()`` with ``ndim == 0`` or one
    element; torch is never imported for this). A bool is a yes/no, not a measurement: None (say
    ``float(flag)`` to report one). Values beyond a float's range become +-inf."""
    found = _plain(value)
    if found is not None or isinstance(value, bool):
        return found
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, str | bytes | Mapping) and _one_element(value):
        try:
            return _plain(item())
        except Exception:  # a tensor on a lost device, an object whose item() means something else
            return None
    return None


def metric_dict(values: Mapping[Any, Any], *, strict: bool, where: str) -> dict[str, float]:
    """The real-valued entries of ``values`` as floats. A name that is not printable text is refused
    (``ValueError``: it would reach the terminal and the CSV header); with ``strict`` a value that is
    not a real number is refused too (``TypeError``), else skipped."""
    out: dict[str, float] = {}
    for key, raw in values.items():
        name = str(key)
        why = unprintable(name)
        if why:
            raise ValueError(f"{where}: metric name {name!r} {why}")
        value = real_number(raw)
        if value is None:
            if strict:
                flag = isinstance(raw, bool) or getattr(getattr(raw, "dtype", None), "kind", "") == "b"
                kind = "a bool is not a metric (report float(flag))" if flag else \
                    "it must be a real number (int, float, a NumPy scalar, a one-element tensor)"
                raise TypeError(f"{where}: metric {name!r} is {raw!r}: {kind}")
            continue
        out[name] = value
    return out


@dataclass
class TrialContext:
    """The trial as seen from one rank.

    ``params`` are the sampled hyperparameters, ``config`` the resolved training config. Rank 0
    calls ``report(step, **metrics)`` after each epoch (other ranks may call it too: only rank 0's
    reports are sent); every rank then calls ``should_stop()`` at the same step, which broadcasts
    rank 0's pruning decision so no rank is left waiting in a collective.
    """

    params: dict[str, Any]
    config: TrainConfig
    trial_number: int
    trial_dir: Path
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device_name: str = "cpu"  # the rank's device: "cpu" or "cuda:0" (see ``device``)
    metric: str = "val_accuracy"
    pruning: bool = False
    channel: Channel = field(default_factory=NullChannel)
    attempt: int = 0
    checkpoint_dir: Path | None = None  # defaults to trial_dir / "checkpoints"
    reports: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    _prune: bool = False
    resumed_step: int | None = None  # the step load_checkpoint() resumed from (None: fresh start)
    checkpoint_s: float = 0.0  # seconds save_checkpoint() held the calling thread (snapshot + waits)
    # Elastic trials (resources.processes: {min, max}; docs/elastic.md): base_world is the number of
    # ranks the config is written for (its global batch); resize_to, set by should_stop() on every
    # rank, the number the engine wants the trial to continue with (0: no change).
    elastic: bool = False
    base_world: int = 1
    seed: int = 0
    resize_to: int = 0
    resizing: bool = False  # should_stop() returned True to restart the trial with resize_to ranks
    _resize: int = 0  # rank 0: the engine's last answer
    _saved_since_stop_check: bool = False
    _checkpointer: CheckpointFormat | None = field(default=None, repr=False)
    # A pause (docs/fault-tolerance.md): the engine asked the trial to stop at its next step with a
    # checkpoint; ``pausing`` once every rank agreed (should_stop() or pause_point() returned True for it).
    pause_request: PauseRequest = field(default_factory=PauseRequest)
    pausing: bool = False
    _pause_work: Any = field(default=None, repr=False)
    _pause_buf: Any = field(default=None, repr=False)
    _restore_rng: Any = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        """The rank's ``torch.device`` (its GPU when it has one, else the CPU)."""
        import torch

        return torch.device(self.device_name)

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        if self.world_size <= 1 or "torch.distributed" not in sys.modules:  # no group without torch
            return False
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    @property
    def options(self) -> dict[str, Any]:
        """Free-form ``training.options`` of the spec (for user functions)."""
        return self.config.options

    def report(self, step: int, /, **metrics: float) -> None:
        """Record intermediate ``metrics`` at ``step``; rank 0 sends them to the study's storage. A
        metric is any real number (``hpoflow.train.context.real_number``: int, float, a NumPy scalar,
        a 0-d tensor, ``Fraction``, ``Decimal``); anything else, a bool included, raises ``TypeError``.
        ``step`` is positional only, so a metric may have any name (``self``, ``step``, ``val/loss``:
        ``report(3, **{"val/loss": 0.4})``)."""
        clean = metric_dict(metrics, strict=True, where=f"ctx.report(step={step})")
        self.reports.append((int(step), clean))
        if self.rank != 0:
            return
        wants = self.pruning and self.metric in clean and math.isfinite(clean[self.metric])
        self._prune = self.channel.report(int(step), clean, wants or self.elastic)
        self._resize = self.channel.resize_to if self.elastic else 0
        if wants and self.channel.pause_asked and not self._prune:  # a scheduler pauses the trial at this
            self.pause_request.set()  # step (docs/schedulers.md): should_stop() tells every rank

    def should_stop(self) -> bool:
        """Whether the trial should stop here: pruned, paused (the engine needs the trial to stop now,
        e.g. before the allocation's walltime: save a checkpoint first, the trial resumes from it), or
        (elastic trials) to be restarted with ``resize_to`` ranks. Collective in a DDP trial: every rank
        must call it; rank 0's view decides for all.

        A resize stops the trial only where every rank saved a checkpoint since the last
        ``should_stop()`` (``save_checkpoint``), so it resumes from here on the new ranks; the
        built-in trainer saves one when ``resize_to`` is set. A function that returns when this is
        True is restarted by its engine and resumes with ``load_checkpoint()``."""
        flag, resize, pause = self._prune, self._resize, self.pause_request.requested or self.pausing
        if self.distributed:
            import torch
            import torch.distributed as dist

            t = torch.tensor([1 if flag else 0, resize, 1 if pause else 0], dtype=torch.int64)
            dist.broadcast(t, src=0)
            flag, resize, pause = bool(t[0].item()), int(t[1].item()), bool(t[2].item())
        self._prune = flag
        self.resize_to = resize if self.elastic and resize not in (0, self.world_size) else 0
        saved, self._saved_since_stop_check = self._saved_since_stop_check, False
        self.resizing = not flag and self.resize_to > 0 and saved
        self.pausing = self.pausing or (pause and not flag)
        return flag or self.resizing or self.pausing

    def pause_point(self, *, last: bool = False) -> bool:
        """Whether every rank agrees to pause here (a step boundary of a training loop). Collective in a
        distributed trial: every rank calls it at the same points. The agreement is an all-reduce
        started at one point and read at the next, so it costs no wait: a pause requested anywhere
        stops every rank at the same point, one point later. ``last=True`` (the loop's end) reads the
        agreement in flight and starts none."""
        if self.pausing:
            return True
        local = self.pause_request.requested
        if not self.distributed:
            self.pausing = local
            return local
        import torch
        import torch.distributed as dist

        agreed = False
        if self._pause_work is not None:
            self._pause_work.wait()
            agreed = bool(self._pause_buf.item())
            self._pause_work = None
        if not agreed and not last:
            self._pause_buf = torch.tensor([1 if local else 0], dtype=torch.int64)
            self._pause_work = dist.all_reduce(self._pause_buf, op=dist.ReduceOp.MAX, async_op=True)
        self.pausing = agreed
        return agreed

    # -- checkpoints (hpoflow.train.checkpoint; docs/checkpointing.md) ---------------------------
    @property
    def checkpoints(self) -> CheckpointFormat:
        """This rank's checkpoint manager, of ``training.checkpoint.format`` (with its ``options``,
        ``keep`` and ``async``)."""
        if self._checkpointer is None:
            from hpoflow.train.checkpoint import make_checkpointer

            ck = self.config.checkpoint
            directory = self.checkpoint_dir or self.trial_dir / "checkpoints"
            world = self.world_size if self.distributed else 1
            self._checkpointer = make_checkpointer(
                ck.format, ck.options, directory, rank=self.rank if self.distributed else 0, world_size=world,
                keep=ck.keep, background=ck.async_, elastic=self.elastic)
        return self._checkpointer

    def save_checkpoint(self, state: dict[str, Any], step: int | None = None, *, rng: bool = True,
                        sharded: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``state`` (tensors, numbers, strings, containers) as ``step`` (default: the last
        saved or resumed step + 1), with this process's RNG states unless ``rng=False``.

        Call it on every rank at the same step (it is a collective for some formats: ``dcp``); the state
        is copied before this returns, and written in the background when ``training.checkpoint.async`` is
        on. With a format that keeps one copy for all ranks (``rank0``, ``dcp``) ``state`` must be the same on
        every rank (DDP's model and optimizer); the RNG states are always kept per rank. ``sharded``:
        this rank's part of a state sharded over the ranks, by name (``DTensor`` shards: ``fsdp``'s and
        ``zero1``'s model and optimizer, ``Strategy.sharded_state``), which the ``dcp`` format writes
        sharded (``ValueError`` with another format).
        """
        t0 = time.perf_counter()
        cp = self.checkpoints
        self._check_sharded(cp, sharded)
        if step is None:
            step = 1 if cp.last_step is None else cp.last_step + 1
        private: dict[str, Any] = {}
        if rng:
            from hpoflow.train.checkpoint import capture_rng

            private["rng"] = capture_rng()
        if sharded is None:
            cp.save({"user": state}, int(step), private)
        else:
            cp.save({"user": state}, int(step), private, sharded=sharded)
        self._saved_since_stop_check = True
        self.checkpoint_s += time.perf_counter() - t0

    def load_checkpoint(self, *, restore_rng: bool = True,
                        sharded: Callable[[], Mapping[str, Any]] | None = None) -> dict[str, Any] | None:
        """The state of the newest checkpoint valid on every rank (``None``: start from scratch), and
        the RNG states saved with it restored unless ``restore_rng=False``; sets ``resumed_step``.

        Collective in a distributed trial: every rank must call it. Corrupt or partial files are
        skipped with a warning (the previous checkpoint is used); this rank's files newer than the
        chosen one are deleted (they belong to the crashed run). ``sharded``: a function giving the
        tensors a sharded state is read into, by name, at this rank's sharding now
        (``Strategy.sharded_template``); called once a checkpoint is chosen, and filled in place.
        """
        cp = self.checkpoints
        self._check_sharded(cp, sharded)
        kw: dict[str, Any] = {} if sharded is None else {"sharded": sharded}
        gather = None
        if self.distributed:
            def gather(mine: list[int]) -> list[list[int]]:
                import torch.distributed as dist

                out: list[Any] = [None] * self.world_size
                dist.all_gather_object(out, mine)
                return [list(x) for x in out]
        foreign = False
        if self.elastic:  # written by any number of ranks (a resized trial)
            any_world = cp.latest_any_world(gather, **kw)
            found = None if any_world is None else any_world[:2]
            foreign = any_world is not None and any_world[2]
        else:
            found = cp.latest(gather, **kw)
        if found is None:
            self.resumed_step = None
            return None
        step, payload = found

        def restore() -> None:
            if foreign:  # rank 0's state: this rank did not exist then; its own streams, from the seed
                from hpoflow.train.checkpoint import seed_joining_rank

                seed_joining_rank(self.seed, step, self.rank)
            elif "rng" in payload:
                from hpoflow.train.checkpoint import restore_rng as restore_rng_state

                restore_rng_state(payload["rng"])

        if restore_rng:
            restore()
        self._restore_rng = restore
        self.resumed_step = step
        user: dict[str, Any] = payload["user"]
        return user

    def _check_sharded(self, cp: CheckpointFormat, sharded: object) -> None:
        if sharded is not None and not cp.sharded_state:
            raise ValueError(
                f"checkpoint: training.checkpoint.format {cp.name!r} keeps each rank's state whole, but this trial's "
                "model and optimizer are sharded over the ranks (fsdp, zero1). Fix: use format: dcp (their default)")

    def restore_checkpoint_rng(self) -> None:
        """Restore the RNG states saved with the checkpoint ``load_checkpoint(restore_rng=False)`` loaded:
        for a resume in the middle of an epoch, after the data iterator was rebuilt and moved to its
        place (building it draws from torch's generator), so the rest of the epoch draws as it did."""
        if self._restore_rng is not None:
            self._restore_rng()

    def flush_checkpoints(self) -> None:
        """Wait for a background checkpoint write to finish (idempotent; call before the trial ends)."""
        if self._checkpointer is not None:
            self._checkpointer.close()


