"""Steps mode after a step failed as retryable: what SLURM says of the job now, read off the poll path.

A node that crashes (its slurmd and every process on it gone at once, not an administrative ``scontrol
update state=down``) is marked down only ``SlurmdTimeout`` s later (300 by default), and only then
taken out of a ``--no-kill`` job; the ranks on the other nodes fail first, in a collective, with an
error of their own. So after every retryable failure of a step (of one node or several) the engine
**settles** before it starts another step or passes the failed attempt's result on (``Settle``; the
driver then decides the rerun, or that the nodes left can no longer hold the trial, on the job as
SLURM has it): it reads the job's nodes (``scontrol show
job``) and its steps (``squeue -s``) again and again until the failed step is gone with every node
still in the job (no node was lost: a rank was killed or ran out of memory), or a node of the step
left the job, or ``SlurmdTimeout`` and a minute have passed. Without it the rerun would start in
``srun`` on the dead node or beside the step SLURM still holds, and wait there.

SLURM 22.05 then keeps the failed step's CPUs on its surviving nodes for the rest of the job (a step
asking for them waits in ``srun`` for good; its memory and GPUs are given back). The engine counts
them as taken (``held_allocation``) instead of running later steps with ``--overlap``: an overlapping
step is no longer kept apart from the others, so CPUs are oversubscribed and GPUs given twice.

``SlurmWatch`` runs those ``scontrol`` and ``squeue`` in one thread, one at a time, each bounded; the
poll loop only asks for a look and takes the newest answer (``ask``, ``latest``), so a slow
controller never stalls reports, decisions or the start of trials that fit.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from hpoflow.engines.cluster.hostlist import HostlistError, expand
from hpoflow.engines.slurm.allocation import Allocation, config_value, job_nodes
from hpoflow.trial import TrialResult

__all__ = ["DEFAULT_SLURMD_TIMEOUT_S", "JobView", "Replan", "Settle", "SlurmWatch", "held_allocation", "run_client",
           "steps_of"]

DEFAULT_SLURMD_TIMEOUT_S = 300.0  # SLURM's default SlurmdTimeout, where scontrol show config does not say
SETTLE_MARGIN_S = 60.0  # past SlurmdTimeout: a ping period and the controller's own delay
CLIENT_TIMEOUT_S = 60.0
LOOK_EVERY_S = 1.0  # while a failure waits: SLURM asked about the job at most this often


def run_client(argv: list[str]) -> str | None:
    """Run a SLURM client; its stdout, or None when it failed or did not answer in ``CLIENT_TIMEOUT_S``."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=CLIENT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def steps_of(squeue_steps: str) -> dict[str, tuple[str, tuple[str, ...]]]:
    """``squeue -s -h -o '%i %j %N'``: step id -> (step name, its nodes)."""
    out: dict[str, tuple[str, tuple[str, ...]]] = {}
    for line in squeue_steps.splitlines():
        parts = line.split()
        if len(parts) < 2:
            continue
        try:
            nodes = tuple(expand(parts[2])) if len(parts) > 2 else ()
        except HostlistError:
            nodes = ()
        out[parts[0]] = (parts[1], nodes)
    return out


@dataclass(frozen=True)
class JobView:
    """One look at the job: its nodes (None: SLURM did not say) and its steps, taken at ``at``."""

    at: float
    nodes: tuple[str, ...] | None
    steps: dict[str, tuple[str, tuple[str, ...]]] | None
    slurmd_timeout_s: float


class SlurmWatch:
    """One thread that looks at the job when asked, one client at a time (see the module docstring)."""

    def __init__(self, job_id: str, run: Callable[[list[str]], str | None] = run_client) -> None:
        self.job_id = job_id
        self._run = run
        self._cv = threading.Condition()
        self._asked = False
        self._busy = False
        self._latest: JobView | None = None
        self._closed = False
        self._slurmd_timeout: float | None = None
        self._thread: threading.Thread | None = None

    def ask(self) -> None:
        """Ask for a look (one more after the one under way, if any; asks in between are one)."""
        with self._cv:
            if self._closed:
                return
            self._asked = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="hpoflow-slurm-watch", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    @property
    def idle(self) -> bool:
        """No look asked for or under way."""
        with self._cv:
            return not self._asked and not self._busy

    def latest(self) -> JobView | None:
        with self._cv:
            return self._latest

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._asked and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                self._asked, self._busy = False, True
            try:
                view = self._look()
            finally:
                with self._cv:
                    self._busy = False
            with self._cv:
                self._latest = view
                self._cv.notify_all()

    def _look(self) -> JobView:
        if self._slurmd_timeout is None:
            config = self._run(["scontrol", "show", "config"]) or ""
            raw = (config_value(config, "SlurmdTimeout") or "").split()[0:1]
            self._slurmd_timeout = float(raw[0]) if raw and raw[0].isascii() and raw[0].isdigit() \
                else DEFAULT_SLURMD_TIMEOUT_S
        started = time.monotonic()
        job = self._run(["scontrol", "show", "job", "-o", self.job_id])
        nodes = job_nodes(job) if job else None
        listed = self._run(["squeue", "-s", "-h", "-j", self.job_id, "-o", "%i %j %N"])
        return JobView(started, tuple(nodes) if nodes else None, steps_of(listed) if listed is not None else None,
                       self._slurmd_timeout)


