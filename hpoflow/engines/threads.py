"""The thread engine: trials as Python calls in threads of this process.

For objectives that are plain Python (no torch training, no isolation needed): driver tests,
simulations and benchmarks of the driver itself. ``objective(params, reporter)`` returns the metric
value or a dict of metrics; ``reporter.report(step, **metrics)`` returns True when the trial
should stop (pruned). Exceptions become failed results, as in every engine.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from hpoflow.engines.base import Engine, Event, TrialReport, TrialRequest, TrialResult, TrialStatus

__all__ = ["Reporter", "ThreadEngine"]


class Reporter:
    """Given to an objective: ``report(step, **metrics) -> bool`` (True: stop, the trial is pruned)."""

    def __init__(self, engine: ThreadEngine, request: TrialRequest) -> None:
        self._engine = engine
        self._request = request
        self._answers: queue.Queue[bool] = queue.Queue()
        self.pruned = False

    def report(self, step: int, /, **metrics: float) -> bool:
        wants = self._request.pruning and self._request.metric in metrics
        self._engine._events.put(TrialReport(self._request.number, step, dict(metrics), wants))
        if wants:
            self.pruned = self._answers.get()
        return self.pruned


class ThreadEngine(Engine):
    name = "threads"

    def __init__(self, objective: Callable[[dict[str, Any], Reporter], Any], slots: int = 1) -> None:
        self.objective = objective
        self.slots = slots
        self._pool = ThreadPoolExecutor(max_workers=max(1, slots), thread_name_prefix="hpoflow-trial")
        self._events: queue.Queue[Event] = queue.Queue()
        self._reporters: dict[int, Reporter] = {}
        self._cancelled: set[int] = set()
        self._lock = threading.Lock()
        self.max_in_flight = 0
        self.submitted: list[TrialRequest] = []

    def capacity(self, request: TrialRequest) -> int:
        return self.slots

    def submit(self, request: TrialRequest) -> None:
        reporter = Reporter(self, request)
        with self._lock:
            self._reporters[request.number] = reporter
            self.max_in_flight = max(self.max_in_flight, len(self._reporters))
        self.submitted.append(request)
        self._pool.submit(self._run, request, reporter)

    def _run(self, request: TrialRequest, reporter: Reporter) -> None:
        t0 = time.monotonic()
        try:
            ret = self.objective(dict(request.params), reporter)
            metrics = ret if isinstance(ret, dict) else {request.metric: float(ret)}
            status: TrialStatus = "pruned" if reporter.pruned else "complete"
            res = TrialResult(request.number, status, value=metrics.get(request.metric),
                              metrics={k: float(v) for k, v in metrics.items()},
                              timings={"duration_s": time.monotonic() - t0})
        except Exception as exc:  # a trial never raises through the engine
            res = TrialResult(request.number, "failed", error=f"{type(exc).__name__}: {exc}",
                              stderr_tail=traceback.format_exc()[-2000:],
                              timings={"duration_s": time.monotonic() - t0})
        if request.number in self._cancelled:
            res = TrialResult(request.number, "cancelled", error="cancelled", timings=res.timings)
        self._events.put(res)

    def poll(self, timeout: float | None) -> list[Event]:
        out: list[Event] = []
        try:
            out.append(self._events.get(timeout=timeout))
        except queue.Empty:
            return out
        while True:
            try:
                out.append(self._events.get_nowait())
            except queue.Empty:
                break
        for ev in out:
            if isinstance(ev, TrialResult):
                with self._lock:
                    self._reporters.pop(ev.number, None)
        return out

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:  # no pause: threads do not stop
        r = self._reporters.get(number)
        if r is not None:
            r._answers.put(prune)

    def cancel(self, number: int, reason: str) -> None:
        # Threads cannot be killed: the trial finishes and is reported as cancelled.
        self._cancelled.add(number)
        self.answer(number, True)

    def running(self) -> list[int]:
        with self._lock:
            return sorted(self._reporters)

    def close(self) -> None:
        for n in self.running():
            self.cancel(n, "engine closed")
        self._pool.shutdown(wait=True)
