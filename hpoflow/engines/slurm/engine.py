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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.engines.base import Engine, Event, TrialReport, TrialRequest, TrialResult
from hpoflow.engines.cluster.attempt import HEARTBEAT_S, stderr_tail
from hpoflow.engines.cluster.hostlist import HostlistError, expand
from hpoflow.engines.cluster.layout import default_pythonpath, export_flags, processes_per_node
from hpoflow.engines.proc import tail
from hpoflow.engines.slurm._fleet import listen_host
from hpoflow.engines.slurm.allocation import (
    Allocation,
    config_value,
    job_detail,
    node_hardware,
    whole_cores,
)
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.engines.slurm.replan import Replan, Settle, run_client
from hpoflow.errors import EngineError
from hpoflow.fileio import read_json, write_atomic, write_json_atomic
from hpoflow.train.transport import ControlServer, ReportReader, TrialFiles
from hpoflow.trial import RankOutcome, result_from_ranks

if TYPE_CHECKING:
    from hpoflow.engines.slurm.agents import AgentFleet

__all__ = ["SlurmEngine", "read_allocation", "step_environ"]

PAUSE_GRACE_S = 120.0  # a paused trial that has not stopped at a step by then is stopped (killed)
_SQUEUE_EVERY_S = 2.0  # jobs mode: one squeue for every job at most this often
_GONE_GRACE_S = 10.0  # jobs mode: a job squeue no longer lists may still be writing its result


@dataclass
class _Trial:
    request: TrialRequest
    files: TrialFiles
    reader: ReportReader
    submitted: float
    submitted_wall: float
    deadline: float | None
    proc: subprocess.Popen[bytes] | None = None  # steps: the step's srun
    job_id: str | None = None  # jobs: the trial's batch job
    pending_answer: int | None = None
    first_report: float | None = None
    cancel_reason: str | None = None
    failure: str | None = None
    retryable: bool = False
    stop_time: float | None = None
    paused_at: float | None = None  # pause(): when the engine asked the ranks to stop at a step
    signalled_at: float = 0.0
    gone_since: float | None = None
    started: bool = False  # steps: its srun runs (False: waiting for room in the allocation)
    token: str = ""  # steps: how rank 0's connection to the engine's ControlServer is known
    step: dict[str, str] = field(default_factory=dict)  # steps: rank 0's hello (step id, nodes)
    seen: set[int] = field(default_factory=set)  # report seqs passed on (each arrives by socket and file)
    extra: dict[str, Any] = field(default_factory=dict)


