"""A command trial's rank (``training.command``): the user's program, started as torchrun starts it,
and supervised. The rank process of any engine (a local worker, a cluster rank or step task) runs
``run_command`` as its training function, so every engine places, pins and stops command trials the
way it does any trial.

- **Environment.** The program gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_*``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_RUN_ID``, ...), the rank's ``OMP_NUM_THREADS`` and cores, the GPUs torchrun would show it
  (``hpoflow.train.devices``: ``CUDA_VISIBLE_DEVICES`` lists the trial's GPUs on its node in local-rank
  order, each once, so ``cuda:LOCAL_RANK`` is the rank's own; ``HPOFLOW_CUDA_DEVICE`` is its own GPU's
  index in that list, which differs from ``LOCAL_RANK`` only where ranks of the trial share a GPU), and
  ``HPOFLOW_PARAMS`` (the trial's values, JSON), ``HPOFLOW_TRIAL_DIR``, ``HPOFLOW_CHECKPOINT_DIR``,
  ``HPOFLOW_METRICS_FILE`` and ``HPOFLOW_CONTROL`` (``hpoflow.client``'s channel). ``MASTER_PORT`` is a
  free port of rank 0's host (loopback for a one-node trial), which rank 0 tells the other ranks
  through the store of the process group the rank processes keep among themselves.
- **Metrics**, three ways, all reports of rank 0 going to the study as ``ctx.report`` sends them (the
  pruner and the schedulers decide on them): lines of its stdout (``\n``- or ``\r``-ended) read by
  ``training.metrics`` patterns and ``NAME=VALUE``/``NAME: VALUE`` pairs for a metric of the study, with
  their step (``epoch=N``/``step=N``) or without (``hpoflow.train.lines``: such values never override or
  shift a step reported another way); JSON lines appended to ``HPOFLOW_METRICS_FILE``
  (``{"step": 3, "val_loss": 0.4}``); ``hpoflow.client.report``. The last value of each metric is the
  trial's result. Every report reaches the study (a step's first value of a metric is kept), but what
  is read at once (the metrics file's new lines, the printed lines queued since the last tick) is
  decided on once (``_flush``): only its last report holding ``study.metric`` is judged by the pruner and
  the scheduler (rank 0 waits for that answer alone); the others are sent without a wait. So a report
  costs the same however many came before, and a program that left 100,000 lines behind does not wait
  for 100,000 answers. A report through ``hpoflow.client`` is judged as it comes (its call returns with
  the decision).
- **Signals.** A program ended by a signal hpoflow did not send (the OOM killer's SIGKILL, a preemption's
  SIGTERM, a segfault) fails the attempt as retryable (``CommandError.retryable``): the driver reruns the
  trial up to ``resources.max_retries`` times. hpoflow's own signals (below, after a stop decision; a
  timeout or a cancel, which end the rank too) are no such failure.
- **Stop.** Pruned, paused (a scheduler's rung, the engine's SIGUSR1) or past ``training.epochs``:
  ``hpoflow.client.should_stop()`` turns true on every rank (rank 0 tells the others through the
  store); after ``training.stop_grace_s`` the program's process group gets SIGTERM, 5 s later SIGKILL.
  Whatever it exits with then, the trial is pruned, paused (its next run resumes from what it saved in
  ``HPOFLOW_CHECKPOINT_DIR``) or complete. Otherwise a non-zero exit fails the trial with the end of
  its stderr.

The program runs in a process group of its own, which is killed when the rank ends, whatever way.

**Warm start.** ``python SCRIPT ...`` and ``python -m MODULE ...`` (unless ``training.isolate``) run in a
process forked from the rank process where that has torch imported already (the local engine's warm
workers): ``prefork`` forks a ``Zygote`` when the rank starts, before it makes a thread or a process
group, and the zygote runs the program with ``runpy`` (``sys.argv``, ``sys.path[0]``, the environment,
the working directory and the standard streams set as a fresh ``python`` sets them; Python's, NumPy's
and torch's generators seeded afresh), so it skips the interpreter start and the torch import. Anything
else, and any rank process without torch imported (a cluster rank: a fresh interpreter itself), starts
a fresh process (``subprocess``). What differs from a fresh interpreter: modules the worker imported
are imported already. The program runs as a main process (``hpoflow.train.processes``: it may start
DataLoader workers, a ``Pool``, ``mp.spawn``), in a ``__main__`` module that stays until the process
ends, and ends as an interpreter ends (non-daemon threads joined, ``atexit`` handlers run, streams
flushed), then ``os._exit``.

**Working directory.** The program runs in ``training.workdir`` (default: the trial's directory); the
command's relative paths that exist where hpoflow runs are made absolute there
(``hpoflow.spec.anchor_paths``), ``${trial_dir}`` and ``${checkpoint_dir}`` are replaced
(``hpoflow.spec.run_values``). A failed program's error names its cause first
(``hpoflow.trial.error_cause``: the last exception line of its stderr).
"""

