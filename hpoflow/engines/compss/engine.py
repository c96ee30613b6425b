"""The compss engine: every trial is a PyCOMPSs task that COMPSs places on nodes and GPUs.

Modes
- *runtime* (under ``runcompss``/``enqueue_compss``): ``submit`` calls a task variant from
  ``tasks`` (``@constraint`` + ``@on_failure(IGNORE)`` + ``@task``, plus ``@multinode`` for
  ``resources.nodes > 1``) inside ``TaskGroup(f"trial-{n}", implicit_barrier=False)``.
- *sequential* (plain ``python``; pycompss importable without the runtime, or absent with an explicit
  ``sequential=True``): one trial at a time, its task body run in a background thread exactly as
  PyCOMPSs would run it synchronously, so reports and pruning still flow. Multi-node trials need
  the runtime and are refused with an ``EngineError``.
- pycompss not installed and ``sequential`` not given: ``EngineError`` with the install steps.

Per-trial resources: the study's ``TaskShape`` (``CompssOptions.task_shape``: literal computing
units, GPUs, memory and nodes per trial, see ``shape``) is built into the task by ``tasks.build``
before the first call registers it: at construction when the caller knows the shape
(``workflows/hpo.py`` derives it from the spec), else at the first ``submit``. A trial of another
shape is refused with an ``EngineError``: one COMPSs application registers one shape.

Results in completion order (PyCOMPSs has no wait-any): each task writes its ``TrialResult``
atomically to ``<trial_dir>/attempt-<k>/result.json`` on the shared run directory; ``poll`` looks
for those files and for new lines of ``reports.jsonl`` (``TrialReport`` events; ``answer`` writes
the pruning decision file rank 0 waits for), then ``compss_wait_on``s the finished future (which
returns at once). ``None`` (or the ``@on_failure`` default) from ``compss_wait_on`` means the task
crashed: a failed trial. A task whose heartbeat file goes stale is treated the same way. No trial
failure ever stops the application.

Cancel: a ``STOP`` file in the attempt directory (every rank on every node watches it and kills its
process group) plus ``compss_cancel_group`` for a task that has not started or does not end.

Placement: a multi-node task whose nodes COMPSs put on one host gives them back at once with an
*infrastructure* result (``placement``); the engine submits the same attempt again, at most
``compss.placement_retries`` times in a row, and the driver never sees it (``resources.max_retries``
counts only a trial's own failures, and this one once the placement retries are used up).

Elastic trials (``ElasticBook``, docs/elastic.md) run one task per size; ``compss.slots`` says what is
idle, ``compss.cpus_per_node``/``gpus_per_node`` cap a size at one worker per node, and
``resources.timeout`` bounds the whole trial from its first start: each segment runs with what is
left of it.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from hpoflow.engines.base import Engine, Event, TrialReport, TrialRequest
from hpoflow.engines.cluster.attempt import HEARTBEAT_S, run_trial
from hpoflow.engines.compss._api import INSTALL_HINT, api, pycompss_available, runtime_active
from hpoflow.engines.compss._run import TaskRun, mtime, numbers, task_result, whole_trial_timeout
from hpoflow.engines.compss.options import CompssOptions
from hpoflow.engines.compss.placement import INFRASTRUCTURE
from hpoflow.engines.compss.shape import TaskShape
from hpoflow.engines.elastic import ElasticBook, Segments
from hpoflow.errors import EngineError
from hpoflow.fileio import append_jsonl, read_json, write_json_atomic
from hpoflow.train.transport import ReportReader, TrialFiles

__all__ = ["CompssEngine", "CompssOptions", "TaskShape", "pycompss_available", "runtime_active"]

log = logging.getLogger(__name__)

_CANCEL_WAIT_S = 30.0
PAUSE_GRACE_S = 120.0  # a paused trial that has not stopped at a step by then is cancelled


class CompssEngine(Engine):
    """Runs each trial as a PyCOMPSs task; see the module docstring."""

    name = "compss"

    @classmethod
    def from_options(cls, options: CompssOptions, run_dir: Path | None = None) -> CompssEngine:
        """The registry's constructor (``hpoflow.registry.ENGINES``): from a ``CompssOptions``."""
        return cls(run_dir, **options.model_dump())

    def __init__(self, run_dir: str | os.PathLike[str] | None = None, *, sequential: bool | None = None,
                 shape: TaskShape | None = None, **options: Any) -> None:
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.options = CompssOptions.from_mapping(options)
        if sequential is None:
            if runtime_active():
                sequential = False
            elif pycompss_available():
                sequential = True
            else:
                raise EngineError(
                    "the compss engine needs PyCOMPSs, which is not importable here (no module "
                    f"'pycompss'). {INSTALL_HINT}"
                )
        elif not sequential and not runtime_active():
            raise EngineError(
                "CompssEngine(sequential=False) needs the COMPSs runtime, but this process was not "
                "started by runcompss/enqueue_compss. Fix: launch with `hpoflow launch SPEC --engine "
                "compss`, or pass sequential=True to run the trials one at a time here"
            )
        self.sequential = bool(sequential)
        self._pool: cf.ThreadPoolExecutor | None = None
        self._task: Any = None
        self._shape: TaskShape | None = None
        self._trials: dict[int, TaskRun] = {}
        self._events: list[Event] = []
        self._closed = False
        # elastic trials' sizes (hpoflow.engines.elastic), never past one worker per node where it is known
        self._book = ElasticBook(node_cpus=self.options.cpus_per_node, node_gpus=self.options.gpus_per_node)
        if shape is not None:
            self._load_task(shape)

    # -- contract -------------------------------------------------------------------------------
    @classmethod
    def check_fit(cls, options: CompssOptions, request: TrialRequest) -> None:
        """The trial's shape must split evenly over its nodes (what COMPSs then places is up to it)."""
        options.task_shape(request)

    def capacity(self, request: TrialRequest) -> int:
        if self.sequential:
            return 0 if request.nodes > 1 else 1
        return self.options.max_in_flight or 1 << 16  # COMPSs queues; the driver's max_concurrent rules

    def submit(self, request: TrialRequest) -> None:
        if self._closed:
            raise EngineError("the compss engine is closed")
        shape = self.options.task_shape(request)
        if self.sequential and request.nodes > 1:
            raise EngineError(
                f"trial {request.number} spans resources.nodes={request.nodes} nodes, which needs the COMPSs "
                "runtime (@multinode cannot run in sequential mode). Fix: launch with `hpoflow launch SPEC "
                "--engine compss --nodes N`, or set resources.nodes: 1 to try the study here"
            )
        if self.sequential and self._trials:
            raise EngineError(
                f"trial {request.number} submitted while trial {next(iter(self._trials))} runs; sequential "
                "mode runs one trial at a time (capacity() is 1)"
            )
        self._launch(request, shape)
        if request.elastic:
            t = self._trials[request.number]
            t.segments = Segments(t.submitted, request.processes, request.cpus_per_process)
            self._book.add_request(request, t.submitted)

    def _launch(self, request: TrialRequest, shape: TaskShape, prior: TaskRun | None = None) -> None:
        """Call the trial's task: a new trial, or (``prior``) the same attempt again: the next segment of
        an elastic trial on ``request.processes`` ranks, or a task whose placement was given back, in
        the same attempt directory (its protocol files start afresh)."""
        files = TrialFiles(Path(request.trial_dir), request.attempt)
        self._fresh_attempt_dir(files)
        segment = prior.segments.resizes if prior is not None and prior.segments is not None else 0
        placed = prior.placements if prior is not None else 0
        group = f"trial-{request.number}" + (f".{request.attempt}" if request.attempt else "") + \
            (f".s{segment}" if segment else "") + (f".p{placed}" if placed else "")
        opts_json = json.dumps(self.options.for_task())
        if self.sequential:
            if self._pool is None:
                self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpoflow-compss-seq")
            future: Any = self._pool.submit(run_trial, request.to_json(), opts_json)
        else:
            task_fn = self._task_for(request, shape)
            with api().TaskGroup(group, implicit_barrier=False):
                future = task_fn(request.to_json(), opts_json)
        now = time.monotonic()
        if prior is None:
            self._trials[request.number] = TaskRun(request, files, future, group, now, ReportReader(files.reports),
                                                  shape=shape, task_at=now, timeout=request.timeout)
        else:
            self._trials[request.number] = replace(
                prior, request=request, files=files, future=future, group=group, reader=ReportReader(files.reports),
                pending_answer=None, deferred=None, extra={}, shape=shape, task_at=now, cancel_time=None,
                group_cancelled=False)

    def _free_slots(self, exclude: int | None = None) -> int:
        """``compss.slots`` minus the cores of the trials submitted (running or queued in COMPSs)."""
        if self.options.slots is None:
            return 0
        used = sum(t.cores() for t in self._trials.values() if t.request.number != exclude)
        return self.options.slots - used

    def _flush_answers(self) -> None:
        """Answer elastic trials' reports now that the driver has submitted what it could: the prune
        decision with the number of ranks to continue with."""
        book = self._book
        free = self._free_slots()
        for t in self._trials.values():
            if t.deferred is None or t.pending_answer is None:
                continue
            prune, t.deferred = t.deferred, None
            seq, t.pending_answer = t.pending_answer, None
            world = 0 if prune or self.options.slots is None else \
                book.decide(t.request.number, max(0, free), max(0, -free))
            with contextlib.suppress(OSError):
                write_json_atomic(t.files.answer(seq), {"prune": bool(prune), "world": world})

    def _restart(self, t: TaskRun, usage: dict[str, float], ran_s: float) -> bool:
        """An elastic trial's task ended at an epoch boundary, checkpointed (with this system ``usage``,
        after running ``ran_s``): submit its next segment with the size its book asked for, or the
        largest that fits in what is free. ``resources.timeout`` bounds the whole trial, from its first
        start over every size: the next segment gets what is left of it (False: nothing is left)."""
        book = self._book
        number = t.request.number
        now = time.monotonic()
        if t.segments is None or number not in book:
            raise EngineError(f"trial {number} resized but is not elastic")
        if t.run_start is None:
            t.run_start = now - max(0.0, ran_s)
        timeout = t.timeout
        left = None if not timeout else timeout - (now - t.run_start)
        if left is not None and left <= 0:
            return False
        free = self._free_slots(exclude=number) if self.options.slots is not None else t.cores()
        size = book.fit(number, free)
        grown = replace(t.request, processes=size)
        with contextlib.suppress(OSError):
            append_jsonl(Path(t.request.trial_dir) / "elastic.jsonl",
                         {"time": time.time(), "from": t.request.processes, "to": size})
        t.segments.restart(now, size, [usage])
        # the task registers the trial's timeout (its COMPSs time_out backstop, one core element per size);
        # the run gets what is left of it
        self._launch(replace(grown, timeout=left), self.options.task_shape(replace(grown, timeout=timeout)),
                     prior=t)
        book.on_restart(number, size, now)
        return True

    def poll(self, timeout: float | None) -> list[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._flush_answers()
        while True:
            for t in list(self._trials.values()):
                self._check(t)
            if self._events or not self._trials:
                out, self._events = self._events, []
                return out
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            step = self.options.poll_interval_s
            time.sleep(step if deadline is None else max(0.0, min(step, deadline - now)))

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        t = self._trials.get(number)
        if t is None or t.pending_answer is None:
            return
        if t.request.elastic and not pause:  # answered at the next poll, with its size (_flush_answers)
            t.deferred = prune
            return
        seq, t.pending_answer = t.pending_answer, None
        with contextlib.suppress(OSError):
            write_json_atomic(t.files.answer(seq), {"prune": bool(prune), "pause": bool(pause)})

    def cancel(self, number: int, reason: str) -> None:
        t = self._trials.get(number)
        if t is None or t.cancel_reason is not None:
            return
        t.cancel_reason = reason
        t.cancel_time = time.monotonic()
        with contextlib.suppress(OSError):
            t.files.dir.mkdir(parents=True, exist_ok=True)
            t.files.stop.write_text(f"{reason}\n")
        if not self.sequential and not t.files.heartbeat.exists():
            self._cancel_group(t)  # not started yet: don't let it start

    def pause(self, number: int, reason: str) -> None:
        """A ``PAUSE`` file every rank watches (they stop at their next step with a checkpoint); a trial
        that has not started yet is cancelled."""
        t = self._trials.get(number)
        if t is None or t.cancel_reason is not None:
            return
        if not t.files.heartbeat.exists():
            self.cancel(number, reason)
            return
        t.extra.setdefault("paused_at", time.monotonic())
        with contextlib.suppress(OSError):
            t.files.pause.write_text(f"{reason}\n")

    def running(self) -> list[int]:
        return sorted(self._trials)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for number in list(self._trials):
            self.cancel(number, "engine closed")
        end = time.monotonic() + self.options.kill_grace_s + 10.0
        while self._trials and time.monotonic() < end:
            for t in list(self._trials.values()):
                self._check(t)
            if self._trials:
                time.sleep(0.05)
        for t in list(self._trials.values()):
            self._cancel_group(t)
        self._trials.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    # -- internals ------------------------------------------------------------------------------
    def _fresh_attempt_dir(self, files: TrialFiles) -> None:
        """A new attempt starts with no protocol files (a resumed study may reuse a directory)."""
        files.dir.mkdir(parents=True, exist_ok=True)
        for p in files.dir.iterdir():
            if p.is_file():
                with contextlib.suppress(OSError):
                    p.unlink()

    def _load_task(self, shape: TaskShape) -> None:
        """Build the study's task with literal values (runtime mode only: it imports pycompss)."""
        self._shape = shape
        if not self.sequential:
            from hpoflow.engines.compss import tasks as _compss_tasks

            self._task = _compss_tasks.build(shape)

    def _task_for(self, request: TrialRequest, shape: TaskShape) -> Any:
        if self._shape is None:
            self._load_task(shape)
        elif shape != self._shape and request.elastic:  # another size of an elastic trial: its own task
            from hpoflow.engines.compss import tasks as _compss_tasks

            return _compss_tasks.build(shape, elastic=True)
        elif shape != self._shape:
            raise EngineError(
                f"trial {request.number} asks for {shape.describe()}, but this COMPSs application registered "
                f"its trial task for {self._shape.describe()}; one COMPSs application runs one shape. Fix: "
                "keep resources equal for all trials of a study")
        return self._task

    def _cancel_group(self, t: TaskRun) -> None:
        if self.sequential or t.group_cancelled:
            return
        t.group_cancelled = True
        with contextlib.suppress(Exception):  # the runtime may already have finished the group
            api().compss_cancel_group(t.group)

    def _read_reports(self, t: TaskRun) -> None:
        for item in t.reader.read_new():
            if "step" not in item:
                continue
            if t.first_report is None:
                t.first_report = time.monotonic()
            wants = bool(item.get("wants_answer"))
            if wants:
                t.pending_answer = int(item.get("seq", 0))
            metrics = {str(k): float(v) for k, v in (item.get("metrics") or {}).items()}
            self._book.on_report(t.request.number, metrics, time.monotonic())
            self._events.append(TrialReport(t.request.number, int(item["step"]), metrics, wants))

    def _finished(self, t: TaskRun) -> bool:
        if self.sequential:
            return bool(t.future.done())
        if t.files.result.exists():
            return True
        now = time.monotonic()
        hb = mtime(t.files.heartbeat)
        if hb is not None and time.time() - hb > max(self.options.heartbeat_timeout_s, 3 * HEARTBEAT_S):
            t.extra["why"] = "its heartbeat stopped (the worker or its node died)"
            return True
        if t.cancel_time is not None and now - t.cancel_time > _CANCEL_WAIT_S + self.options.kill_grace_s:
            t.extra["why"] = "cancelled"
            return True
        if hb is None and now - t.task_at > self.options.start_timeout_s and not self._any_alive():
            t.extra["why"] = (f"it did not start within compss.start_timeout_s={self.options.start_timeout_s:g} s "
                              "while no other trial ran")
            return True
        return False

    def _any_alive(self) -> bool:
        limit = max(self.options.heartbeat_timeout_s, 3 * HEARTBEAT_S)
        for t in self._trials.values():
            hb = mtime(t.files.heartbeat)
            if hb is not None and time.time() - hb <= limit and not t.files.result.exists():
                return True
        return False

    def _check(self, t: TaskRun) -> None:
        self._read_reports(t)
        paused = t.extra.get("paused_at")
        if paused is not None and t.cancel_reason is None and time.monotonic() - paused > PAUSE_GRACE_S:
            self.cancel(t.request.number, f"did not pause within {PAUSE_GRACE_S:g} s: stopped")
        if t.cancel_reason is not None and not t.group_cancelled and t.cancel_time is not None and (
                time.monotonic() - t.cancel_time > self.options.kill_grace_s + 5.0):
            self._cancel_group(t)
        if not self._finished(t):
            return
        self._read_reports(t)  # every report before the result
        data = self._collect(t)
        if isinstance(data, dict) and t.cancel_reason is None:
            if data.get(INFRASTRUCTURE) and self._place_again(t, data):
                return
            if data.get("status") == "resized":
                ran_s = numbers(data.get("timings")).get("duration_s", 0.0)
                if self._restart(t, numbers(data.get("system")), ran_s):
                    return
                data = {"status": "failed", "retryable": False,
                        "error": f"timed out after {t.timeout:g} s (resources.timeout, over all its sizes)"}
        res = task_result(t, data)
        if t.placements:
            res = replace(res, timings={**res.timings, "placement_retries": float(t.placements)})
        if t.segments is not None:  # every size's cores, resizes and usage
            res = replace(res, timings={**res.timings, **t.segments.timings(time.monotonic())})
            system = t.segments.system([res.system])
            if system is not None:
                res = replace(res, system=system)
            if t.segments.resizes and res.error and t.timeout:  # a segment's timeout is what was left of the trial's
                res = replace(res, error=whole_trial_timeout(res.error, t.timeout))
        self._book.remove(t.request.number)
        self._events.append(res)
        del self._trials[t.request.number]

    def _place_again(self, t: TaskRun, data: dict[str, Any]) -> bool:
        """COMPSs put two nodes of this multi-node task on one host, and the task gave them back at once
        (``placement``): submit the same attempt again, without counting it as a retry of the trial, at most
        ``compss.placement_retries`` times in a row (False: no more; the result then fails the trial,
        retryable, and ``resources.max_retries`` counts it)."""
        number = t.request.number
        if t.placements >= self.options.placement_retries:
            limit = self.options.placement_retries
            data["error"] = (f"{data.get('error') or 'COMPSs placed two nodes on one host'} (given back "
                             f"{t.placements + 1} time(s) in a row; compss.placement_retries={limit})")
            return False
        t.placements += 1
        log.warning("trial %d: COMPSs placed two of its nodes on one host (COMPSS_HOSTNAMES=%s); submitted again "
                    "(%d of compss.placement_retries=%d). Fix: hpoflow launch --cpus-per-node (compss.cpus_per_node)",
                    number, data.get("hosts", "?"), t.placements, self.options.placement_retries)
        shape = t.shape if t.shape is not None else self.options.task_shape(t.request)
        self._launch(t.request, shape, prior=t)
        return True

    def _collect(self, t: TaskRun) -> dict[str, Any] | None:
        file_data = read_json(t.files.result)
        if self.sequential:
            try:
                value = t.future.result()
            except Exception as exc:  # run_trial never raises; belt and braces
                value = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
            return file_data if isinstance(file_data, dict) else value
        if t.extra.get("why") == "cancelled" and not isinstance(file_data, dict):
            return None  # don't block on a cancelled task's future
        try:
            value = api().compss_wait_on(t.future)
        except Exception as exc:  # a cancelled or lost task
            value = None
            t.extra.setdefault("why", f"compss_wait_on raised {type(exc).__name__}: {exc}")
        if isinstance(file_data, dict):
            return file_data
        if isinstance(value, dict) and not value.get("compss_default"):
            return value
        return None