@dataclass
class Settle:
    """A step that failed as retryable: the engine waits for SLURM's word on its nodes before
    it starts another step. ``nodes``: the step's nodes (from rank 0's hello, else its ranks' outcomes
    and ``squeue``); ``step_id``/``name``: how ``squeue -s`` lists it; ``held_cpus``: the CPUs the step
    had on each of its nodes. Its ``result`` reaches the driver only once settled, so the driver decides
    the rerun (or that the nodes left cannot hold the trial) on the job as SLURM has it now."""

    number: int
    since: float
    nodes: set[str]
    step_id: str
    name: str
    held_cpus: int
    result: TrialResult  # the failed attempt's, passed on once SLURM has spoken (the rerun is decided on it)
    deadline: float | None = None
    done: bool = False

    def listed(self, view: JobView) -> tuple[str, ...] | None:
        """The step's nodes where ``view`` still lists it, else None."""
        for step_id, (name, nodes) in (view.steps or {}).items():
            if (self.step_id and step_id == self.step_id) or (not self.step_id and name == self.name):
                return nodes
        return None


def held_allocation(allocation: Allocation, held: Mapping[str, int]) -> Allocation:
    """``allocation`` with the CPUs SLURM still holds for failed steps (``held``: node -> CPUs) taken out
    of each node, for planning."""
    if not held:
        return allocation
    cpus = tuple(max(0, c - held.get(h, 0)) for h, c in zip(allocation.hosts, allocation.cpus, strict=True))
    return replace(allocation, cpus=cpus)


class Replan:
    """The steps-mode engine's plan of the allocation across failed steps (see the module
    docstring): ``job``, the allocation as SLURM last said; ``planned``, that less the CPUs SLURM holds
    for failed steps (what the engine plans with); ``waiting``, the failures whose results wait for
    SLURM's word. ``begin`` a failure; ``step`` on every poll applies SLURM's newest word (never waits
    for it) and returns the results of the failures it settled, in order."""

    def __init__(self, allocation: Allocation, watch: SlurmWatch | None = None) -> None:
        self.job = self.planned = allocation
        self.held: dict[str, int] = {}
        self.waiting: list[Settle] = []
        self._watch = watch if watch is not None else SlurmWatch(allocation.job_id)
        self._asked_at = 0.0

    def begin(self, settle: Settle) -> None:
        self.waiting.append(settle)
        print(f"hpoflow: trial {settle.number}'s step on {','.join(sorted(settle.nodes)) or 'its nodes'} failed as "
              "retryable; no step starts until SLURM says whether a node of it is lost", file=sys.stderr, flush=True)
        self._watch.ask()
        self._asked_at = time.monotonic()

    def step(self) -> list[TrialResult]:
        if not self.waiting:
            return []
        view, now = self._watch.latest(), time.monotonic()
        if view is not None and view.at >= min(s.since for s in self.waiting):
            self._apply(view, now)
        for s in self.waiting:  # a controller that never answers holds no trial for good
            if not s.done and now > (s.deadline or s.since + DEFAULT_SLURMD_TIMEOUT_S + SETTLE_MARGIN_S):
                print(f"hpoflow: warning: no word from SLURM on the nodes of trial {s.number}'s failed step "
                      f"{now - s.since:.0f} s later (it still lists the step with every node); steps start again",
                      file=sys.stderr, flush=True)
                s.done = True
        done = [s for s in self.waiting if s.done]
        self.waiting = [s for s in self.waiting if not s.done]
        if self.waiting and self._watch.idle and now - self._asked_at >= LOOK_EVERY_S:
            self._watch.ask()
            self._asked_at = now
        return [s.result for s in done]

    def close(self) -> None:
        self._watch.close()

    def _apply(self, view: JobView, now: float) -> None:
        if view.nodes and set(view.nodes) < set(self.job.hosts):
            lost = [h for h in self.job.hosts if h not in view.nodes]
            self.job = self.job.keeping(view.nodes)
            print(f"hpoflow: node(s) {','.join(lost)} left the allocation (job {self.job.job_id}); trials now run on "
                  f"{','.join(self.job.hosts) or 'no node'}", file=sys.stderr, flush=True)
        for s in [s for s in self.waiting if view.at >= s.since]:
            if s.deadline is None:
                s.deadline = s.since + view.slurmd_timeout_s + SETTLE_MARGIN_S
            listed = s.listed(view)
            s.nodes |= set(listed or ())
            gone = s.nodes - set(self.job.hosts)
            if gone:  # SLURM keeps the failed step's CPUs on the nodes left (22.05): counted as taken
                kept = sorted(s.nodes - gone)
                for h in kept:
                    self.held[h] = self.held.get(h, 0) + s.held_cpus
                if kept:
                    print(f"hpoflow: SLURM still holds the {s.held_cpus} CPU(s) of trial {s.number}'s failed step on "
                          f"{','.join(kept)}; the engine plans without them (no --overlap)", file=sys.stderr,
                          flush=True)
                s.done = True
            elif listed is None and view.steps is not None:  # it ended on every node: none was lost
                s.done = True
        self.planned = held_allocation(self.job, self.held)
