"""The data-parallel strategy contract, and the meter every strategy reports its communication to.

A ``Strategy`` decides how the ranks of one trial combine their work. The trainer drives it, and
every rank makes the same calls in the same order (each call may be a collective):

1. ``build(builder) -> nn.Module`` once, before the optimizer exists: the model from ``builder()``
   (the caller seeds torch alike on every rank first), wrapped. The default builds the whole model on
   the CPU, moves it to the rank's device and calls ``wrap(model)``, which makes the ranks' models
   identical (broadcast from rank 0, one tensor at a time, or DDP's own) and returns the module to
   run forward/backward on (a ``DistributedDataParallel`` for ``allreduce``, the model itself
   otherwise); ``self.model`` is the model. ``fsdp`` builds only this rank's shard of each tensor
   instead (``_sharded_init``: the values a replica's build gives them). ``wrap(model)`` alone takes
   a model built already.
2. ``build_optimizer(params, optimizer_class, **defaults)`` once, after ``wrap``: the optimizer
   over ``model.parameters()`` (``optimizer_class(params, **defaults)``; ``zero1`` shards its state
   in a ``ZeroRedundancyOptimizer``); then ``prepare_optimizer(optimizer)`` once.
3. For every optimizer step: ``before_step()``; then one or more micro-batches whose
   forward/backward run inside ``no_sync()`` except the last (gradient accumulation); then
   ``after_backward()`` (gradient exchange) and ``step(optimizer)``, which applies the update and
   any parameter exchange. The trainer brackets the step with ``meter.begin_step()`` /
   ``meter.end_step()``.
4. ``end_epoch()`` after the last step of an epoch: afterwards ``eval_module()`` is identical on
   every rank (the all-reduced model, the parameter server's, the EASGD center, the averaged local
   models), so every rank's validation gives the same numbers.
5. ``state_dict()`` / ``load_state_dict(state)`` at an epoch boundary (after ``end_epoch``): what
   the strategy owns beyond the model and the optimizer (EASGD's center, step counters, the meter's
   totals) as plain tensors and numbers, for checkpoints (``hpoflow.train.checkpoint``). The state
   may differ between ranks (each rank checkpoints its own). ``load_state_dict`` runs after
   ``wrap`` and ``prepare_optimizer`` and is local (no collective); it rejects another strategy's
   state or a different configuration with ``ValueError``. The model's and the optimizer's state
   go through ``training_state(model, optimizer)`` / ``load_training_state(state, model,
   optimizer)``: ``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` for a
   replicated model. A strategy whose ``sharded`` is true (``zero1``, ``fsdp``) keeps them sharded
   over the ranks instead: ``training_state`` is empty, and a checkpoint takes this rank's part by
   name from ``sharded_state(model, optimizer)`` and reads a resumed one into
   ``sharded_template(model, optimizer)`` (``_sharded_state``: DCP's state dicts, at any world size),
   through a checkpoint format that keeps sharded state (``dcp``). These may be collectives (every
   rank calls them at the same point).
6. ``close()`` in ``finally``: releases what the strategy owns. Strategies create no process
   groups of their own (they use the trial's default group, which ``runner.run_rank`` destroys).

With ``world_size == 1`` (no process group) every strategy still works and communicates nothing.

Ownership: the strategy owns the parameter copies it keeps (EASGD's center), the optimizer stays
the trainer's. Not thread safe: one strategy per rank, called from the rank's main thread (DDP's
hooks record into the meter from gloo's threads; the meter locks for that).

Measurement (``CommMeter``): communication time is the union of the intervals during which an
operation the strategy issued was in flight (DDP buckets overlap backward: overlapping intervals are
counted once); bytes are what this rank *sent*, from the kernel's count of bytes this process wrote
(``/proc/self/io`` ``wchar``: gloo writes its sockets with ``writev``) over each step, so collective
algorithms are measured, not assumed. Where that counter is missing (not Linux, NCCL on GPUs) the
strategy's own estimate of what its operations send is used and ``bytes_measured`` is 0.
"""

from __future__ import annotations

import abc
import contextlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch
import torch.distributed as dist
from torch import nn

if TYPE_CHECKING:
    from hpoflow.train.strategies._sharded_state import ShardedTemplate

__all__ = ["CommMeter", "OptimizerLike", "Strategy", "StrategyEnv", "read_bytes_sent"]

_IO_PATH = "/proc/self/io"


def read_bytes_sent() -> int | None:
    """Bytes this process has written through ``write``/``writev`` so far (``None`` if unknown)."""
    try:
        with open(_IO_PATH) as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class OptimizerLike(Protocol):
    """What strategies need from an optimizer (a ``torch.optim.Optimizer`` or the LARS wrapper)."""

    param_groups: list[dict[str, Any]]

    def step(self) -> Any: ...

    def zero_grad(self, set_to_none: bool = True) -> None: ...


