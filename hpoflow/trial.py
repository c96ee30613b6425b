"""What a trial is, in plain data shared by every layer that handles one.

``TrialRequest`` (what to run, with what resources), ``TrialReport`` (an intermediate metric),
``TrialResult`` (how it ended) and ``Verdict`` (the oracle's judgement before it runs). The driver
builds requests, engines run them, the rank runner reads them, the report reads results back.
Standard library only: JSON- and pickle-able, safe to import in any process.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["Event", "TrialReport", "TrialRequest", "TrialResult", "TrialStatus", "Verdict"]

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




_VERDICT_SUMMARY_KEYS = ("step_s", "epoch_s", "time_to_train_s", "throughput", "memory_per_device_bytes",
                         "memory_available_bytes", "bottleneck", "max_batch_per_device", "cluster")


@dataclass(frozen=True)
class Verdict:
    """Whether a trial can run; ``reason`` says why not with the numbers; ``predicted`` holds
    the oracle's prediction (``Prediction.to_dict()``) or is empty when the oracle could not
    judge the trial."""

    feasible: bool
    reason: str
    predicted: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"feasible": self.feasible, "reason": self.reason, "predicted": self.predicted}

    def summary(self) -> dict[str, Any]:
        """The few predicted figures stored with a trial (user attr ``oracle``)."""
        return {k: self.predicted[k] for k in _VERDICT_SUMMARY_KEYS if k in self.predicted}
