"""The slurm engine: every trial is a SLURM job step of the driver's allocation, or its own batch job.

Modes (``engine_options.mode``; ``auto``: steps inside an allocation, else jobs):

- **steps**: the driver runs in a batch script (``hpoflow launch SPEC --engine slurm``). Each trial is
  one ``srun --exact`` step that asks for exactly the trial's nodes, tasks, CPUs per task, GPUs per
  task and memory, so steps never share cores; SLURM places it. Each task of the step is one rank
  (``python -m hpoflow.engines.cluster.node step``): the rank and the world come from the step's
  environment; the ranks of one node meet through a file store in the node's /dev/shm, those of
  several through a TCP store rank 0 holds and announces in the attempt directory (no file lock on
  the shared file system), and gloo binds the site's fabric or the interface that routes to the
  driver's node (``hpoflow.engines.cluster.node``). ``--kill-on-bad-exit`` ends the step when a rank fails.
- **jobs**: each trial is its own ``sbatch`` job (for users without an allocation, long trials, or
  per-job limits), tracked with ``squeue`` and its heartbeat; the job runs one attempt of the trial
  (``python -m hpoflow.engines.cluster.attempt``), which starts one node launcher per node, as a COMPSs
  task does. The driver may run on a login node.

Results and checkpoints are written to the run directory on the shared file system. In jobs mode,
reports and pruning answers travel through it too, as in the compss engine. In steps mode they go over
a TCP connection rank 0 opens to the engine's one listening socket (``SocketChannel`` /
``ControlServer`` in ``hpoflow.train.transport``; its address, port and the attempt's token are in the
step's job file, mode 0600), and neither side polls a file while a step runs: the poll waits on the
sockets (a report wakes it at once) and on the steps' ``srun`` processes; ``reports.jsonl`` stays the
record, read once when the step has ended. A cancel is SIGTERM to the step's ``srun`` (it ends the
step), a pause SIGUSR1 (srun forwards both). Jobs mode cancels with a ``STOP`` file every rank watches
and ``scancel``. A rank that ends without an outcome (its node failed: ``srun`` may exit 0 then) fails
the attempt as retryable, so the driver reruns it from its checkpoint on the nodes that are left
(``resources.max_retries``); where those can no longer hold a trial the driver records it interrupted
and stops (``Driver._out_of_room``).

With node agents (``engine_options.agents``: ``on``, or ``auto`` in steps mode), no step per trial: one
step over the whole allocation runs an agent on each node, the local engine's warm pool there, and
trials go to the agents over TCP (``hpoflow.engines.slurm.agents``, ``hpoflow.engines.agent``).

In steps mode the engine starts a step only when the allocation has room for it (the trials it runs
against ``Allocation.capacity``); a trial submitted without room waits here, its timeout not yet
running, rather than in ``srun`` ("Requested nodes are busy"). After every retryable failure of a step
(a rank without an outcome, or a peer's collective error: a crashed node's survivors speak first),
the engine settles before it starts another step or passes the result on
(``hpoflow.engines.slurm.replan``): a thread asks ``scontrol``/``squeue``, one at a time, until SLURM
has ended the step with every node in the job, or taken a node out of the ``--no-kill`` job (then the
room shrinks to the nodes that are left, less the CPUs SLURM 22.05 keeps for the failed step on them),
or ``SlurmdTimeout`` and a minute have passed. No step ever runs with ``--overlap`` (nor with a site's
``SLURM_OVERLAP``): SLURM would stop keeping the study's steps apart.

This module holds ``SlurmEngine``'s contract and what both modes do alike (waiting for room, reports,
timeouts, stops); each mode's own part is a base class of it: ``_steps.StepsMode`` (a step per trial,
settling after a failed one) and ``_jobs.JobsMode`` (a batch job per trial), both on ``_core.Core`` (the trial
record, its job file, resource flags and name); ``_shape`` refuses the shapes the engine never runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.engines.base import Engine, Event, TrialReport, TrialRequest, TrialResult
from hpoflow.engines.slurm._core import Trial, fresh_attempt_dir, safe_name
from hpoflow.engines.slurm._jobs import JobsMode
from hpoflow.engines.slurm._shape import check_shape, share_refusal
from hpoflow.engines.slurm._steps import StepsMode, control_server, read_allocation, step_environ
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.engines.slurm.replan import Replan, run_client
from hpoflow.errors import EngineError
from hpoflow.fileio import write_atomic, write_json_atomic
from hpoflow.train.transport import ControlServer, ReportReader, TrialFiles

if TYPE_CHECKING:
    from hpoflow.engines.slurm.agents import AgentFleet

__all__ = ["SlurmEngine", "read_allocation", "step_environ"]

# (their names before they moved to _shape and _steps: tests/engines/slurm)
_check_shape, _share_refusal, _control_server = check_shape, share_refusal, control_server

PAUSE_GRACE_S = 120.0  # a paused trial that has not stopped at a step by then is stopped (killed)


class SlurmEngine(StepsMode, JobsMode, Engine):
    """Runs each trial as a SLURM job step or batch job; see the module docstring."""

    name = "slurm"
    fleet: AgentFleet | None = None  # the node agents trials run on (engine_options.agents), else None

    @classmethod
    def from_options(cls, options: SlurmOptions, run_dir: Path | None = None) -> SlurmEngine:
        return cls(options, run_dir)

    @classmethod
    def check_fit(cls, options: SlurmOptions, request: TrialRequest) -> None:
        """Fixed-size trials whose ranks split evenly over their nodes; inside an allocation (steps mode),
        a trial that fits the allocation."""
        in_allocation = options.resolved_mode(os.environ) == "steps" and bool(os.environ.get("SLURM_JOB_ID"))
        check_shape(request, share_site=True, agents=in_allocation and options.resolved_agents(os.environ))
        if in_allocation:
            read_allocation(os.environ, options).check_fit(request)

    def __init__(self, options: SlurmOptions | None = None, run_dir: Path | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.options = options or SlurmOptions()
        self.run_dir = Path(run_dir) if run_dir is not None else None
        env = dict(os.environ if environ is None else environ)
        self.mode = self.options.resolved_mode(env)
        self.allocation = read_allocation(env, self.options) if self.mode == "steps" else None
        tool = "srun" if self.mode == "steps" else "sbatch"
        if shutil.which(tool) is None:
            raise EngineError(f"the slurm engine's {self.mode} mode needs {tool}, which is not on PATH here. Fix: run "
                              "the driver on a SLURM login node or inside an allocation (module load slurm)")
        self.python = self.options.python or sys.executable
        self._trials: dict[int, Trial] = {}
        self._events: list[Event] = []
        self._last_squeue = 0.0
        self._queued: dict[str, str] = {}  # job id -> state, from the last squeue
        self._closed = False
        # steps mode: the plan across failed steps (SLURM's word on the job, read off the poll path)
        # and the socket rank 0 of every step connects to
        self._replan = Replan(self.allocation) if self.allocation is not None else None
        self._control: ControlServer | None = None
        self._control_host = ""  # the address it listens on ("": every address of this host)
        if self.allocation is not None and self.options.resolved_agents(env):
            from hpoflow.engines.slurm.agents import AgentFleet

            run = self.run_dir if self.run_dir is not None else Path(tempfile.mkdtemp(prefix="hpoflow-agents-"))
            self.fleet = AgentFleet(self.allocation, self.options, run, self.python, step_environ(env),
                                    f"hpoflow.{safe_name(run.name)}.agents")

    # -- contract -------------------------------------------------------------------------------
    def capacity(self, request: TrialRequest) -> int:
        try:
            check_shape(request, agents=self.fleet is not None)
        except EngineError:
            return 0
        if self.fleet is not None:
            return self.fleet.capacity(request)
        if self.allocation is not None:
            return self.allocation.capacity(request)
        return self.options.max_jobs

    def expect_runs(self, runs: int, worst: int) -> None:
        """Steps mode: warn when the study's trial runs approach SLURM's ``MaxStepCount`` (each run is one
        step; a job's steps past it fail to start)."""
        limit = self.allocation.max_step_count if self.allocation is not None and self.fleet is None else 0
        if not limit or worst < 0.8 * limit:
            return
        print(f"hpoflow: warning: this study may start {runs} job steps ({worst} with every retry), and SLURM "
              f"starts at most MaxStepCount={limit} steps in job {self.allocation.job_id if self.allocation else '?'}"
              ": the steps past it fail. Fix: fewer trials per job (--n-trials, then submit the study again: "
              "it resumes), or ask the site to raise MaxStepCount", file=sys.stderr, flush=True)

    def submit(self, request: TrialRequest) -> None:
        if self._closed:
            raise EngineError("the slurm engine is closed")
        check_shape(request, agents=self.fleet is not None)
        if self.fleet is not None:
            self.fleet.submit(request)
            return
        files = TrialFiles(Path(request.trial_dir), request.attempt)
        fresh_attempt_dir(files)
        now = time.monotonic()
        t = Trial(request, files, ReportReader(files.reports), now, time.time(), None)
        self._trials[request.number] = t
        if self.mode == "steps" and not self._room(request):
            return  # started by poll() once a running trial ends (see the module docstring)
        self._start(t)

    def _start(self, t: Trial) -> None:
        request = t.request
        if request.timeout:
            t.deadline = time.monotonic() + request.timeout
        job = self._job(request, t.files)
        if self.mode == "steps":
            if self._control is None:
                self._control, self._control_host = control_server(self.allocation)
            t.token = self._control.new_token()
            # rank 0 connects to the address the driver listens on ("*": every address of this host, reached
            # at SLURM_LAUNCH_NODE_IPADDR, this host's name where unset)
            job["control"] = f"{self._control_host or '*'} {self._control.port} {t.token}"
        write_atomic(t.files.job, json.dumps(job, sort_keys=True, default=str), mode=0o600)  # holds the token
        t.started = True
        if self.mode == "steps":
            self._start_step(t)
        else:
            self._start_job(t)

    def _room(self, request: TrialRequest) -> bool:
        """Steps mode: whether one more trial shaped like ``request`` fits beside the running ones."""
        if self.allocation is None:
            return True
        if self._replan is not None and self._replan.waiting:  # a step failed: whether its node is lost unknown yet
            return False
        running = sum(1 for t in self._trials.values() if t.started)
        return running < self.allocation.capacity(request)

    def _start_waiting(self) -> None:
        for t in [t for t in self._trials.values() if not t.started and t.cancel_reason is None]:
            if not self._room(t.request):
                return
            self._start(t)

    def poll(self, timeout: float | None) -> list[Event]:
        if self.fleet is not None:
            return self.fleet.poll(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self.mode == "jobs":
                self._refresh_queue()
            for t in list(self._trials.values()):
                self._check(t)
            self._settle()
            self._start_waiting()
            if self._events or not (self._trials or self.running()):
                out, self._events = self._events, []
                return out
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            step = self.options.poll_interval_s
            wait = step if deadline is None else max(0.0, min(step, deadline - now))
            if self._control is not None:  # steps: woken by a report at once, else after `wait`
                self._control.wait(wait)
            else:
                time.sleep(wait)

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        if self.fleet is not None:
            self.fleet.answer(number, prune, pause)
            return
        t = self._trials.get(number)
        if t is None or t.pending_answer is None:
            return
        seq, t.pending_answer = t.pending_answer, None
        if self._control is not None and t.token:  # steps: rank 0 waits on its connection, no file
            self._control.send(t.token, {"seq": seq, "prune": bool(prune), "pause": bool(pause)})
            return
        with contextlib.suppress(OSError):
            write_json_atomic(t.files.answer(seq), {"prune": bool(prune), "pause": bool(pause)})

    def cancel(self, number: int, reason: str) -> None:
        if self.fleet is not None:
            self.fleet.cancel(number, reason)
            return
        t = self._trials.get(number)
        if t is None or t.cancel_reason is not None or t.failure is not None:
            return
        t.cancel_reason = reason
        if t.started:
            self._stop(t)

    def pause(self, number: int, reason: str) -> None:
        """SIGUSR1 to the step's srun (it forwards it to every rank; jobs mode: a ``PAUSE`` file every rank
        watches); stopped for good if it has not paused within ``PAUSE_GRACE_S``. With agents, the agents
        signal their ranks."""
        if self.fleet is not None:
            self.fleet.pause(number, reason)
            return
        t = self._trials.get(number)
        if t is None or t.cancel_reason is not None or t.failure is not None or t.paused_at is not None:
            return
        if not t.started:  # it never ran: nothing to checkpoint
            t.cancel_reason = f"paused ({reason}) before it started"
            return
        t.paused_at = time.monotonic()
        if self.mode == "jobs":  # a step's ranks get SIGUSR1 from srun and watch no file
            with contextlib.suppress(OSError):
                t.files.pause.write_text(f"{reason}\n")
        self._signal_pause(t)

    def _signal_pause(self, t: Trial) -> None:
        t.signalled_at = time.monotonic()
        if t.proc is not None and t.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.kill(t.proc.pid, signal.SIGUSR1)

    def interrupt(self) -> None:
        """A stop has begun: the node agents' fleet waits for no agent any more (``AgentFleet.interrupt``)."""
        if self.fleet is not None:
            self.fleet.interrupt()

    def running(self) -> list[int]:
        if self.fleet is not None:
            return self.fleet.running()
        waiting = self._replan.waiting if self._replan is not None else []
        return sorted({*self._trials, *(s.number for s in waiting)})  # a result waiting for SLURM's word

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.fleet is not None:
            self.fleet.close(self.options.kill_grace_s)
            return
        for number in list(self._trials):
            self.cancel(number, "engine closed")
        end = time.monotonic() + self.options.kill_grace_s + 10.0
        while self._trials and time.monotonic() < end:
            if self.mode == "jobs":
                self._refresh_queue(force=True)
            for t in list(self._trials.values()):
                self._check(t)
            if self._trials:
                time.sleep(0.1)
        for t in self._trials.values():  # whatever is left: killed for good
            if t.proc is not None and t.proc.poll() is None:
                t.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    t.proc.wait(10)
            elif t.job_id is not None:
                _run_quiet(["scancel", "--signal=KILL", t.job_id])
        self._trials.clear()
        if self._replan is not None:
            self._replan.close()
        if self._control is not None:
            self._control.close()

    # -- watching a trial ---------------------------------------------------------------------------
    def _read_reports(self, t: Trial, final: bool = False) -> None:
        """The trial's new reports: in steps mode what rank 0 sent over its connection (and, once its step
        has ended, ``final``, what reached only ``reports.jsonl``: rank 0 could not connect, or the
        connection broke); in jobs mode from ``reports.jsonl``."""
        if self._control is not None and t.token:
            items = self._control.messages(t.token)
            for item in items:
                hello = item.get("hello")
                if isinstance(hello, dict):
                    t.step = {str(k): str(v) for k, v in hello.items()}
            if final:
                items += t.reader.read_new()
        else:
            items = t.reader.read_new()
        for item in sorted(items, key=lambda i: _seq(i.get("seq"))):
            if "step" not in item:
                continue
            seq = _seq(item.get("seq"))
            if seq in t.seen:
                continue
            t.seen.add(seq)
            try:
                step = int(item["step"])
                metrics = {str(k): float(v) for k, v in (item.get("metrics") or {}).items()}
            except (TypeError, ValueError, AttributeError):
                continue  # not a report rank 0 makes
            if t.first_report is None:
                t.first_report = time.monotonic()
            if item.get("wants_answer"):
                t.pending_answer = seq
            self._events.append(TrialReport(t.request.number, step, metrics, bool(item.get("wants_answer"))))

    def _stop(self, t: Trial) -> None:
        """Ask every rank to stop, then end the step or the job: steps mode tells rank 0 over its connection
        (it stops waiting for a decision) and srun forwards SIGTERM; jobs mode writes the STOP file its
        ranks watch, then ``scancel``."""
        t.stop_time = time.monotonic()
        if self._control is not None and t.token:  # rank 0 may be waiting for a decision: it stops at once
            self._control.send(t.token, {"stop": str(t.cancel_reason or t.failure)})
        if self.mode == "jobs":  # a step's ranks watch no file: srun forwards the SIGTERM below
            with contextlib.suppress(OSError):
                t.files.stop.write_text(f"{t.cancel_reason or t.failure}\n")
        if t.proc is not None and t.proc.poll() is None:
            with contextlib.suppress(OSError):
                os.killpg(t.proc.pid, signal.SIGTERM)  # srun forwards it and ends the step
        elif t.job_id is not None:
            _run_quiet(["scancel", t.job_id])

    def _check(self, t: Trial) -> None:
        if not t.started:  # waiting for room: only a cancel or a pause ends it, as interrupted
            if t.cancel_reason is not None:
                self._events.append(TrialResult(t.request.number, "cancelled", error=t.cancel_reason,
                                                timings={"duration_s": time.monotonic() - t.submitted}))
                del self._trials[t.request.number]
            return
        self._read_reports(t)
        now = time.monotonic()
        if t.deadline is not None and now >= t.deadline and t.failure is None and t.cancel_reason is None:
            t.failure = f"timed out after {t.request.timeout:g} s (resources.timeout)"
            t.retryable = False  # the same configuration would run as long again
            self._stop(t)
        if t.paused_at is not None and t.stop_time is None:
            if now - t.paused_at > PAUSE_GRACE_S:
                t.cancel_reason = f"did not pause within {PAUSE_GRACE_S:g} s: stopped"
                self._stop(t)
            elif now - t.signalled_at >= 1.0:
                self._signal_pause(t)
        if t.stop_time is not None and now - t.stop_time > self.options.kill_grace_s:
            if t.proc is not None and t.proc.poll() is None:
                with contextlib.suppress(OSError):
                    os.killpg(t.proc.pid, signal.SIGKILL)
            elif t.job_id is not None and not t.extra.get("killed"):
                t.extra["killed"] = True
                _run_quiet(["scancel", "--signal=KILL", t.job_id])
        done = self._step_done(t) if t.proc is not None or self.mode == "steps" else self._job_done(t, now)
        if not done:
            return
        self._read_reports(t, final=True)  # every report before the result
        result = self._result(t)
        if result.status == "failed" and result.retryable and t.cancel_reason is None and self._replan is not None:
            # its node may be lost, and a crashed node's survivors speak first (a collective's error) while
            # SLURM still counts it: the result waits for SLURM's word on the step's nodes, and no step
            # starts meanwhile, so the driver decides the rerun on the nodes that are left (replan)
            self._begin_settle(t, result)
        else:
            self._events.append(result)
        if self._control is not None and t.token:
            self._control.forget(t.token)
        del self._trials[t.request.number]

    def _result(self, t: Trial) -> TrialResult:
        timings = {"duration_s": time.monotonic() - t.submitted}
        if t.first_report is not None:
            timings["to_first_report_s"] = t.first_report - t.submitted
        if self.mode == "jobs":
            return self._job_result(t, timings)
        return self._step_result(t, timings)


_run_quiet = run_client


def _seq(value: Any) -> int:
    """A report's ``seq`` as rank 0 sends it; -1 where it is not a number."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1
