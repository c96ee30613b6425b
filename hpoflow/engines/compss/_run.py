"""One trial of the compss engine as the engine tracks it (``TaskRun``: its current task, its elastic
segments, its placement retries), and how a task's result dict becomes the trial's ``TrialResult``."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hpoflow.engines.base import TrialRequest, TrialResult
from hpoflow.engines.compss.shape import TaskShape
from hpoflow.engines.elastic import Segments
from hpoflow.train.transport import ReportReader, TrialFiles

__all__ = ["TaskRun", "mtime", "numbers", "task_result", "whole_trial_timeout"]

_TIMED_OUT = re.compile(r"timed out after \S+ s \(resources\.timeout\)")


@dataclass
class TaskRun:
    """A trial in flight: its request and attempt files, the future and task group of its current task,
    and what outlives one task (an elastic trial's segments, placement retries, the whole timeout)."""

    request: TrialRequest
    files: TrialFiles
    future: Any
    group: str
    submitted: float
    reader: ReportReader
    pending_answer: int | None = None
    first_report: float | None = None
    cancel_reason: str | None = None
    cancel_time: float | None = None
    group_cancelled: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    # elastic trials run as one task per size (``CompssEngine._restart``), and their prune decision waits for
    # the next poll (the engine adds the size to the answer then)
    segments: Segments | None = None
    deferred: bool | None = None
    shape: TaskShape | None = None  # what the current task asked COMPSs for (``cores``)
    task_at: float = 0.0  # when the current task was submitted (a new one per segment or placement retry)
    run_start: float | None = None  # an elastic trial's first start: resources.timeout runs from it
    timeout: float | None = None  # resources.timeout of the whole trial (a segment's request has what is left)
    placements: int = 0  # tasks given back in a row because COMPSs put two of their nodes on one host

    def cores(self) -> int:
        """The computing units its task holds in COMPSs (a multi-node task may ask for whole workers)."""
        if self.shape is not None:
            return self.shape.nodes * self.shape.computing_units
        return self.request.processes * self.request.cpus_per_process


def task_result(t: TaskRun, data: dict[str, Any] | None) -> TrialResult:
    """The trial's result from what its task returned (``None``: it crashed, or was cancelled)."""
    n = t.request.number
    timings = {"duration_s": time.monotonic() - t.submitted}
    if data is None:
        if t.cancel_reason is not None:
            return TrialResult(n, "cancelled", error=t.cancel_reason, timings=timings)
        why = t.extra.get("why", "compss_wait_on returned None")
        return TrialResult(n, "failed", error=f"the COMPSs task of trial {n} crashed: {why}; see the "
                           "COMPSs job logs", timings=timings, retryable=True)
    res = TrialResult.from_dict({**data, "number": n})
    merged = {**res.timings, "engine_duration_s": timings["duration_s"]}
    if t.cancel_reason is not None and res.status == "failed":
        return TrialResult(n, "cancelled", error=t.cancel_reason, stderr_tail=res.stderr_tail, timings=merged)
    return replace(res, timings=merged)  # everything the task reported, system usage included


def mtime(path: Path) -> float | None:
    """``path``'s modification time, None if it does not exist."""
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def numbers(value: Any) -> dict[str, float]:
    """The numeric entries of a mapping from a task's result (``system``, ``timings``); {} otherwise."""
    if not isinstance(value, dict):
        return {}
    return {str(k): float(v) for k, v in value.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def whole_trial_timeout(error: str, timeout: float) -> str:
    """A segment's timeout message restated for the whole elastic trial (a segment runs with what was left
    of ``resources.timeout``)."""
    return _TIMED_OUT.sub(f"timed out after {timeout:g} s (resources.timeout, over all its sizes)", error)
