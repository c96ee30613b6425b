"""The slurm engine's node agents (``engine_options.agents``): the driver's end.

Instead of one ``srun`` step per trial, the driver starts ONE step over the whole allocation
(``srun --ntasks-per-node=1``), whose task on each node is a node agent (``hpoflow.engines.agent``): the
local engine's warm pool on that node. Agents connect back to the driver's listening port (the step
reaches it at ``SLURM_LAUNCH_NODE_IPADDR``) and prove they hold the run's secret, which they get in the
step's environment, never in argv (``hpoflow.engines.agent.protocol``); a peer that does not is
dropped. Trials are then dispatched over these connections: the driver keeps each agent's free CPUs
and GPUs (the allocation's count for its node, as steps mode plans: ``Allocation.rank_cpus``) and
sends a trial to one agent, or a trial of several nodes to as many agents, each with its share of the
ranks (global rank numbers; the ranks meet at the TCP store the trial's rank 0 holds and announces in
the attempt directory, ``rendezvous.addr``). Reports, pruning answers, pauses, cancels and results
travel over the connections; the durable record stays on the shared file system (rank logs, results
the driver stores, checkpoints).

At scale: the listener admits agents on a thread of its own, in a stage of bounded size
(``hpoflow.engines.agent.listener``), bound to the address the agents are told. The driver's loop is a
selector (epoll) over the agents' connections: a wake-up reads the ready ones only, timeouts and the
step's state are checked ``TICK_S`` apart, waiting trials are placed from a heap of agents by load, and
the agents' heartbeat interval grows with the fleet (``heartbeat_interval``), so the driver reads about
``HEARTBEATS_PER_S`` heartbeats a second however many nodes there are. A thread pings the agents as
often; an agent that hears nothing from the driver for ``agent_timeout_s`` ends. The open-files limit is
raised to the hard limit at the start (``EngineError`` where even that cannot hold the fleet). An agent
that breaks the protocol (an oversized or too deeply nested frame, a metric that is no number) is
dropped like one that died.

Faults: an agent whose connection closes (it died, or was killed) or that sends nothing for
``agent_timeout_s`` (its node is gone) is dead: its node leaves the engine's allocation, the trials it
ran fail as retryable (their other nodes' ranks are cancelled), and the driver reruns them from their
checkpoints on the agents that are left, within ``resources.max_retries``. While the agents' step runs,
the driver starts a new agent step on a lost node (``--overlap``, that step only; ``RELAUNCHES`` times)
and re-admits the node when its agent says hello. Trials of several nodes go to warm agents only (their
ranks must meet within the process-group timeout). A fleet that never comes up (the step ends with no
agent, or none connects within ``agent_start_timeout_s``), or that is all lost with its step ended,
stops the study: ``FleetError``, before a trial is spent (the first ``capacity`` waits for an agent). A
pause (the walltime warning's ``USR1``) reaches the ranks as SIGUSR1 from their agent. ``close`` tells
the agents to exit, then ends the steps, which kills every rank.

This module holds ``AgentFleet``'s start, its engine contract, its loop and a trial's shares (sending to
them, cancelling them, merging their results); its other parts are base classes of it: ``_links.Links``
(admitting agents, reading their messages), ``_losses.Losses`` (lost agents, relaunches, a fleet that is
gone) and ``_placement.Placement`` (the placement heap, dispatch), on ``_fleet_state.FleetState``; the
plain records and functions are in ``_fleet``.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from hpoflow.engines.agent.listener import MAX_PENDING, Listener
from hpoflow.engines.agent.protocol import MAX_FRAME, SECRET_ENV, frame_of, new_secret
from hpoflow.engines.base import Event, TrialRequest, TrialResult
from hpoflow.engines.cluster.layout import default_pythonpath, export_flags
from hpoflow.engines.slurm._fleet import (
    HEARTBEATS_PER_S,
    Agent,
    FleetError,
    Trial,
    heartbeat_interval,
    listen_host,
    merged_result,
    raise_open_files,
)
from hpoflow.engines.slurm._links import Links
from hpoflow.engines.slurm._losses import RELAUNCH_AFTER_S as RELAUNCH_AFTER_S
from hpoflow.engines.slurm._losses import RELAUNCHES as RELAUNCHES
from hpoflow.engines.slurm._losses import Losses
from hpoflow.engines.slurm._placement import Placement
from hpoflow.engines.slurm.allocation import Allocation
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.fileio import write_json_atomic
from hpoflow.train.transport import TrialFiles
from hpoflow.trial import RANK_DIED

__all__ = ["AgentFleet", "FleetError", "heartbeat_interval", "raise_open_files"]

_Trial, _merged_result = Trial, merged_result  # (their names before they moved to _fleet: tests/engines/slurm)
# RELAUNCHES and RELAUNCH_AFTER_S (imported above) still import from here; Losses reads them in _losses, so a
# test patches them there

_START_ROOM = 64 << 10  # what a start message holds beside the request (its share, its memory)
TICK_S = 0.5  # agents' timeouts, the step's state and relaunches are checked this often, whatever the fleet
READ_GAP_S = 0.02  # in a fleet over HEARTBEATS_PER_S nodes, the driver's wake-ups are at least this far apart
_FILES_SPARE = 64  # descriptors the driver needs beside one per agent and the listener's stage
# after a node's ranks of a trial fail without a death of their own (a broken collective: maybe the echo
# of a rank's death on another node), the other nodes' shares are cancelled this much later, unless one of
# them names a death first; as the local engine waits for a peer's end that may be a failure's cause
PEER_WAIT_S = 1.0


class AgentFleet(Links, Losses, Placement):
    """The agents of one driver; the slurm engine hands it every trial when agents are on."""

    def __init__(self, allocation: Allocation, options: SlurmOptions, run_dir: Path, python: str,
                 environ: dict[str, str], name: str) -> None:
        self.allocation = allocation
        self._job = allocation  # every node of the job: a lost node comes back into ``allocation`` from it
        self._index = {h: i for i, h in enumerate(allocation.hosts)}
        self.options = options
        self.dir = run_dir / "agents"
        self.dir.mkdir(parents=True, exist_ok=True)
        n = len(allocation.hosts)
        self.open_files = raise_open_files(n + MAX_PENDING + _FILES_SPARE, n)
        self.heartbeat_s = heartbeat_interval(n, options.agent_timeout_s)
        # the agents end after agent_timeout_s without a word from the driver: 3 pings in that time at least
        self.ping_s = max(self.heartbeat_s, options.agent_timeout_s / 3)
        self._read_gap_s = READ_GAP_S if n > HEARTBEATS_PER_S else 0.0
        self._last_read = 0.0
        self._secret = new_secret()
        host = listen_host(allocation.hosts)
        if not host:
            print("hpoflow: no route from this node to the job's other nodes is known: listening for node agents "
                  "on every address (they connect to SLURM_LAUNCH_NODE_IPADDR and must prove the run's secret)",
                  file=sys.stderr, flush=True)
        try:
            self._listener = Listener(host, self._secret)
        except OSError as exc:  # (the routed address is not this process's to bind: every address, then)
            print(f"hpoflow: cannot listen for node agents on {host} ({exc}): listening on every address",
                  file=sys.stderr, flush=True)
            host = ""
            self._listener = Listener(host, self._secret)
        self.host = host  # what the agents are told ("": SLURM_LAUNCH_NODE_IPADDR, the node srun ran on)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._listener.fileno(), selectors.EVENT_READ, None)
        self.agents: dict[str, Agent] = {}
        self._lost: dict[str, str] = {}
        self._lost_at: dict[str, float] = {}
        self._relaunched: dict[str, list[subprocess.Popen[bytes]]] = {}
        self._trials: dict[int, Trial] = {}
        self._waiting: dict[int, Trial] = {}  # submitted, not placed yet, in order
        self._heap: list[tuple[int, int, int, str]] = []  # (used CPUs, node index, version, node)
        self._dirty = False  # something changed that may let a waiting trial start
        self._held: set[str] = set()  # nodes whose agent is held out of placement after a start failure
        self._cancel_at: dict[int, float] = {}  # trial -> when its other nodes' shares are cancelled (PEER_WAIT_S)
        self._events: list[Event] = []
        self._closed = False
        self._next_tick = 0.0
        self._empty_since: float | None = None  # when the fleet last became empty (after it had agents)
        self._warm = 0
        self._waited = False
        self._interrupted = False  # a stop began (``interrupt``, maybe from a signal handler): wait for no agent
        self.heartbeats = 0  # heartbeats read (the bench's count)
        a = allocation
        env = dict(options.env)
        env.setdefault("PYTHONPATH", default_pythonpath())
        self._env = {**environ, **env, SECRET_ENV: self._secret}
        self._python, self._name = python, name
        self.started_at = time.monotonic()
        self.warm_at: float | None = None  # when every agent said its warm pool is up
        self._record: dict[str, float] = {"step_started": time.time()}  # agents.json: the agents' start
        self.proc = self._srun(list(a.hosts), min(a.cpus), False)
        self._stop_pings = threading.Event()
        threading.Thread(target=self._ping, name="hpoflow-agents-ping", daemon=True).start()

    def _srun(self, hosts: list[str], cpus: int, overlap: bool) -> subprocess.Popen[bytes]:
        """Start an agent step on ``hosts`` (the whole job; or one lost node, ``overlap``: the dead agent's
        step still holds that node's resources)."""
        a, options = self.allocation, self.options
        argv = ["srun", f"--job-name={self._name}", f"--nodes={len(hosts)}", f"--ntasks={len(hosts)}",
                "--ntasks-per-node=1", f"--cpus-per-task={cpus}",
                f"--gres=gpu:{a.gpus_per_node}" if a.gpus_per_node else "--gres=none", "--mem=0",
                "--kill-on-bad-exit=0", "--no-kill", "--input=none",
                f"--output={self.dir / 'agent-%N.out'}", "--open-mode=append"]  # by node name: a relaunch appends
        if overlap:
            argv += [f"--nodelist={hosts[0]}", "--overlap"]
        if not any(x == "--mpi" or x.startswith("--mpi=") for x in options.srun_args):
            argv.append("--mpi=none")
        argv += [*export_flags(options.srun_args, ("PYTHONPATH", SECRET_ENV)), self._python, "-m",
                 "hpoflow.engines.agent", "--port", str(self.port),
                 "--pg-timeout-s", str(options.pg_timeout_s), "--socket-ifname", options.socket_ifname,
                 "--heartbeat-s", f"{self.heartbeat_s:g}", "--connect-timeout-s", f"{options.agent_start_timeout_s:g}",
                 "--driver-timeout-s", f"{options.agent_timeout_s:g}"]
        if self.host:
            argv += ["--host", self.host]
        with open(self.dir / "srun.log", "ab") as log:
            log.write((shlex.join(argv) + "\n").encode())
            log.flush()
            return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                    env=self._env)

    @property
    def port(self) -> int:
        return self._listener.port

    @property
    def refused(self) -> int:
        """Connections dropped for not holding the secret (or not saying hello in time)."""
        return self._listener.refused

    def _ping(self) -> None:
        """Ping every agent each ``ping_s``, from a thread: an agent hears from its driver while
        the driver's loop is busy elsewhere (the study's storage), and ends when it hears nothing."""
        ping = frame_of({"kind": "ping"})
        while not self._stop_pings.wait(self.ping_s):
            for agent in list(self.agents.values()):
                agent.link.send_frame(ping)

    # -- the engine contract, for the slurm engine ----------------------------------------------------
    def capacity(self, request: TrialRequest) -> int:
        """The allocation's capacity; the first call waits for the first agent, so a fleet that never
        comes up stops the study (``FleetError``) before it asks for a trial; a stop (``interrupt``) ends the
        wait, and the driver, stopping, starts nothing."""
        if not self._waited:
            self._waited = True
            while not self.agents and not self._interrupted:
                self._turn(TICK_S)
        return self.allocation.capacity(request)

    def interrupt(self) -> None:
        """A stop has begun (the driver's, from a signal handler too): no more waiting for the agents."""
        self._interrupted = True

    def submit(self, request: TrialRequest) -> None:
        size = len(json.dumps(request.to_json()))
        if size > MAX_FRAME - _START_ROOM:  # an agent would drop the link at it (and the retry, on the next)
            self._events.append(TrialResult(
                request.number, "failed",
                error=f"trial {request.number}'s request is {size} bytes of JSON, more than a message to a node agent "
                      f"holds ({MAX_FRAME - _START_ROOM}): its parameters or training options are too large to send. "
                      "Fix: pass large data by path (a file the ranks read), not in training.options"))
            return
        files = TrialFiles(Path(request.trial_dir), request.attempt)
        files.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            (files.dir / "rendezvous.addr").unlink()  # a rerun's rank 0 announces anew
        t = Trial(request, files, time.monotonic(), time.time())
        self._trials[request.number] = self._waiting[request.number] = t
        self._dispatch()

    def poll(self, timeout: float | None) -> list[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._turn(0.0)  # what arrived while the driver was away, before any timeout is judged
        while True:
            if self._dirty:
                self._dispatch()
            if self._events or not self._trials:
                out, self._events = self._events, []
                return out
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            step = max(0.0, self._next_tick - now)
            if self._cancel_at:
                step = min(step, 0.05)
            self._turn(step if deadline is None else min(step, deadline - now))

    def serve(self, seconds: float) -> None:
        """Keep the agents (admit, read, check) for ``seconds`` without a trial to wait for."""
        end = time.monotonic() + seconds
        while (left := end - time.monotonic()) > 0:
            self._turn(min(left, max(0.0, self._next_tick - time.monotonic())))
            if self._dirty:
                self._dispatch()

    def _turn(self, wait_s: float) -> None:
        """One wake-up: read the ready connections (and new agents), then the fixed-rate checks if due. In a
        fleet over ``HEARTBEATS_PER_S`` nodes wake-ups are at least ``READ_GAP_S`` apart, so each reads
        several connections (a wake-up costs more than a message)."""
        if self._read_gap_s and wait_s > 0:
            gap = min(wait_s, self._last_read + self._read_gap_s - time.monotonic())
            if gap > 0:
                time.sleep(gap)
                wait_s -= gap
        ready = self._sel.select(max(0.0, wait_s))
        self._last_read = time.monotonic()
        for key, _ in ready:
            if key.data is None:
                self._admit_new()
            else:
                self._read(key.data)
        now = time.monotonic()
        if now >= self._next_tick:
            self._next_tick = now + TICK_S
            self._check_lost(now)
            for node in [n for n in self._held if n not in self.agents or self.agents[n].held_until <= now]:
                self._held.discard(node)  # its hold is over: waiting trials may go there again
                self._dirty = True
        if self._cancel_at:
            self._cancel_due(now)

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        t = self._trials.get(number)
        if t is None or not t.pending_answer or not t.nodes:
            return
        t.pending_answer = False
        self._send(t.nodes[0], {"kind": "answer", "number": number, "prune": prune, "pause": pause})

    def cancel(self, number: int, reason: str) -> None:
        t = self._trials.get(number)
        if t is None or t.cancel_reason is not None:
            return
        t.cancel_reason = reason
        if not t.started:
            self._events.append(TrialResult(number, "cancelled", error=reason,
                                            timings={"duration_s": time.monotonic() - t.submitted}))
            del self._trials[number]
            self._waiting.pop(number, None)
            self._dirty = True
            return
        self._to_shares(t, {"kind": "cancel", "number": number, "reason": reason})

    def pause(self, number: int, reason: str) -> None:
        t = self._trials.get(number)
        if t is None or t.cancel_reason is not None:
            return
        if not t.started:  # it never ran: nothing to checkpoint
            self.cancel(number, f"paused ({reason}) before it started")
            return
        self._to_shares(t, {"kind": "pause", "number": number, "reason": reason})

    def running(self) -> list[int]:
        return sorted(self._trials)

    def close(self, grace_s: float) -> None:
        """Tell the agents to exit (each kills its ranks), then end the steps, which kills what is left."""
        if self._closed:
            return
        self._closed = True
        self._stop_pings.set()
        for agent in list(self.agents.values()):
            agent.link.send({"kind": "exit"})
        procs = [self.proc, *(p for ps in self._relaunched.values() for p in ps)]
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if all(proc.poll() is not None for proc in procs):
                break
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(OSError):
                        os.killpg(proc.pid, sig)
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(grace_s)
        for agent in self.agents.values():
            agent.link.close()
        self._listener.close()
        self._sel.close()
        self._trials.clear()
        self._waiting.clear()

    # -- sending to the agents, a trial's shares --------------------------------------------------------
    def _note(self, what: str) -> None:
        """Record when the agents reached a stage of their start (``agents/agents.json``, wall clock)."""
        self._record[what] = time.time()
        with contextlib.suppress(OSError):
            write_json_atomic(self.dir / "agents.json", self._record)

    def _send(self, node: str, msg: dict[str, Any]) -> None:
        agent = self.agents.get(node)
        if agent is not None and not agent.link.send(msg):
            self._agent_lost(node, "its connection closed: the agent died or was killed")

    def _to_shares(self, t: Trial, msg: dict[str, Any]) -> None:
        for node in t.nodes:
            if node not in t.ended:
                self._send(node, msg)

    def _cancel_shares(self, t: Trial, node: str) -> None:
        self._cancel_at.pop(t.request.number, None)
        self._to_shares(t, {"kind": "cancel", "number": t.request.number,
                            "reason": f"the trial's ranks on {node} ended ({t.lost or 'failed'})"})

    def _cancel_due(self, now: float) -> None:
        for number, at in list(self._cancel_at.items()):
            t = self._trials.get(number)
            if t is None:  # every node's share ended meanwhile
                del self._cancel_at[number]
            elif now >= at:
                self._cancel_shares(t, t.failed_first or t.nodes[0])

    def _share_ended(self, agent: Agent, number: int, result: TrialResult | None) -> None:
        t = self._trials.get(number)
        if t is None or agent.node not in t.nodes or agent.node in t.ended:
            return
        t.ended[agent.node] = result
        agent.trials.discard(number)
        agent.used_cpus -= t.cpus
        agent.used_gpus -= t.gpus
        if agent.node in self.agents:
            self._placeable(agent)
        failed = result is None or result.status == "failed"
        if failed and t.failed_first is None and result is not None:
            t.failed_first = agent.node
        if failed and len(t.ended) < len(t.nodes):  # the other nodes' ranks would wait in a collective
            echo = result is not None and RANK_DIED not in (result.error or "") and t.lost is None
            if echo:
                # a failure that may be the echo of a peer's death on another node (its collective broke):
                # that node's word, which names the death, gets PEER_WAIT_S to come first
                self._cancel_at.setdefault(number, time.monotonic() + PEER_WAIT_S)
            else:
                self._cancel_shares(t, agent.node)
        if len(t.ended) == len(t.nodes):
            del self._trials[number]
            self._events.append(merged_result(t))