@dataclass(frozen=True)
class StrategyEnv:
    """Where a strategy runs: this rank, the trial's world size, the base learning rate, device."""

    rank: int = 0
    world_size: int = 1
    lr: float = 0.01
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


class CommMeter:
    """Per-step communication time and bytes sent by one rank (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._intervals: list[tuple[float, float]] = []
        self._estimate = 0.0
        self._step_t0 = 0.0
        self._bytes0: int | None = None
        self.kernel_counter = read_bytes_sent() is not None
        self.steps = 0
        self.step_time = 0.0
        self.comm_time = 0.0
        self.bytes_sent = 0.0
        self.extra_comm_time = 0.0
        self.extra_bytes = 0.0

    # -- recording ------------------------------------------------------------------------------
    def add_interval(self, t0: float, t1: float, estimate_bytes: float = 0.0) -> None:
        """An operation was in flight from ``t0`` to ``t1`` (``perf_counter``); thread safe."""
        with self._lock:
            self._intervals.append((t0, t1))
            self._estimate += estimate_bytes

    @contextlib.contextmanager
    def timed(self, estimate_bytes: float = 0.0) -> Iterator[None]:
        """Time a blocking communication block issued inside a step."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add_interval(t0, time.perf_counter(), estimate_bytes)

    def begin_step(self) -> None:
        with self._lock:
            self._intervals.clear()
            self._estimate = 0.0
        self._bytes0 = read_bytes_sent() if self.kernel_counter else None
        self._step_t0 = time.perf_counter()

    def end_step(self) -> float:
        """Close the step; return its duration in seconds."""
        t1 = time.perf_counter()
        b1 = read_bytes_sent() if self._bytes0 is not None else None
        with self._lock:
            comm = _union_length(self._intervals)
            estimate = self._estimate
            self._intervals.clear()
        dt = t1 - self._step_t0
        self.steps += 1
        self.step_time += dt
        self.comm_time += comm
        if b1 is not None and self._bytes0 is not None:
            self.bytes_sent += b1 - self._bytes0
        else:
            self.bytes_sent += estimate
        return dt

    @contextlib.contextmanager
    def outside_step(self, estimate_bytes: float = 0.0) -> Iterator[None]:
        """Communication between steps (epoch-end averaging): counted apart from the steps."""
        b0 = read_bytes_sent() if self.kernel_counter else None
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.extra_comm_time += time.perf_counter() - t0
            b1 = read_bytes_sent() if b0 is not None else None
            self.extra_bytes += (b1 - b0) if b1 is not None and b0 is not None else estimate_bytes

    # -- checkpoints ----------------------------------------------------------------------------
    _TOTALS = ("steps", "step_time", "comm_time", "bytes_sent", "extra_comm_time", "extra_bytes")

    def state_dict(self) -> dict[str, float]:
        """The running totals (so a resumed trial's per-step averages continue)."""
        return {k: float(getattr(self, k)) for k in self._TOTALS}

    def load_state_dict(self, state: Mapping[str, float]) -> None:
        for k in self._TOTALS:
            if k in state:
                setattr(self, k, int(state[k]) if k == "steps" else float(state[k]))

    # -- results --------------------------------------------------------------------------------
    def metrics(self) -> dict[str, float]:
        n = max(self.steps, 1)
        return {
            "steps": float(self.steps),
            "step_time_s": self.step_time / n,
            "comm_time_s": self.comm_time / n,
            "comm_fraction": self.comm_time / self.step_time if self.step_time > 0 else 0.0,
            "bytes_per_step": self.bytes_sent / n,
            "bytes_measured": 1.0 if self.kernel_counter else 0.0,
            "sync_bytes": self.extra_bytes,
            "sync_time_s": self.extra_comm_time,
        }


def _union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def flat_params(params: list[nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in params]) if params else torch.zeros(0)


def load_flat(params: list[nn.Parameter], flat: torch.Tensor) -> None:
    """Copy ``flat`` into ``params`` (in order)."""
    i = 0
    with torch.no_grad():
        for p in params:
            n = p.numel()
            p.copy_(flat[i : i + n].view_as(p))
            i += n