from __future__ import annotations

import builtins
import contextlib
import ctypes
import importlib.machinery
import io
import json
import logging
import math
import os
import queue
import random
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.spec import UNBOUNDED_EPOCHS, anchor_paths, program, run_values, runs_warm, warm_target
from hpoflow.train.context import TrialContext, metric_dict
from hpoflow.train.lines import LineReports, Segments
from hpoflow.train.processes import (
    become_main_process,
    end_like_an_interpreter,
    forget_finalizers,
    keep_process_groups,
)
from hpoflow.train.transport import LineServer, ReportReader
from hpoflow.trial import RankJob, describe_exit, error_cause

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

log = logging.getLogger(__name__)

__all__ = ["CommandError", "LineReports", "Zygote", "command_env", "prefork", "run_command", "running_groups"]

_STOP_KEY = "hpoflow/command/stop"
_MASTER_KEY = "hpoflow/command/master"
KILL_AFTER_S = 5.0  # SIGTERM -> SIGKILL
_TAIL_BYTES = 4000  # of the program's stderr, for the error
_TICK_S = 0.05
_STORE_EVERY_S = 0.2  # a rank other than 0 looks for rank 0's stop decision this often
_BATCH = 4096  # queued items handled in one tick of the supervising loop, at most
_GROUPS: set[int] = set()  # process groups of the programs running in this process


class CommandError(RuntimeError):
    """The program of a command trial failed (it could not start, exited non-zero, reported nothing).
    ``retryable``: it was ended by a signal hpoflow did not send (the OOM killer's SIGKILL, a preemption's
    SIGTERM, a segfault): the driver reruns the trial up to ``resources.max_retries`` times."""

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


def running_groups() -> set[int]:
    """The process groups of the programs this process runs now: what a node's stop watcher kills
    besides its own group (``hpoflow.engines.cluster.node``)."""
    return set(_GROUPS)


