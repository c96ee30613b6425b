"""A command trial's rank (``training.command``): the user's program, started as torchrun starts it,
and supervised. The rank process of any engine (a local worker, a cluster rank or step task) runs
``run_command`` as its training function, so every engine places, pins and stops command trials the
way it does any trial.

- **Environment.** The program gets torchrun's variables (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_*``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``TORCHELASTIC_RUN_ID``, ...), the rank's ``OMP_NUM_THREADS``, cores and ``CUDA_VISIBLE_DEVICES``, and
  ``HPOFLOW_PARAMS`` (the trial's values, JSON), ``HPOFLOW_TRIAL_DIR``, ``HPOFLOW_CHECKPOINT_DIR``,
  ``HPOFLOW_METRICS_FILE`` and ``HPOFLOW_CONTROL`` (``hpoflow.client``'s channel). ``MASTER_PORT`` is a
  free port of rank 0's host (loopback for a one-node trial), which rank 0 tells the other ranks
  through the store of the process group the rank processes keep among themselves.
- **Metrics**, three ways, all reports of rank 0 going to the study as ``ctx.report`` sends them (the
  pruner and the schedulers decide on them): lines of its stdout holding ``NAME=VALUE`` or
  ``NAME: VALUE`` for a metric of the study (step: the line's ``epoch=N``/``step=N``, else the number of
  reports so far); JSON lines appended to ``HPOFLOW_METRICS_FILE`` (``{"step": 3, "val_loss": 0.4}``);
  ``hpoflow.client.report``. The last value of each metric is the trial's result.
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
are imported already, and ``atexit`` handlers the program registers do not run (it ends with
``os._exit`` once its main code returns, after flushing its streams).
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import logging
import os
import queue
import random
import re
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.spec import UNBOUNDED_EPOCHS, program, runs_warm, warm_target
from hpoflow.train.context import TrialContext, metric_dict
from hpoflow.train.transport import LineServer, ReportReader
from hpoflow.trial import RankJob, describe_exit

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

log = logging.getLogger(__name__)

__all__ = ["CommandError", "LineReports", "Zygote", "command_env", "prefork", "run_command", "running_groups"]

_STOP_KEY = "hpoflow/command/stop"
_MASTER_KEY = "hpoflow/command/master"
KILL_AFTER_S = 5.0  # SIGTERM -> SIGKILL
_TAIL_BYTES = 4000  # of the program's stderr, for the error
_MAX_LINE = 65536  # longer stdout lines are passed on, not read for metrics
_TICK_S = 0.05
_STORE_EVERY_S = 0.2  # a rank other than 0 looks for rank 0's stop decision this often
_GROUPS: set[int] = set()  # process groups of the programs running in this process


class CommandError(RuntimeError):
    """The program of a command trial failed (it could not start, exited non-zero, reported nothing)."""


def running_groups() -> set[int]:
    """The process groups of the programs this process runs now: what a node's stop watcher kills
    besides its own group (``hpoflow.engines.cluster.node``)."""
    return set(_GROUPS)


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?|[-+]?(?:nan|inf(?:inity)?)(?![\w])"
_PAIR = re.compile(rf"(?<![\w.\-])([A-Za-z_][\w.]*)\s*[=:]\s*({_NUMBER})(?![\w.])")
_STEP_NAMES = ("epoch", "step")


class LineReports:
    """Reports in lines of text. A line holding ``NAME=VALUE`` or ``NAME: VALUE`` for one of ``names`` (the
    study's metrics) is a report of every such pair on it (``val_loss=0.41 val_accuracy=0.9``), its step
    the line's ``epoch=N`` or ``step=N`` (epoch first; any case), else None."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = frozenset(names)

    def parse(self, line: str) -> tuple[int | None, dict[str, float]] | None:
        """``(step, metrics)`` of a line that reports, else None."""
        pairs = [(m.group(1), m.group(2)) for m in _PAIR.finditer(line)]
        if not any(name in self.names for name, _ in pairs):
            return None
        steps: dict[str, int] = {}
        metrics: dict[str, float] = {}
        for name, value in pairs:
            low = name.lower()
            if low in _STEP_NAMES:
                if low not in steps and value.isdigit():
                    steps[low] = int(value)
            else:
                metrics[name] = float(value)
        return next((steps[k] for k in _STEP_NAMES if k in steps), None), metrics


def command_env(job: RankJob, master: tuple[str, int], extra: dict[str, str]) -> dict[str, str]:
    """The program's environment: this rank's (its threads, ``CUDA_VISIBLE_DEVICES``), torchrun's
    variables for this rank, and ``extra`` (hpoflow's)."""
    req = job.request
    world = job.world_size
    local_world = max(1, world // max(1, req.nodes))
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
        self.lines = LineReports(self.req.metric_names or (self.req.metric,))
        self.store: Store | None = None
        self.proc: subprocess.Popen[bytes] | _Forked | None = None
        self.server: LineServer | None = None
        self._old_sigterm: Any = None

    # -- the run --------------------------------------------------------------------------------
    def run(self) -> dict[str, float]:
        req, cfg = self.req, self.ctx.config
        if cfg.command is None:
            raise CommandError("training.command is not set")
        argv = [program(cfg.command[0]), *cfg.command[1:]]
        if self.job.world_size > 1:
            from hpoflow.train.dist import group_store

            self.store = group_store()
        master = self._master()
        trial_dir = Path(req.trial_dir)
        checkpoints = Path(req.checkpoints)
        checkpoints.mkdir(parents=True, exist_ok=True)
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
        target = warm_target(cfg.command) if self.zygote is not None else None
        log.info("command: rank %d runs %s%s (MASTER_ADDR=%s MASTER_PORT=%d)", self.rank, shlex.join(argv),
                 " warm (runpy in a process forked with torch imported)" if target else "", *master)
        proc: subprocess.Popen[bytes] | _Forked
        if target is not None and self.zygote is not None:
            zygote, self.zygote = self.zygote, None
            proc = self.proc = zygote.start(target, env, req.workdir or os.getcwd())
        else:
            try:
                proc = self.proc = subprocess.Popen(argv, env=env, cwd=req.workdir or None, stdin=subprocess.DEVNULL,
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
            try:
                item = self.items.get(timeout=_TICK_S)
            except queue.Empty:
                item = None
            if item is not None:
                self._handle(item)
            if reader is not None:
                for record in reader.read_new():
                    self._record(record)
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
        if self.stop is None and self.ctx.pause_request.requested:  # a pause signal that reached the program too
            self._decide("paused")
        log.info("command: rank %d: the program %s", self.rank, describe_exit(proc.returncode))

    def _drain(self, reader: ReportReader | None) -> None:
        """What the program said last, after it ended: lines still queued, the metrics file's last lines."""
        while True:
            try:
                item = self.items.get_nowait()
            except queue.Empty:
                break
            self._handle(item)
        if reader is not None:
            for record in reader.read_new():
                self._record(record)
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
            raise CommandError(f"{shlex.join(command)} (training.command) {describe_exit(code)}"
                               + (f"; its stderr ended with:\n{stderr}" if stderr else " and wrote nothing to stderr"))
        metric = self.req.metric
        if self.rank == 0 and metric not in self.latest:
            raise CommandError(
                f"the program never reported {metric!r} (study.metric): no line of rank 0's stdout held "
                f"'{metric}=VALUE' or '{metric}: VALUE', no line of HPOFLOW_METRICS_FILE held it, and "
                f"hpoflow.client.report() was not given it (reported: {sorted(self.latest) or 'nothing'}). Fix: print "
                f"'{metric}=<value>' on a line of its own, or name the metric your program prints in study.metric")
        return dict(self.latest)

    # -- reports and decisions ------------------------------------------------------------------
    def _on_line(self, raw: bytes) -> None:
        found = self.lines.parse(raw.decode(errors="replace"))
        if found is not None:
            self.items.put(("report", *found))

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
            self._report(item[1], item[2])
        elif kind == "client":
            _, step, metrics, done, box = item
            try:
                self._report(step, metric_dict(metrics, strict=True, where=f"hpoflow.client.report(step={step})"))
            except (TypeError, ValueError) as exc:
                box["error"] = str(exc)
            done.set()

    def _report(self, step: int | None, metrics: dict[str, float]) -> None:
        if self.stop is not None:
            return  # asked to stop: what it says while it stops is not a report
        step = len(self.ctx.reports) + 1 if step is None else step
        said: set[str] = set()  # this step's metrics so far: one printed and given to hpoflow.client counts once
        for s, m in reversed(self.ctx.reports):
            if s != step:
                break
            said.update(m)
        metrics = {k: v for k, v in metrics.items() if k not in said}
        if not metrics:
            return
        self.latest.update(metrics)
        self.ctx.report(step, **metrics)
        if self.ctx._prune:
            self._decide("pruned")
        elif self.ctx.pause_request.requested:
            self._decide("paused")
        elif step >= self.ctx.config.epochs and self.ctx.config.epochs != UNBOUNDED_EPOCHS:
            self._decide("ended")

    def _decide(self, reason: str) -> None:
        if self.stop is not None:
            return
        self.stop = _Stop(reason)
        log.info("command: rank %d: %s; the program has %g s to exit (training.stop_grace_s)", self.rank,
                 {"pruned": "pruned", "paused": "paused", "ended": "its last epoch (training.epochs) reported"}.get(
                     reason, reason), self.ctx.config.stop_grace_s)
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


def _pump(stream: Any, fd: int, on_line: Callable[[bytes], None] | None, tail: bytearray | None) -> None:
    """Copy the program's ``stream`` to this process's ``fd`` (the rank's log) as it comes; hand each
    complete line to ``on_line``; keep the last ``_TAIL_BYTES`` in ``tail``."""
    src = stream.fileno()
    pending = b""
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
            pending += chunk
            *lines, pending = pending.split(b"\n")
            for line in lines:
                if len(line) <= _MAX_LINE:
                    on_line(line)
            if len(pending) > _MAX_LINE:
                pending = b""
    if on_line is not None and pending and len(pending) <= _MAX_LINE:
        on_line(pending)


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

    def start(self, target: tuple[str, str, list[str]], env: dict[str, str], cwd: str) -> _Forked:
        order = json.dumps({"target": list(target), "env": env, "cwd": cwd}).encode()
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
        if kind == "module":
            sys.argv = [name, *args]
            sys.path.insert(0, os.getcwd())
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [name, *args]
            sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
            runpy.run_path(name, run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter ends a program that raised
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    return code


def prefork(train: dict[str, Any], threads: int) -> Zygote | None:
    """A ``Zygote`` for a command trial that can run warm (see the module docstring), else None. Call it
    when the rank starts, before any thread or process group exists in this process."""
    if "torch" not in sys.modules or not hasattr(os, "fork"):
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
