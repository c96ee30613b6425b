"""The engine contract: how trials run, separate from what runs next (the driver and the search).

An engine takes ``TrialRequest``s and hands back, in whatever order they happen, ``TrialReport``s
(an intermediate metric from a running trial) and ``TrialResult``s (a trial has ended). The driver
is the only caller and calls from one thread; engines need not be thread safe.

Contract, for every engine:
- ``submit(request)`` starts the trial or raises ``EngineError`` if it can never fit; it returns
  quickly (it never waits for the trial).
- ``poll(timeout)`` waits up to ``timeout`` seconds (``None``: until something happens) and returns
  every event that has happened since the last call, in the order they happened; ``[]`` on timeout.
  Each submitted trial produces exactly one ``TrialResult``, after all of its ``TrialReport``s.
- A trial never raises through the engine: failures (exceptions in user code, a rank that died or
  hung, a timeout) come back as a ``TrialResult`` with status ``failed`` and the error and stderr tail.
- ``answer(number, prune)`` replies to a report that asked for a pruning decision.
- ``cancel(number, reason)`` stops a running trial; its result arrives later with status
  ``cancelled`` (or whatever it had already finished with).
- ``close()`` cancels what is running, reaps every process, and is idempotent.
"""

from __future__ import annotations

import abc
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "Engine",
    "Event",
    "Placement",
    "TrialReport",
    "TrialRequest",
    "TrialResult",
    "TrialStatus",
]

TrialStatus = Literal["complete", "failed", "pruned", "cancelled"]


@dataclass(frozen=True)
class TrialRequest:
    """Everything a trial needs to run, in plain data (JSON- and pickle-able)."""

    number: int
    params: dict[str, Any]
    train: dict[str, Any]  # a resolved TrainConfig as a dict
    metric: str
    direction: str
    trial_dir: str
    processes: int = 1
    cpus_per_process: int = 1
    gpus_per_process: int = 0
    nodes: int = 1
    timeout: float | None = None
    attempt: int = 0
    pruning: bool = False  # rank 0 waits for a decision after each report
    python_path: tuple[str, ...] = ()
    seed: int = 0
    # Where the trial's checkpoints live. A trial rerun after a crash or a stop gets the directory
    # of the trial it replaces, so it resumes from that trial's last checkpoint.
    checkpoint_dir: str = ""

    @property
    def checkpoints(self) -> str:
        return self.checkpoint_dir or f"{self.trial_dir}/checkpoints"

    @classmethod
    def shape(cls, processes: int, cpus_per_process: int, gpus_per_process: int, nodes: int = 1) -> TrialRequest:
        """A request that only describes a trial's resource shape (for capacity and fit checks)."""
        return cls(-1, {}, {}, "", "", "", processes, cpus_per_process, gpus_per_process, nodes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TrialRequest:
        data = json.loads(text)
        data["python_path"] = tuple(data.get("python_path", ()))
        return cls(**data)


@dataclass(frozen=True)
class TrialReport:
    """An intermediate result: ``metrics`` at ``step`` (an epoch for the built-in trainer)."""

    number: int
    step: int
    metrics: dict[str, float]
    wants_answer: bool = False


@dataclass(frozen=True)
class TrialResult:
    """How a trial ended. ``value`` is the objective metric when ``status == 'complete'``."""

    number: int
    status: TrialStatus
    value: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    stderr_tail: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    retryable: bool = False  # died by a signal, lost rank or timeout (not an exception in user code)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialResult:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


Event = TrialReport | TrialResult


@dataclass(frozen=True)
class Placement:
    """Where one rank of a trial runs on this machine: cores and GPU ids it may use."""

    rank: int
    cores: tuple[int, ...]
    gpus: tuple[int, ...] = ()


class Engine(abc.ABC):
    """Runs trials. See the module docstring for the contract every implementation keeps."""

    name: str = "engine"

    @abc.abstractmethod
    def capacity(self, request: TrialRequest) -> int:
        """How many trials shaped like ``request`` can run at once (0: it can never fit)."""

    @abc.abstractmethod
    def submit(self, request: TrialRequest) -> None: ...

    @abc.abstractmethod
    def poll(self, timeout: float | None) -> list[Event]: ...

    @abc.abstractmethod
    def answer(self, number: int, prune: bool) -> None: ...

    @abc.abstractmethod
    def cancel(self, number: int, reason: str) -> None: ...

    @abc.abstractmethod
    def running(self) -> list[int]:
        """Numbers of the trials submitted whose result has not been returned by ``poll`` yet."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