def command_env(job: RankJob, master: tuple[str, int], extra: dict[str, str]) -> dict[str, str]:
    """The program's environment: this rank's (its threads), torchrun's variables for this rank, the
    trial's GPUs on this node in local-rank order (``hpoflow.train.devices``: with several ranks on the
    node, agreed through the store of their process group), and ``extra`` (hpoflow's)."""
    from hpoflow.train.devices import program_devices

    req = job.request
    world = job.world_size
    local_world = max(1, world // max(1, req.nodes))
    devices = program_devices(job.rank, job.local_rank, world, local_world, req.gpus_per_process)
    env = dict(os.environ)
    env.update({
        "RANK": str(job.rank), "LOCAL_RANK": str(job.local_rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(job.rank // local_world),
        "GROUP_WORLD_SIZE": str(max(1, req.nodes)), "ROLE_NAME": "default", "ROLE_RANK": str(job.rank),
        "ROLE_WORLD_SIZE": str(world), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
        "TORCHELASTIC_RUN_ID": f"hpoflow-{req.number}-{req.attempt}", "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": str(max(1, job.threads)), "PYTHONUNBUFFERED": "1",
    })
    env.update(devices)
    env.update(extra)
    return env


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class _Stop:
    reason: str  # pruned | paused | ended
    at: float = field(default_factory=time.monotonic)


class _Supervisor:
    def __init__(self, ctx: TrialContext, job: RankJob, zygote: Zygote | None = None) -> None:
        self.ctx, self.job, self.zygote = ctx, job, zygote
        self.req = job.request
        self.rank = job.rank
        self.stop: _Stop | None = None
        self.latest: dict[str, float] = {}
        self.items: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.finished = threading.Event()
        self.tail = bytearray()
        self.lines = LineReports(self.req.metric_names or (self.req.metric,), ctx.config.metrics)
        self.pending: list[tuple[int, dict[str, float]]] = []  # reports read, not sent yet (_flush)
        self.store: Store | None = None
        self.proc: subprocess.Popen[bytes] | _Forked | None = None
        self.server: LineServer | None = None
        self._old_sigterm: Any = None
        self.cwd = ""  # where the program runs (training.workdir), set by run
        self.moved = False  # that is not the directory hpoflow runs in

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        req, cfg = self.req, self.ctx.config
        if cfg.command is None:
            raise CommandError("training.command is not set")
        if self.job.world_size > 1:
            from hpoflow.train.dist import group_store

            self.store = group_store()
        master = self._master()
        # absolute: the program runs in its own working directory (training.workdir), maybe not this one
        trial_dir = Path(req.trial_dir).absolute()
        checkpoints = Path(req.checkpoints).absolute()
        checkpoints.mkdir(parents=True, exist_ok=True)
        launch = req.workdir or os.getcwd()  # the directory hpoflow runs in: relative paths of the spec mean it
        places = {"trial_dir": str(trial_dir), "checkpoint_dir": str(checkpoints)}
        self.cwd = os.path.join(launch, run_values(cfg.workdir, places))
        try:
            os.makedirs(self.cwd, exist_ok=True)
        except OSError as exc:
            raise CommandError(f"cannot make the program's working directory {self.cwd} (training.workdir): {exc}. "
                               "Fix: give a directory hpoflow may create, or '.'") from exc
        command = [run_values(a, places) for a in cfg.command]
        self.moved = os.path.realpath(self.cwd) != os.path.realpath(launch)
        if self.moved:
            command = anchor_paths(command, launch)
        argv = [program(command[0]), *command[1:]]
        metrics_file = trial_dir / ("metrics.jsonl" if self.rank == 0 else f"metrics_rank{self.rank}.jsonl")
        reader = ReportReader(metrics_file)
        with contextlib.suppress(OSError):
            reader.offset = metrics_file.stat().st_size  # an earlier run's lines are not reported again
        self.server = LineServer(self._on_client, host="127.0.0.1", name="hpoflow-client")
        env = command_env(self.job, master, {
            "HPOFLOW_PARAMS": json.dumps(req.params), "HPOFLOW_TRIAL_DIR": str(trial_dir),
            "HPOFLOW_CHECKPOINT_DIR": str(checkpoints), "HPOFLOW_METRICS_FILE": str(metrics_file),
            "HPOFLOW_CONTROL": self.server.announce("127.0.0.1"), "HPOFLOW_ATTEMPT": str(req.attempt),
        })
        runnable = warm_target(command)  # (python SCRIPT / python -m MODULE: what a zygote can run)
        if self.moved and runnable is not None and runnable[0] == "module":
            # python -m finds its module in the current directory: here, the one hpoflow runs in
            env["PYTHONPATH"] = os.pathsep.join(p for p in (launch, env.get("PYTHONPATH", "")) if p)
        target = runnable if self.zygote is not None else None
        log.info("command: rank %d runs %s%s (MASTER_ADDR=%s MASTER_PORT=%d)", self.rank, shlex.join(argv),
                 " warm (runpy in a process forked with torch imported)" if target else "", *master)
        proc: subprocess.Popen[bytes] | _Forked
        if target is not None and self.zygote is not None:
            zygote, self.zygote = self.zygote, None
            proc = self.proc = zygote.start(target, env, self.cwd, launch)
        else:
            try:
                proc = self.proc = subprocess.Popen(argv, env=env, cwd=self.cwd, stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, process_group=0)
            except OSError as exc:
                raise CommandError(f"cannot start {shlex.join(cfg.command)} (training.command): {exc}") from exc
        _GROUPS.add(proc.pid)
        self._on_sigterm()
        on_line = self._on_line if self.rank == 0 else None
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, 1, on_line, None), daemon=True),
                 threading.Thread(target=_pump, args=(proc.stderr, 2, None, self.tail), daemon=True)]
        for t in pumps:
            t.start()
        self._supervise(proc, reader if self.rank == 0 else None)
        if self.rank == 0 and self.store is not None and self.stop is None:
            # rank 0's program has ended: a peer's that does not end too (a hang in its interpreter's teardown,
            # a wait for a rank that is gone) gets training.stop_grace_s, then SIGTERM, then SIGKILL
            self.store.set(_STOP_KEY, "exited")
        for t in pumps:  # the program's last lines (a child it left holding the pipes: killed in close)
            t.join(5.0)
        self._kill(signal.SIGKILL)
        for t in pumps:
            t.join(5.0)
        self._drain(reader if self.rank == 0 else None)
        return self._outcome(proc.returncode, cfg.command)

    def _master(self) -> tuple[str, int]:
        """Where the program's rank 0 serves torch.distributed's rendezvous: a free port of rank 0's host."""
        if self.store is None:
            return "127.0.0.1", _free_port("127.0.0.1")
        if self.rank == 0:
            if self.req.nodes > 1:
                from hpoflow.train.dist import store_address

                host = store_address()
            else:
                host = "127.0.0.1"
            port = _free_port(host)
            self.store.set(_MASTER_KEY, f"{host} {port}")
            return host, port
        announced, port_text = self.store.get(_MASTER_KEY).decode().split()
        return announced, int(port_text)

    def _supervise(self, proc: subprocess.Popen[bytes] | _Forked, reader: ReportReader | None) -> None:
        next_store = 0.0
        term_sent = False
        while proc.poll() is None:
            batch = self._take(_TICK_S)
            if reader is not None:  # first: what the program wrote there before it printed the lines in batch
                for record in reader.read_new():
                    self._record(record)
            for item in batch:
                self._handle(item)
            self._flush()
            now = time.monotonic()
            if self.store is not None and self.rank != 0 and self.stop is None and now >= next_store:
                next_store = now + _STORE_EVERY_S
                if self.store.check([_STOP_KEY]):
                    self._decide(self.store.get(_STOP_KEY).decode())
            if self.stop is None and self.ctx.pause_request.requested:  # the engine's SIGUSR1
                self._decide("paused")
            if self.stop is not None:
                grace = self.ctx.config.stop_grace_s
                if not term_sent and now >= self.stop.at + grace:
                    term_sent = True
                    log.info("command: rank %d: still running %g s after it was asked to stop: SIGTERM", self.rank,
                             grace)
                    self._kill(signal.SIGTERM)
                elif term_sent and now >= self.stop.at + grace + KILL_AFTER_S:
                    log.info("command: rank %d: still running %g s after SIGTERM: SIGKILL", self.rank, KILL_AFTER_S)
                    self._kill(signal.SIGKILL)
        if self.stop is None and self.store is not None and self.rank != 0:  # rank 0's decision, if its program
            try:  # stopped this one's (a DDP trainer stops every rank together) before the last poll saw it
                if self.store.check([_STOP_KEY]):
                    self._decide(self.store.get(_STOP_KEY).decode())
            except (RuntimeError, OSError):  # rank 0's side is gone: nothing was decided there that reached us
                pass
        if self.stop is None and self.ctx.pause_request.requested:  # a pause signal that reached the program too
            self._decide("paused")
        log.info("command: rank %d: the program %s", self.rank, describe_exit(proc.returncode))

    def _take(self, timeout: float) -> list[tuple[Any, ...]]:
        """The items queued now (waiting up to ``timeout`` for the first), at most ``_BATCH``."""
        try:
            batch = [self.items.get(timeout=timeout)] if timeout > 0 else [self.items.get_nowait()]
        except queue.Empty:
            return []
        while len(batch) < _BATCH:
            try:
                batch.append(self.items.get_nowait())
            except queue.Empty:
                break
        return batch

    def _drain(self, reader: ReportReader | None) -> None:
        """What the program said last, after it ended: lines still queued, the metrics file's last lines."""
        while batch := self._take(0.0):
            for item in batch:
                self._handle(item)
            self._flush()
        if reader is not None:
            for record in reader.read_new():
                self._record(record)
        self._flush()
        self.finished.set()

    def _outcome(self, code: int | None, command: list[str]) -> dict[str, float]:
        reason = self.stop.reason if self.stop is not None else None
        if reason == "pruned":
            self.ctx._prune = True
            return dict(self.latest)
        if reason == "paused":
            self.ctx.pausing = True  # stopped at a step; its next run resumes from its checkpoint
            return dict(self.latest)
        if reason is None and code != 0:
            stderr = self.tail.decode(errors="replace").strip()
            cause = error_cause(stderr)
            hint = ""
            if self.moved and ("FileNotFoundError" in stderr or "No such file" in stderr):
                hint = (f" (it ran in {self.cwd}, training.workdir: a relative path the command does not name is taken "
                        "from there. Fix: name the path in the command, make it absolute, or set training.workdir: .)")
            killed = code is not None and code < 0  # hpoflow's own signals come after a stop decision (reason)
            why = (" (a signal hpoflow did not send: the OOM killer, a preemption, a crash; the trial is rerun up to "
                   "resources.max_retries times)" if killed else "")
            raise CommandError(f"{shlex.join(command)} (training.command) {describe_exit(code)}{why}"
                               + (f": {cause}{hint}; its stderr ended with:\n{stderr}" if stderr
                                  else " and wrote nothing to stderr"), retryable=killed)
        metric = self.req.metric
        if self.rank == 0 and metric not in self.latest:
            late = (f" Its printed values of {metric!r} came after reports that printed values never override "
                    "(through hpoflow.client or HPOFLOW_METRICS_FILE, or with a step where they had none), so they "
                    "were not read." if metric in self.lines.ignored else "")
            group = metric if metric.isidentifier() else "val_loss"
            raise CommandError(
                f"the program never reported {metric!r} (study.metric): no line of rank 0's stdout held "
                f"'{metric}=VALUE', '{metric}: VALUE' or a match of a training.metrics pattern, no line of "
                f"HPOFLOW_METRICS_FILE held it, and hpoflow.client.report() was not given it (reported: "
                f"{sorted(self.latest) or 'nothing'}).{late} Fix: print '{metric}=<value>' (with epoch=<n>) on a "
                f"line of its own; for a program with its own print format, add a training.metrics pattern that "
                f"reads it (a Python regex with a named group per value, e.g. training.metrics: "
                f"['valid loss\\s+(?P<{group}>[-+.\\deE]+)']); or name the metric your program prints in "
                f"study.metric")
        return dict(self.latest)

    # -- reports and decisions ------------------------------------------------------------------
    def _on_line(self, raw: bytes, refresh: bool = False) -> None:
        """A line of rank 0's stdout (``refresh``: after a lone ``\\r``, a progress bar's redraw)."""
        found = self.lines.parse(raw.decode(errors="replace"))
        if found is not None:
            self.items.put(("report", *found, refresh))

    def _record(self, record: dict[str, Any]) -> None:
        """One line of the metrics file: ``step`` (or ``epoch``) and the metrics beside it."""
        step = record.get("step", record.get("epoch"))
        metrics = metric_dict({k: v for k, v in record.items() if k not in ("step", "epoch", "time")}, strict=False,
                              where="HPOFLOW_METRICS_FILE")
        if metrics:
            self._report(step if isinstance(step, int) and not isinstance(step, bool) else None, metrics)

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "report":
            self._report(item[1], item[2], refresh=item[3], printed=True)
        elif kind == "client":
            _, step, metrics, done, box = item
            try:
                self._report(step, metric_dict(metrics, strict=True, where=f"hpoflow.client.report(step={step})"))
            except (TypeError, ValueError) as exc:
                box["error"] = str(exc)
            self._flush()  # its answer waits for the decision on it
            done.set()

    def _report(self, step: int | None, metrics: dict[str, float], refresh: bool = False,
                printed: bool = False) -> None:
        """Values read at ``step`` (None: without one), ``printed`` on stdout or not: the reports they make
        (``LineReports.route``: a printed value never overrides or shifts a step reported another way),
        queued for ``_flush``."""
        if self.stop is None:
            self.pending.extend(self.lines.route(step, metrics, printed=printed, refresh=refresh))

    def _flush(self) -> None:
        """Send the reports read since the last flush (``_coalesce``): every value, each step once, and
        only the last report that holds the study's metric judged (``_emit``). Then decide: pruned or
        paused by that judgement, or ended at ``training.epochs``."""
        pending, self.pending = self.pending, []
        if self.stop is not None or not pending:
            return  # asked to stop: what it says while it stops is not a report
        reports = self._coalesce(pending)
        metric = self.ctx.metric
        judged = max((i for i, (_, m) in enumerate(reports) if metric in m and math.isfinite(m[metric])), default=-1)
        cfg = self.ctx.config
        for i, (step, metrics) in enumerate(reports):
            self._emit(step, metrics, judge=i == judged)
            if self.ctx._prune:
                self._decide("pruned")
            elif self.ctx.pause_request.requested:
                self._decide("paused")
            elif step >= cfg.epochs and cfg.epochs != UNBOUNDED_EPOCHS:
                self._decide("ended")
            if self.stop is not None:
                return

    def _coalesce(self, pending: list[tuple[int, dict[str, float]]]) -> list[tuple[int, dict[str, float]]]:
        """``pending`` as the reports to send: a metric already given at its step left out (printed and
        given to hpoflow.client, it counts once: the first value is kept), consecutive reports of one step
        merged into one, and none after the first at or past ``training.epochs``."""
        cfg = self.ctx.config
        step_now: int | None = None
        said: set[str] = set()  # the metrics of step_now given so far
        for s, m in reversed(self.ctx.reports):
            if step_now is None:
                step_now = s
            if s != step_now:
                break
            said.update(m)
        out: list[tuple[int, dict[str, float]]] = []
        for step, metrics in pending:
            if step != step_now:
                step_now, said = step, set()
            new = {k: v for k, v in metrics.items() if k not in said}
            if not new:
                continue
            said.update(new)
            if out and out[-1][0] == step:
                out[-1][1].update(new)
            else:
                out.append((step, new))
            if step >= cfg.epochs and cfg.epochs != UNBOUNDED_EPOCHS:
                break  # the trial ends here (_flush)
        return out

    def _emit(self, step: int, metrics: dict[str, float], *, judge: bool) -> None:
        """One report to the study. ``judge``: the pruner and the scheduler decide on it (rank 0 waits for
        their answer, ``ctx.report``); otherwise it is recorded and sent without a wait (a value the study
        keeps, on which nothing is decided: a later report of the same batch is)."""
        self.latest.update(metrics)
        if judge or self.ctx.elastic:
            self.ctx.report(step, **metrics)
            return
        self.ctx.reports.append((step, metrics))
        if self.rank == 0:
            self.ctx.channel.report(step, metrics, False)

    def _decide(self, reason: str) -> None:
        if self.stop is not None:
            return
        self.stop = _Stop(reason)
        log.info("command: rank %d: %s; the program has %g s to exit (training.stop_grace_s)", self.rank,
                 {"pruned": "pruned", "paused": "paused", "ended": "its last epoch (training.epochs) reported",
                  "exited": "rank 0's program has ended"}.get(reason, reason), self.ctx.config.stop_grace_s)
        if self.store is not None and self.rank == 0:
            self.store.set(_STOP_KEY, reason)

    def _state(self) -> dict[str, Any]:
        stop = self.stop
        return {"stop": stop is not None, "pausing": stop is not None and stop.reason in ("paused", "ended")}

    def _on_client(self, conn: socket.socket, msg: dict[str, Any]) -> dict[str, Any]:
        """``hpoflow.client``'s requests (a thread of the server): a report waits until the supervising
        loop has sent it (and rank 0 has the decision), so ``should_stop()`` right after it knows."""
        op = msg.get("op")
        if op == "report":
            step = msg.get("step")
            metrics = msg.get("metrics")
            if not isinstance(step, int) or isinstance(step, bool) or not isinstance(metrics, dict):
                return {"error": "a report is {op: report, step: int, metrics: {name: number}}", **self._state()}
            done, box = threading.Event(), dict[str, Any]()
            self.items.put(("client", step, metrics, done, box))
            while not done.wait(0.5) and not self.finished.is_set():
                pass
            return {**box, **self._state()}
        if op == "state":
            return self._state()
        return {"error": f"unknown op {op!r}; the ops are report and state", **self._state()}

    # -- the end --------------------------------------------------------------------------------
    def _on_sigterm(self) -> None:
        """SIGTERM to this rank (srun stopping a step, a node launcher): the program's group is killed
        first, then this process ends as SIGTERM ends it. (Main thread only, where a handler can be set.)"""
        if threading.current_thread() is not threading.main_thread():
            return

        def end(signum: int, frame: Any) -> None:
            self._kill(signal.SIGKILL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)

        self._old_sigterm = signal.signal(signal.SIGTERM, end)

    def _kill(self, sig: int) -> None:
        proc = self.proc
        if proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)

    def close(self) -> None:
        """Kill and reap the program's process group (a rank that raised, a stop); stop serving the client."""
        if self.zygote is not None:
            self.zygote.discard()
        proc = self.proc
        if proc is not None:
            self._kill(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10.0)
            _GROUPS.discard(proc.pid)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    with contextlib.suppress(OSError):
                        stream.close()
        self.finished.set()
        if self.server is not None:
            self.server.close()
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)