class Strategy(abc.ABC):
    """One data-parallel strategy; see the module docstring for the contract."""

    name: ClassVar[str] = "strategy"
    #: the model and the optimizer are sharded over the ranks: checkpoints take them through
    #: ``sharded_state`` / ``sharded_template`` (module docs, 5)
    sharded: ClassVar[bool] = False

    def __init__(self, options: Mapping[str, Any], env: StrategyEnv) -> None:
        self.options = dict(options)
        self.env = env
        self.meter = CommMeter()
        self.model: nn.Module | None = None
        self.params: list[nn.Parameter] = []

    @property
    def distributed(self) -> bool:
        return self.env.world_size > 1 and dist.is_available() and dist.is_initialized()

    @property
    def model_bytes(self) -> int:
        """Bytes of the trainable parameters (the "M" of the volume formulas)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def _attach(self, model: nn.Module) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]

    def _broadcast_params(self) -> None:
        """Make every rank start from rank 0's parameters (not counted as step traffic): one tensor at a
        time, in place, so no rank holds a second copy of the model."""
        if not self.distributed or not self.params:
            return
        with torch.no_grad():
            for p in self.params:
                t = p.detach()
                buf = t if t.is_contiguous() else t.contiguous()
                dist.broadcast(buf, src=0)
                if buf is not t:
                    t.copy_(buf)

    # -- the contract ---------------------------------------------------------------------------
    def build(self, builder: Callable[[], nn.Module]) -> nn.Module:
        """The model of ``builder()``, on this rank's device and wrapped (``wrap``'s result); the
        caller has seeded torch alike on every rank. Builds the whole model; a sharded strategy may
        build only its shard."""
        return self.wrap(builder().to(self.env.device))

    @abc.abstractmethod
    def wrap(self, model: nn.Module) -> nn.Module:
        """Attach to ``model``, make the ranks identical, return the module to train through."""

    def build_optimizer(self, params: Iterable[nn.Parameter], optimizer_class: type[torch.optim.Optimizer],
                        **defaults: Any) -> torch.optim.Optimizer:
        """The trial's optimizer over ``params`` (the wrapped model's): ``optimizer_class(params,
        **defaults)`` unless the strategy shards it."""
        return optimizer_class(params, **defaults)

    def prepare_optimizer(self, optimizer: OptimizerLike) -> None:  # noqa: B027 - optional hook
        """Adjust the optimizer once (e.g. MEASGD's Nesterov momentum)."""

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """Context for micro-batches that only accumulate gradients (no exchange)."""
        return contextlib.nullcontext()

    def before_step(self) -> None:  # noqa: B027 - optional hook
        """Start of an optimizer step, before its first forward pass."""

    def after_backward(self) -> None:  # noqa: B027 - optional hook
        """After the step's last backward: exchange gradients if the strategy does."""

    @abc.abstractmethod
    def step(self, optimizer: OptimizerLike) -> None:
        """Apply the update (the optimizer's step) and any parameter exchange."""

    def end_epoch(self) -> None:  # noqa: B027 - optional hook
        """Make ``eval_module()`` identical on every rank."""

    def eval_module(self) -> nn.Module:
        """The model to evaluate (identical on every rank after ``end_epoch``)."""
        if self.model is None:
            raise RuntimeError(f"{self.name}: eval_module() called before wrap()")
        return self.model

    @abc.abstractmethod
    def theoretical_bytes_per_step(self) -> float:
        """Bytes this rank should send per step by the strategy's communication pattern."""

    def comm_stats(self) -> dict[str, float]:
        """The meter's per-step numbers plus the model size and the theoretical volume."""
        return {**self.meter.metrics(), "model_bytes": float(self.model_bytes),
                "theory_bytes_per_step": self.theoretical_bytes_per_step()}

    def state_dict(self) -> dict[str, Any]:
        """This rank's strategy state for a checkpoint (subclasses add theirs to this dict)."""
        return {"name": self.name, "meter": self.meter.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()``'s output (after ``wrap`` and ``prepare_optimizer``)."""
        if state.get("name") != self.name:
            raise ValueError(
                f"checkpoint: the strategy state is {state.get('name')!r}'s, but this trial runs "
                f"{self.name!r}. Fix: resume with the same training.strategy, or delete the checkpoint "
                "directory to start over")
        self.meter.load_state_dict(state.get("meter", {}))

    def training_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The model's and the optimizer's state for a checkpoint: ``{"model": ..., "optimizer": ...}``
        (a replicated model: their ``state_dict()``s; a sharded strategy: this rank's shards)."""
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def load_training_state(self, state: Mapping[str, Any], model: nn.Module,
                            optimizer: torch.optim.Optimizer) -> None:
        """Restore ``training_state``'s output (after ``wrap`` and ``build_optimizer``)."""
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def sharded_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        """This rank's part of the sharded model's and optimizer's state, by name (``sharded`` only)."""
        raise NotImplementedError(f"{self.name} keeps a replica of the model: its state is in training_state")

    def sharded_template(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> ShardedTemplate:
        """What a resumed sharded state is read into, at this rank's sharding now (``sharded`` only)."""
        raise NotImplementedError(f"{self.name} keeps a replica of the model: its state is in training_state")

    def make_grad_scaler(self) -> torch.amp.GradScaler:
        """The loss scaler of an fp16 trial: its decision to skip a step (an inf or NaN gradient) must
        be the same on every rank that holds the same model (a sharded strategy all-reduces it)."""
        return torch.amp.GradScaler(self.env.device.type)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the strategy holds (called in ``finally``)."""