class SlurmEngine(Engine):
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
        _check_shape(request, share_site=True, agents=in_allocation and options.resolved_agents(os.environ))
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
        self._trials: dict[int, _Trial] = {}
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
                                    f"hpoflow.{_safe_name(run.name)}.agents")

    # -- contract -------------------------------------------------------------------------------
    def capacity(self, request: TrialRequest) -> int:
        try:
            _check_shape(request, agents=self.fleet is not None)
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
        _check_shape(request, agents=self.fleet is not None)
        if self.fleet is not None:
            self.fleet.submit(request)
            return
        files = TrialFiles(Path(request.trial_dir), request.attempt)
        _fresh_attempt_dir(files)
        now = time.monotonic()
        t = _Trial(request, files, ReportReader(files.reports), now, time.time(), None)
        self._trials[request.number] = t
        if self.mode == "steps" and not self._room(request):
            return  # started by poll() once a running trial ends (see the module docstring)
        self._start(t)

    def _start(self, t: _Trial) -> None:
        request = t.request
        if request.timeout:
            t.deadline = time.monotonic() + request.timeout
        job = self._job(request, t.files)
        if self.mode == "steps":
            if self._control is None:
                self._control, self._control_host = _control_server(self.allocation)
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

    def _signal_pause(self, t: _Trial) -> None:
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

    # -- starting a trial ---------------------------------------------------------------------------
    def _job(self, request: TrialRequest, files: TrialFiles) -> dict[str, Any]:
        """What the rank processes (steps) or the attempt (jobs) read: the request and the options."""
        env = dict(self.options.env)
        env.setdefault("PYTHONPATH", default_pythonpath())
        a = self.allocation
        return {
            "request": json.loads(request.to_json()), "ppn": processes_per_node(request),
            "world_size": request.processes, "pg_timeout_s": self.options.pg_timeout_s,
            "answer_timeout_s": self.options.answer_timeout_s, "env": env, "rendezvous_id": os.urandom(8).hex(),
            "socket_ifname": self.options.socket_ifname, "master_addr": "", "master_port": 0, "store": "",
            "deadline": time.time() + request.timeout + 30.0 if request.timeout else None,
            # where SLURM says nothing of a step's GPUs (--gpu-bind=none), ranks claim theirs among these
            "node_gpus": dict(zip(a.hosts, (list(g) for g in a.gpu_ids), strict=True)) if a and a.gpu_ids else {},
        }

    def _resources(self, request: TrialRequest, *, per_task: bool) -> list[str]:
        """The trial's resource flags: per task (a step: one task per rank) or per node (a trial job).

        A step asks for its GPUs per node (``--gres=gpu:N``) and binds them itself, by local rank (see
        ``hpoflow.engines.cluster.node``): SLURM binds ``--gpus-per-task`` on some versions and sites and
        not on others. It always asks for memory: where memory is a consumable resource, a step without
        ``--mem`` takes all of the job's memory on its nodes, and the next step waits for it."""
        ppn = processes_per_node(request)
        out = [f"--nodes={request.nodes}"]
        o = self.options
        if per_task:
            out += [f"--ntasks={request.processes}", f"--ntasks-per-node={ppn}",
                    f"--cpus-per-task={request.cpus_per_process}"]
            if o.threads_per_core == 1:
                out.append("--hint=nomultithread")
            # no GPU flag would give the step every GPU of the job on its nodes (and the next step waits)
            out.append(f"--gres=gpu:{ppn * request.gpus_per_process}" if request.gpus_per_process else "--gres=none")
            # memory is SLURM's to give back after a failed step (replan): planned on the job's whole nodes
            a = self._replan.job if self._replan is not None else None
            rank_mb = a.rank_memory_mb(request) if a is not None else 0
            if rank_mb:
                out.append(f"--mem={ppn * rank_mb}M")
            if not any(a == "--mpi" or a.startswith("--mpi=") for a in o.srun_args):
                out.append("--mpi=none")  # a site whose default is PMIx would set it up for every step
            return out
        out += ["--ntasks-per-node=1", f"--cpus-per-task={ppn * request.cpus_per_process}"]
        if o.threads_per_core == 1:
            out.append("--hint=nomultithread")
        if request.gpus_per_process:
            out.append(f"--gpus-per-node={ppn * request.gpus_per_process}")
        if request.memory_gb:
            out.append(f"--mem={math.ceil(ppn * request.memory_gb * 1024)}M")
        elif o.memory_gb:
            out.append(f"--mem={o.memory_gb}G")
        return out

    def _name(self, request: TrialRequest) -> str:
        return f"hpoflow.{_safe_name(self.run_dir.name if self.run_dir is not None else 'study')}.t{request.number}"

    def _start_step(self, t: _Trial) -> None:
        req, files = t.request, t.files
        argv = ["srun", "--exact", f"--job-name={self._name(req)}", *self._resources(req, per_task=True),
                "--kill-on-bad-exit=1", "--input=none", f"--output={files.dir / 'task%t.out'}",
                *export_flags(self.options.srun_args), self.python, "-m", "hpoflow.engines.cluster.node", "step",
                "--job", str(files.job)]
        if req.timeout:  # a backstop only: the engine stops a trial at its timeout itself
            argv.insert(1, f"--time={math.ceil((req.timeout + 120) / 60)}")
        with open(files.dir / "srun.log", "ab") as log:
            log.write((shlex.join(argv) + "\n").encode())
            log.flush()
            t.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                      start_new_session=True, env=step_environ(os.environ))

    def _start_job(self, t: _Trial) -> None:
        req, files = t.request, t.files
        write_json_atomic(files.dir / "request.json", json.loads(req.to_json()))
        write_json_atomic(files.dir / "options.json", self._task_options())
        script = files.dir / "job.sh"
        write_atomic(script, "#!/bin/sh\n"
                     f"# hpoflow: trial {req.number}, attempt {req.attempt}; written by the slurm engine\n"
                     f"exec {shlex.quote(self.python)} -m hpoflow.engines.cluster.attempt "
                     f"--request {shlex.quote(str(files.dir / 'request.json'))} "
                     f"--options {shlex.quote(str(files.dir / 'options.json'))}\n", mode=0o755)
        o = self.options
        argv = ["sbatch", "--parsable", f"--job-name={self._name(req)}", *self._resources(req, per_task=False),
                f"--output={files.dir / 'job.out'}", f"--chdir={files.dir}", "--export=ALL"]
        minutes = o.time_min or (math.ceil((req.timeout + 300) / 60) if req.timeout else None)
        if minutes:
            argv.append(f"--time={minutes}")
        for flag, value in (("partition", o.partition), ("account", o.account), ("qos", o.qos),
                            ("constraint", o.constraint)):
            if value:
                argv.append(f"--{flag}={value}")
        argv += [*o.sbatch_args, str(script)]
        env = {**os.environ, "PYTHONPATH": default_pythonpath()}
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        job_id = r.stdout.strip().split(";")[0]
        if r.returncode != 0 or not job_id.isdigit():
            why = (r.stderr or r.stdout).strip().splitlines()
            t.failure = f"sbatch refused the trial's job: {why[-1] if why else f'exit {r.returncode}'}"
            t.retryable = False
            return
        t.job_id = job_id
        self._queued[job_id] = "PENDING"

    def _task_options(self) -> dict[str, Any]:
        """The options ``run_trial`` reads inside a trial job (as a COMPSs task's)."""
        o = self.options
        return {"launcher": "srun", "srun_args": ["--overlap", *o.srun_args], "python": self.python,
                "env": dict(o.env), "socket_ifname": o.socket_ifname, "kill_grace_s": o.kill_grace_s,
                "answer_timeout_s": o.answer_timeout_s, "pg_timeout_s": o.pg_timeout_s}

    # -- watching a trial ---------------------------------------------------------------------------
    def _refresh_queue(self, force: bool = False) -> None:
        """The states of every trial job (one squeue for all of them, at most every few seconds)."""
        now = time.monotonic()
        ids = [t.job_id for t in self._trials.values() if t.job_id]
        if not ids or (not force and now - self._last_squeue < _SQUEUE_EVERY_S):
            return
        self._last_squeue = now
        r = _run_quiet(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"])
        if r is None:
            return  # slurmctld did not answer: keep the last states
        self._queued = dict(line.split(None, 1) for line in r.splitlines() if len(line.split(None, 1)) == 2)

    def _read_reports(self, t: _Trial, final: bool = False) -> None:
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

    def _stop(self, t: _Trial) -> None:
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

    def _check(self, t: _Trial) -> None:
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

    def _step_done(self, t: _Trial) -> bool:
        return t.proc is None or t.proc.poll() is not None

    def _job_done(self, t: _Trial, now: float) -> bool:
        if t.job_id is None or t.files.result.exists():
            return True
        state = self._queued.get(t.job_id)
        if state in ("PENDING", "CONFIGURING"):
            t.gone_since = None
            return False
        if state is None or state not in ("RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"):
            t.gone_since = t.gone_since or now
            return now - t.gone_since > _GONE_GRACE_S  # its result may be on its way through the file system
        hb = _mtime(t.files.heartbeat)
        limit = max(self.options.heartbeat_timeout_s, 3 * HEARTBEAT_S)
        if hb is not None and time.time() - hb > limit:
            t.extra["why"] = f"its heartbeat stopped {time.time() - hb:.0f} s ago (its node died or hangs)"
            _run_quiet(["scancel", "--signal=KILL", t.job_id])
            return True
        return False

    def _result(self, t: _Trial) -> TrialResult:
        req = t.request
        timings = {"duration_s": time.monotonic() - t.submitted}
        if t.first_report is not None:
            timings["to_first_report_s"] = t.first_report - t.submitted
        if self.mode == "jobs":
            return self._job_result(t, timings)
        outcomes = {}
        for r in range(req.processes):
            data = read_json(t.files.outcome(r))
            if isinstance(data, dict):
                outcomes[r] = RankOutcome.from_dict(data)
        failure, retryable = t.failure, t.retryable
        code = t.proc.returncode if t.proc is not None else None
        if failure is None and t.cancel_reason is None and (len(outcomes) < req.processes or code not in (0, None)):
            if not any(o.status == "error" for o in outcomes.values()):  # else a rank's own error speaks
                missing = [r for r in range(req.processes) if r not in outcomes]
                failure = (f"rank(s) {missing} ended without a result (srun exit {code}; see "
                           f"{t.files.dir / 'srun.log'}): a node failed, or a rank was killed or ran out of memory")
                retryable = True

        def stderr() -> str:
            text = stderr_tail(t.files, req.processes, 0)
            srun = tail(t.files.dir / "srun.log", 1000)
            return "\n".join(x for x in (text, f"--- srun ---\n{srun}" if srun.strip() else "") if x)

        return result_from_ranks(req, outcomes, timings=timings, failure=failure, retryable=retryable,
                                 cancelled=t.cancel_reason if failure is None else None, stderr_tail=stderr,
                                 submitted_wall=t.submitted_wall)

    # -- after a step failed as retryable (hpoflow.engines.slurm.replan) ------------------------------
    def _begin_settle(self, t: _Trial, result: TrialResult) -> None:
        if self.allocation is None or self._replan is None:
            return
        req = t.request
        outcomes = [RankOutcome.from_dict(d) for d in (read_json(t.files.outcome(r)) for r in range(req.processes))
                    if isinstance(d, dict)]
        try:
            nodes = set(expand(t.step.get("nodes", ""))) if t.step.get("nodes") else set()
        except HostlistError:
            nodes = set()
        nodes |= {o.host for o in outcomes if o.host}
        step = t.step.get("step", "")
        self._replan.begin(Settle(
            req.number, time.monotonic(), nodes, f"{self.allocation.job_id}.{step}" if step else "", self._name(req),
            processes_per_node(req) * self.allocation.rank_cpus(req), result))

    def _settle(self) -> None:
        """Steps mode: SLURM's newest word on the job applied to the failed steps waiting for it (``Replan``)."""
        if self._replan is None or not self._replan.waiting:
            return
        self._events += self._replan.step()
        self.allocation = self._replan.planned

    def _job_result(self, t: _Trial, timings: dict[str, float]) -> TrialResult:
        n = t.request.number
        data = read_json(t.files.result)
        if t.failure is not None and not isinstance(data, dict):
            return TrialResult(n, "failed", error=t.failure, timings=timings, retryable=t.retryable)
        if not isinstance(data, dict):
            if t.cancel_reason is not None:
                return TrialResult(n, "cancelled", error=t.cancel_reason, timings=timings)
            why = t.extra.get("why") or _job_reason(t.job_id)
            return TrialResult(n, "failed", error=f"the job of trial {n} ({t.job_id}) ended without a result: {why}",
                               stderr_tail=tail(t.files.dir / "job.out", 2000), timings=timings, retryable=True)
        res = TrialResult.from_dict({**data, "number": n})
        merged = {**res.timings, "engine_duration_s": timings["duration_s"]}
        if t.cancel_reason is not None and res.status == "failed":
            return TrialResult(n, "cancelled", error=t.cancel_reason, stderr_tail=res.stderr_tail, timings=merged)
        if t.failure is not None and res.status != "complete":
            return TrialResult(n, "failed", error=t.failure, stderr_tail=res.stderr_tail, timings=merged,
                               retryable=t.retryable)
        return TrialResult(n, res.status, res.value, res.metrics, res.error, res.stderr_tail, merged, res.retryable,
                           res.system)


# what salloc/sbatch export of the job's own request that srun reads as its options (SLURM_GPUS_PER_NODE
# is --gpus-per-node, SLURM_MEM_PER_CPU is --mem-per-cpu...): a step of a job asked with --gpus-per-node=4
# would ask for 4 GPUs per node, or clash with the step's own --gres ("Invalid Trackable RESource
# (TRES) specification"); the engine's flags say what a step needs
_JOB_REQUEST_VARS = ("SLURM_GPUS", "SLURM_GPUS_PER_NODE", "SLURM_GPUS_PER_TASK", "SLURM_GPUS_PER_SOCKET",
                     "SLURM_CPUS_PER_GPU", "SLURM_MEM_PER_NODE", "SLURM_MEM_PER_CPU", "SLURM_MEM_PER_GPU",
                     "SLURM_GPU_BIND", "SLURM_GPU_FREQ", "SLURM_NTASKS_PER_GPU", "SLURM_TRES_PER_TASK",
                     "SLURM_THREADS_PER_CORE", "SLURM_HINT", "SRUN_CPUS_PER_TASK",
                     # a site-wide --overlap (srun reads SLURM_OVERLAP as the flag): SLURM would stop keeping
                     # the study's steps apart (CPUs oversubscribed, GPUs given twice)
                     "SLURM_OVERLAP")


def _control_server(allocation: Allocation | None) -> tuple[ControlServer, str]:
    """The steps' control listener, bound to the address the job's nodes reach this host at (as the agents'
    listener: ``listen_host``), and that address; every address ("") where none is known or it cannot be
    bound. Only a connection that sends a token of a running attempt is kept either way."""
    host = listen_host(allocation.hosts) if allocation is not None else ""
    if host:
        try:
            return ControlServer(host), host
        except OSError:
            pass
    return ControlServer(""), ""


def step_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of a step's ``srun``: the driver's, less the job's own resource request and a
    site's ``SLURM_OVERLAP``."""
    return {k: v for k, v in environ.items() if k not in _JOB_REQUEST_VARS}


def read_allocation(environ: Mapping[str, str], options: SlurmOptions) -> Allocation:
    """The driver's allocation: its environment, refined by what the controller knows (each node's GPUs
    and memory, threads per core, whether SLURM hands out whole cores; ``Allocation.refined``). Where
    ``scontrol`` does not answer, the environment alone, with a warning."""
    alloc = Allocation.from_env(environ)
    detail_text = _run_quiet(["scontrol", "-d", "show", "job", "-o", alloc.job_id])
    nodes_text = _run_quiet(["scontrol", "show", "node", "-o", ",".join(alloc.hosts)])
    config = _run_quiet(["scontrol", "show", "config"]) or ""
    if detail_text is None or nodes_text is None or not config:
        print(f"hpoflow: warning: scontrol did not describe job {alloc.job_id}; the engine plans with what the "
              "environment says (SLURM_JOB_CPUS_PER_NODE, SLURM_MEM_PER_NODE, SLURM_GPUS_PER_NODE)", file=sys.stderr,
              flush=True)
    alloc = alloc.refined(job_detail(detail_text or ""), node_hardware(nodes_text or ""),
                          whole_cores(config_value(config, "SelectTypeParameters") or ""))
    max_steps = config_value(config, "MaxStepCount") or ""
    return replace(alloc, one_thread_per_core=options.threads_per_core == 1,
                   max_step_count=int(max_steps) if max_steps.isascii() and max_steps.isdigit() else 0)


def _check_shape(request: TrialRequest, share_site: bool = False, agents: bool = False) -> None:
    """``EngineError`` for a shape the engine never runs. A share of a GPU runs on node agents only (each
    agent's local engine shares the GPUs its node was given; a step per trial would take whole GPUs).
    ``share_site``: a share's refusal says whether this cluster has ``gres/shard`` (one ``scontrol show
    config``; ``check_fit`` only)."""
    if request.elastic:
        raise EngineError("resources.processes: {min, max} makes trials elastic, which the slurm engine does not "
                          "resize. Fix: give resources.processes a number (or use the local or compss engine)")
    try:
        processes_per_node(request)
    except ValueError as exc:
        raise EngineError(str(exc)) from None
    if not agents and not float(request.gpus_per_process).is_integer():
        raise EngineError(_share_refusal(request.gpus_per_process, _gres_types() if share_site else None))


def _share_refusal(gpus_per_process: float, gres_types: str | None) -> str:
    """The one line refusing a share of a GPU; ``gres_types``: the cluster's ``GresTypes`` (None: unknown)."""
    head = f"resources.gpus_per_process: {gpus_per_process} shares a GPU between trials"
    fix = ("Fix: run the driver inside an allocation with engine_options.agents: auto or on (node agents share "
           "the allocation's GPUs between trials), set gpus_per_process: 1 (whole GPUs), or use the local engine")
    if gres_types is not None and "shard" in gres_types.split(","):
        return (f"{head}; this cluster has gres/shard (GresTypes={gres_types}), but hpoflow's slurm engine does "
                f"not ask SLURM for shards: a step or job per trial gives each rank whole GPUs. {fix}")
    where = " (and this cluster declares none)" if gres_types is not None else ""
    return (f"{head}, but a step or job per trial gives each rank whole GPUs: the slurm engine does not ask "
            f"SLURM for gres/shard{where}. {fix}")


def _gres_types() -> str | None:
    """This cluster's ``GresTypes`` (``gpu,shard``; ``""`` where it declares none), None where
    ``scontrol show config`` does not answer."""
    config = _run_quiet(["scontrol", "show", "config"])
    if not config:
        return None
    value = config_value(config, "GresTypes") or ""
    return "" if value == "(null)" else value


def _safe_name(study: str) -> str:
    """A study's name as a job name may hold it."""
    return "".join(c if c.isascii() and (c.isalnum() or c in "._-") else "_" for c in study)[:40]


def _fresh_attempt_dir(files: TrialFiles) -> None:
    """A new attempt starts with no protocol files (a resumed study may reuse a directory)."""
    files.dir.mkdir(parents=True, exist_ok=True)
    for p in files.dir.iterdir():
        if p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()


_run_quiet = run_client


def _seq(value: Any) -> int:
    """A report's ``seq`` as rank 0 sends it; -1 where it is not a number."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return -1


def _job_reason(job_id: str | None) -> str:
    """Why a job ended, as ``scontrol show job`` says (while SLURM still remembers it)."""
    out = _run_quiet(["scontrol", "show", "job", "-o", str(job_id)]) if job_id else None
    if not out:
        return "SLURM no longer knows the job (see its job.out)"
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return f"JobState={fields.get('JobState', '?')} Reason={fields.get('Reason', '?')}"


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