def _pump(stream: Any, fd: int, on_line: Callable[[bytes, bool], None] | None, tail: bytearray | None) -> None:
    """Copy the program's ``stream`` to this process's ``fd`` (the rank's log) as it comes; hand each
    complete line (``\\n``-, ``\\r\\n``- or ``\\r``-ended, and whether it is a redraw: ``lines.Segments``) to
    ``on_line``; keep the last ``_TAIL_BYTES`` in ``tail``."""
    src = stream.fileno()
    segments = Segments()
    while True:
        try:
            chunk = os.read(src, 65536)
        except OSError:
            break
        if not chunk:
            break
        view = memoryview(chunk)
        while view:
            try:
                view = view[os.write(fd, view):]
            except OSError:  # the log is gone (a full disk): the program goes on
                break
        if tail is not None:
            tail += chunk
            del tail[:-_TAIL_BYTES]
        if on_line is not None:
            for line, refresh in segments.feed(chunk):
                on_line(line, refresh)
    if on_line is not None:
        for line, refresh in segments.end():
            on_line(line, refresh)


class _Forked:
    """A program a ``Zygote`` runs, seen as ``subprocess.Popen`` shows one: ``pid`` (its process group's
    too), ``stdout``/``stderr`` (pipes), ``poll``, ``wait``, ``returncode``."""

    def __init__(self, pid: int, stdout: int, stderr: int) -> None:
        self.pid = pid
        self.stdout: io.FileIO | None = io.FileIO(stdout, "r")
        self.stderr: io.FileIO | None = io.FileIO(stderr, "r")
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -signal.SIGKILL  # reaped elsewhere (a worker's subreaper): gone
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.poll() is None:
            if time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.01)
        return self.returncode if self.returncode is not None else -1


class Zygote:
    """A child forked from this process (which has torch imported) while it holds no thread and no process
    group: it waits for its order (what to run, the environment, the working directory), then becomes
    the program (``_become``). ``start`` gives the order; ``discard`` (no program after all) ends it."""

    def __init__(self, threads: int) -> None:
        order_r, self._order = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the zygote: never returns
            code = 1
            try:
                os.close(self._order)
                os.close(out_r)
                os.close(err_r)
                code = _become(order_r, out_w, err_w, threads)
            except BaseException:  # the program's own end is handled in _become
                with contextlib.suppress(Exception):
                    traceback.print_exc()
            finally:
                os._exit(code)
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # (also done in the child: whichever runs first)
        for fd in (order_r, out_w, err_w):
            os.close(fd)
        self.pid, self._out, self._err = pid, out_r, err_r
        _GROUPS.add(pid)

    def start(self, target: tuple[str, str, list[str]], env: dict[str, str], cwd: str, launch: str) -> _Forked:
        """Run ``target`` in ``cwd`` (``launch``: the directory hpoflow runs in, where ``python -m`` finds its
        module)."""
        order = json.dumps({"target": list(target), "env": env, "cwd": cwd, "launch": launch}).encode()
        try:
            view = memoryview(order)
            while view:
                view = view[os.write(self._order, view):]
        finally:
            os.close(self._order)
            self._order = -1
        return _Forked(self.pid, self._out, self._err)

    def discard(self) -> None:
        """No program after all (the trial failed before it started): the zygote exits."""
        if self._order >= 0:
            os.close(self._order)
            self._order = -1
            with contextlib.suppress(OSError):
                os.killpg(self.pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            for fd in (self._out, self._err):
                with contextlib.suppress(OSError):
                    os.close(fd)
            _GROUPS.discard(self.pid)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _become(order_fd: int, out: int, err: int, threads: int) -> int:
    """In the zygote: wait for the order, set the process up as ``python`` sets up a fresh one, run the
    program; its exit code. The streams are flushed; nothing of the rank process runs after it."""
    os.setpgid(0, 0)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with its rank
    raw = _read_all(order_fd)
    if not raw:
        return 0  # discarded
    order = json.loads(raw)
    kind, name, args = order["target"]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(out, 1)
    os.dup2(err, 2)
    os.closerange(3, 1 << 16)  # the rank's pipes, its engine connection: none is the program's
    become_main_process(inherited_fds_closed=True)  # DataLoader workers, Pool, mp.spawn: as in a fresh python
    forget_finalizers()
    keep_process_groups()  # a DDP wrapper freed after destroy_process_group() must not destroy its group
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP, signal.SIGALRM, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGPIPE else signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.alarm(0)
    os.environ.clear()
    os.environ.update(order["env"])
    os.chdir(order["cwd"])
    random.seed()  # fresh streams, as a fresh interpreter has (not the rank's, nor another trial's)
    numpy, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if numpy is not None:
        numpy.random.seed()
    if torch is not None:
        torch.seed()
        torch.set_num_threads(threads)
    logging.getLogger("hpoflow").handlers.clear()
    code = 0
    try:
        _run_main(kind, name, args, order.get("launch", order["cwd"]))
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter ends a program that raised
        traceback.print_exc()
        code = 1
    end_like_an_interpreter()
    return code


def _run_main(kind: str, name: str, args: list[str], launch: str) -> None:
    """Run the program as ``python SCRIPT args`` or ``python -m MODULE args`` runs it: in a ``__main__``
    module that stays in ``sys.modules`` (its objects live until the process ends, as in an interpreter;
    ``runpy.run_path`` would free them as it returns, while the program's threads may still need them)."""
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    if kind == "module":
        sys.argv = [name, *args]
        sys.path[:0] = list(dict.fromkeys([os.getcwd(), launch]))  # as PYTHONPATH gives a fresh python -m
        # what ``python -m`` itself calls: the module's code in the __main__ module, sys.argv[0] its file
        getattr(runpy, "_run_module_as_main")(name, alter_argv=True)  # noqa: B009 (private, stable since 2.x)
        return
    sys.argv = [name, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
    if not os.path.isfile(name):  # a directory or a zip file with a __main__.py
        main.__dict__["__runpy_globals__"] = runpy.run_path(name, run_name="__main__")  # kept: see above
        return
    with io.open_code(name) as f:
        code = compile(f.read(), name, "exec", dont_inherit=True)
    main.__dict__.update(__file__=name, __cached__=None, __package__=None, __spec__=None,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", name))
    exec(code, main.__dict__)


def prefork(train: dict[str, Any], threads: int) -> Zygote | None:
    """A ``Zygote`` for a command trial that can run warm (see the module docstring), else None. Call it
    when the rank starts, before any thread or process group exists in this process."""
    if "torch" not in sys.modules or not hasattr(os, "fork"):
        return None
    if sys.modules["torch"].cuda.is_initialized():  # (a worker that ran a GPU trial) a fork could not use CUDA
        return None
    if not runs_warm(train.get("command"), train.get("isolate")):
        return None
    return Zygote(threads)


def run_command(ctx: TrialContext, job: RankJob, zygote: Zygote | None = None) -> dict[str, float]:
    """Run this rank of a command trial (see the module docstring); the trial's last value of every
    metric rank 0 reported. ``ctx`` says how it ended: pruned (``_prune``), paused (``pausing``).
    ``zygote``: run the program warm in it (``prefork``)."""
    sup = _Supervisor(ctx, job, zygote)
    try:
        return sup.run()
    finally:
        sup.close()
