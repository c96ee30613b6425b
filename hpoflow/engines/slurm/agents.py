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

Faults: an agent whose connection closes (it died, or was killed) or that sends nothing for
``agent_timeout_s`` (its node is gone) is dead: its node leaves the engine's allocation, the trials it
ran fail as retryable (their other nodes' ranks are cancelled), and the driver reruns them from their
checkpoints on the agents that are left, within ``resources.max_retries``. A pause (the walltime
warning's ``USR1``) reaches the ranks as SIGUSR1 from their agent. ``close`` tells the agents to exit,
then ends the step, which kills every rank.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from hpoflow.engines.agent.protocol import SECRET_ENV, AuthError, Link, accept, new_secret
from hpoflow.engines.base import Event, TrialReport, TrialRequest, TrialResult
from hpoflow.engines.cluster.layout import default_pythonpath, export_flags, processes_per_node
from hpoflow.engines.proc import tail
from hpoflow.engines.slurm.allocation import Allocation
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.fileio import write_json_atomic
from hpoflow.spec import shares_per_gpu
from hpoflow.train.transport import TrialFiles
from hpoflow.trial import RANK_DIED

__all__ = ["AgentFleet"]

_HELLO_S = 10.0  # an admitted agent says which node it is within this
_START_TIMEOUT_S = 600.0  # an agent not connected by then (its node never started it) counts as lost
# after a node's ranks of a trial fail without a death of their own (a broken collective: maybe the echo
# of a rank's death on another node), the other nodes' shares are cancelled this much later, unless one of
# them names a death first; as the local engine waits for a peer's end that may be a failure's cause
PEER_WAIT_S = 1.0


@dataclass
class _Agent:
    node: str
    link: Link
    cpus: int  # what the driver plans with: the allocation's CPUs on the node (at most the agent's slots)
    gpus: int
    last_seen: float
    trials: set[int] = field(default_factory=set)
    used_cpus: int = 0
    used_gpus: Fraction = Fraction(0)  # GPUs, or shares of GPUs (resources.gpus_per_process: 1/k)
    warm_s: float | None = None


@dataclass
class _Trial:
    request: TrialRequest
    files: TrialFiles
    submitted: float
    submitted_wall: float
    nodes: list[str] = field(default_factory=list)  # its agents, rank 0's first; empty while waiting
    cpus: int = 0  # taken on each of its nodes
    gpus: Fraction = Fraction(0)
    ended: dict[str, TrialResult | None] = field(default_factory=dict)  # node -> its share's result (None: lost)
    lost: str | None = None
    failed_first: str | None = None  # the node whose ranks failed first
    cancel_reason: str | None = None
    pending_answer: bool = False

    @property
    def started(self) -> bool:
        return bool(self.nodes)


def _merged_result(t: _Trial) -> TrialResult:
    """The result of a trial from its nodes' shares: lost (a node or agent gone) and retryable, a failure
    (named with its node), else rank 0's node's."""
    n = t.request.number
    duration = time.monotonic() - t.submitted
    chief = t.ended.get(t.nodes[0])
    if t.lost is not None and t.cancel_reason is None and (chief is None or chief.status != "complete"):
        return TrialResult(n, "failed", error=t.lost, retryable=True, timings={"duration_s": duration})
    # Which node's ranks failed: one where a rank died (``rank_died``: a signal, an exit), whose peers on
    # the other nodes then failed in a collective (whichever agent's word came first); else the first.
    fails = [(node, r) for node, r in t.ended.items() if r is not None and r.status == "failed"]
    died = [(node, r) for node, r in fails if RANK_DIED in (r.error or "")]
    first = died or [(node, r) for node, r in fails if node == t.failed_first]
    failed = None
    if first:
        node, failed = first[0]
        if len(t.nodes) > 1:
            failed = replace(failed, error=f"{failed.error} (on {node})")
    result = failed or chief
    if result is None:  # lost, but cancelled meanwhile
        return TrialResult(n, "cancelled", error=t.cancel_reason, timings={"duration_s": duration})
    timings = {**result.timings, "engine_duration_s": duration}
    if "started_at" in timings:  # from the driver's submit (the agent's own count starts when it got it)
        timings["launch_s"] = timings["started_at"] - t.submitted_wall
    return TrialResult(n, result.status, result.value, result.metrics, result.error, result.stderr_tail,
                       timings, result.retryable, result.system)


class AgentFleet:
    """The agents of one driver; the slurm engine hands it every trial when agents are on."""

    def __init__(self, allocation: Allocation, options: SlurmOptions, run_dir: Path, python: str,
                 environ: dict[str, str], name: str) -> None:
        self.allocation = allocation
        self.options = options
        self.dir = run_dir / "agents"
        self.dir.mkdir(parents=True, exist_ok=True)
        self._secret = new_secret()
        self._server = socket.create_server(("", 0))
        self._admitted: queue.SimpleQueue[tuple[Link, dict[str, Any] | None]] = queue.SimpleQueue()
        self.refused = 0  # connections dropped for not holding the secret
        self.agents: dict[str, _Agent] = {}
        self._lost: dict[str, str] = {}
        self._trials: dict[int, _Trial] = {}
        self._cancel_at: dict[int, float] = {}  # trial -> when its other nodes' shares are cancelled (PEER_WAIT_S)
        self._events: list[Event] = []
        self._closed = False
        threading.Thread(target=self._accept, name="hpoflow-agents-accept", daemon=True).start()
        a = allocation
        env = dict(options.env)
        env.setdefault("PYTHONPATH", default_pythonpath())
        argv = ["srun", f"--job-name={name}", f"--nodes={len(a.hosts)}", f"--ntasks={len(a.hosts)}",
                "--ntasks-per-node=1", f"--cpus-per-task={min(a.cpus)}",
                f"--gres=gpu:{a.gpus_per_node}" if a.gpus_per_node else "--gres=none", "--mem=0",
                "--kill-on-bad-exit=0", "--no-kill", "--input=none", f"--output={self.dir / 'agent-%n.out'}"]
        if not any(x == "--mpi" or x.startswith("--mpi=") for x in options.srun_args):
            argv.append("--mpi=none")
        argv += [*export_flags(options.srun_args, ("PYTHONPATH", SECRET_ENV)), python, "-m", "hpoflow.engines.agent",
                 "--port", str(self.port), "--pg-timeout-s", str(options.pg_timeout_s),
                 "--socket-ifname", options.socket_ifname]
        self.started_at = time.monotonic()
        self.warm_at: float | None = None  # when every agent said its warm pool is up
        self._record: dict[str, float] = {"step_started": time.time()}  # agents.json: the agents' start
        with open(self.dir / "srun.log", "ab") as log:
            log.write((shlex.join(argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                                         env={**environ, **env, SECRET_ENV: self._secret})

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def _accept(self) -> None:
        """Admit connections that prove the secret (a thread: a peer that stalls the challenge stalls
        nothing else)."""
        while True:
            try:
                sock, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._admit, args=(sock,), daemon=True).start()

    def _admit(self, sock: socket.socket) -> None:
        try:
            link = accept(sock, self._secret)
            self._admitted.put((link, link.recv_one(_HELLO_S)))
        except AuthError as exc:
            self.refused += 1
            print(f"hpoflow: dropped a connection to the agents' port that did not prove the run's secret ({exc})",
                  file=sys.stderr, flush=True)

    # -- the engine contract, for the slurm engine ----------------------------------------------------
    def capacity(self, request: TrialRequest) -> int:
        return self.allocation.capacity(request)

    def submit(self, request: TrialRequest) -> None:
        files = TrialFiles(Path(request.trial_dir), request.attempt)
        files.dir.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            (files.dir / "rendezvous.addr").unlink()  # a rerun's rank 0 announces anew
        self._trials[request.number] = _Trial(request, files, time.monotonic(), time.time())
        self._dispatch()

    def poll(self, timeout: float | None) -> list[Event]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._admit_new()
            for agent in list(self.agents.values()):
                self._read(agent)
            self._check_lost()
            self._cancel_due()
            self._dispatch()
            if self._events or not self._trials:
                out, self._events = self._events, []
                return out
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return []
            step = 1.0 if len(self.agents) == len(self.allocation.hosts) else 0.05  # (agents still to come)
            if self._cancel_at:
                step = min(step, 0.05)
            links = [a.link.sock for a in self.agents.values() if not a.link.closed]
            wait(links, step if deadline is None else max(0.0, min(step, deadline - now)))

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
        """Tell the agents to exit (each kills its ranks), then end the step, which kills what is left."""
        if self._closed:
            return
        self._closed = True
        for agent in self.agents.values():
            agent.link.send({"kind": "exit"})
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(grace_s)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(OSError):
                os.killpg(self.proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(grace_s)
        for agent in self.agents.values():
            agent.link.close()
        with contextlib.suppress(OSError):
            self._server.close()
        self._trials.clear()

    # -- agents -----------------------------------------------------------------------------------------
    def _admit_new(self) -> None:
        while True:
            try:
                link, hello = self._admitted.get_nowait()
            except queue.Empty:
                return
            if hello is None or hello.get("kind") != "hello":
                hello = {}
            node = str(hello.get("node", ""))
            if node not in self.allocation.hosts or node in self.agents:
                print(f"hpoflow: an agent from {link.peer} named node {node!r}, which is not a node of job "
                      f"{self.allocation.job_id} without an agent: closed", file=sys.stderr, flush=True)
                link.close()
                continue
            i = self.allocation.hosts.index(node)
            cores, gpus = list(hello.get("cores") or []), list(hello.get("gpus") or [])
            self.agents[node] = _Agent(node, link, min(self.allocation.cpus[i], len(cores)),
                                       min(self.allocation.gpus_per_node, len(gpus)), time.monotonic())
            if len(self.agents) == len(self.allocation.hosts):
                self._note("connected")
                print(f"hpoflow: {len(self.agents)} node agent(s) up {time.monotonic() - self.started_at:.1f} s after "
                      "their step started", file=sys.stderr, flush=True)

    def _read(self, agent: _Agent) -> None:
        msgs = agent.link.read()
        if msgs:
            agent.last_seen = time.monotonic()
        for msg in msgs:
            kind = msg.get("kind")
            if kind == "warm":
                agent.warm_s = float(msg.get("seconds") or 0.0)
                if self.warm_at is None and all(a.warm_s is not None for a in self.agents.values()) \
                        and len(self.agents) == len(self.allocation.hosts):
                    self.warm_at = time.monotonic()
                    self._note("warm")
                    print(f"hpoflow: node agents warm (torch preloaded, workers forked) "
                          f"{self.warm_at - self.started_at:.1f} s after their step started", file=sys.stderr,
                          flush=True)
            elif kind == "report":
                t = self._trials.get(int(msg.get("number", -1)))
                if t is None or not t.nodes or t.nodes[0] != agent.node:
                    continue
                wants = bool(msg.get("wants"))
                t.pending_answer = t.pending_answer or wants
                metrics = {str(k): float(v) for k, v in (msg.get("metrics") or {}).items()}
                self._events.append(TrialReport(t.request.number, int(msg.get("step", 0)), metrics, wants))
            elif kind == "result":
                number = int(msg.get("number", -1))
                self._share_ended(agent, number, TrialResult.from_dict({**msg.get("result", {}), "number": number}))
        if agent.link.closed:
            self._agent_lost(agent.node, "its connection closed: the agent died or was killed")

    def _check_lost(self) -> None:
        now = time.monotonic()
        limit = self.options.agent_timeout_s
        for agent in list(self.agents.values()):
            if now - agent.last_seen > limit:
                self._agent_lost(agent.node, f"no word from it for {now - agent.last_seen:.0f} s (agent_timeout_s)")
        ended = self.proc.poll() is not None
        for node in self.allocation.hosts:
            if node not in self.agents and (ended or now - self.started_at > _START_TIMEOUT_S):
                self._agent_lost(node, f"the agents' step ended (srun exit {self.proc.returncode})" if ended
                                 else f"its agent did not connect within {_START_TIMEOUT_S:g} s")
        if ended and not self.agents:  # no agent will run what waits: fail it, with the step's log
            why = tail(self.dir / "srun.log", 1500)
            for number in list(self._trials):
                self._events.append(TrialResult(number, "failed", error="the node agents' step ended (srun exit "
                                                f"{self.proc.returncode}; see {self.dir})", stderr_tail=why))
                del self._trials[number]

    def _agent_lost(self, node: str, why: str) -> None:
        agent = self.agents.pop(node, None)
        if node in self._lost:
            return
        self._lost[node] = why
        self.allocation = self.allocation.keeping(h for h in self.allocation.hosts if h != node)
        print(f"hpoflow: node agent on {node} lost ({why}); trials now run on "
              f"{','.join(self.allocation.hosts) or 'no node'}", file=sys.stderr, flush=True)
        if agent is None:
            return
        agent.link.close()
        for number in sorted(agent.trials):
            t = self._trials.get(number)
            if t is None:
                continue
            t.lost = t.lost or f"its node agent on {node} was lost ({why})"
            self._share_ended(agent, number, None)

    def _note(self, what: str) -> None:
        """Record when the agents reached a stage of their start (``agents/agents.json``, wall clock)."""
        self._record[what] = time.time()
        with contextlib.suppress(OSError):
            write_json_atomic(self.dir / "agents.json", self._record)

    def _send(self, node: str, msg: dict[str, Any]) -> None:
        agent = self.agents.get(node)
        if agent is not None and not agent.link.send(msg):
            self._agent_lost(node, "its connection closed: the agent died or was killed")

    def _to_shares(self, t: _Trial, msg: dict[str, Any]) -> None:
        for node in t.nodes:
            if node not in t.ended:
                self._send(node, msg)

    def _cancel_shares(self, t: _Trial, node: str) -> None:
        self._cancel_at.pop(t.request.number, None)
        self._to_shares(t, {"kind": "cancel", "number": t.request.number,
                            "reason": f"the trial's ranks on {node} ended ({t.lost or 'failed'})"})

    def _cancel_due(self) -> None:
        now = time.monotonic()
        for number, at in list(self._cancel_at.items()):
            t = self._trials.get(number)
            if t is None:  # every node's share ended meanwhile
                del self._cancel_at[number]
            elif now >= at:
                self._cancel_shares(t, t.failed_first or t.nodes[0])

    # -- trials -----------------------------------------------------------------------------------------
    def _dispatch(self) -> None:
        """Start waiting trials, in order, on agents with room (one per node of the trial)."""
        for t in [t for t in self._trials.values() if not t.started and t.cancel_reason is None]:
            req = t.request
            ppn = processes_per_node(req)
            k = shares_per_gpu(req.gpus_per_process)
            cpus, gpus = ppn * self.allocation.rank_cpus(req), ppn * (Fraction(1, k) if k else
                                                                       Fraction(int(req.gpus_per_process)))
            room = sorted((a for a in self.agents.values()
                           if a.cpus - a.used_cpus >= cpus and a.gpus - a.used_gpus >= gpus
                           and (not k or ppn <= a.gpus)),
                          key=lambda a: (a.used_cpus, self.allocation.hosts.index(a.node)))
            if len(room) < req.nodes:
                return
            chosen = room[:req.nodes]
            t.nodes, t.cpus, t.gpus = [a.node for a in chosen], cpus, gpus
            for i, agent in enumerate(chosen):
                agent.used_cpus += cpus
                agent.used_gpus += gpus
                agent.trials.add(req.number)
                share = None if req.nodes == 1 else {
                    "first_rank": i * ppn, "ranks": ppn, "world": req.processes,
                    "announce": str(t.files.dir / "rendezvous.addr")}
                self._send(agent.node, {"kind": "start", "request": req.to_json(), "share": share,
                                        "memory_mb": self.allocation.rank_memory_mb(req)})

    def _share_ended(self, agent: _Agent, number: int, result: TrialResult | None) -> None:
        t = self._trials.get(number)
        if t is None or agent.node not in t.nodes or agent.node in t.ended:
            return
        t.ended[agent.node] = result
        agent.trials.discard(number)
        agent.used_cpus -= t.cpus
        agent.used_gpus -= t.gpus
        failed = result is None or result.status == "failed"
        if failed and t.failed_first is None and result is not None:
            t.failed_first = agent.node
        if failed and len(t.ended) < len(t.nodes):  # the other nodes' ranks would wait in a collective
            echo = result is not None and RANK_DIED not in (result.error or "") and t.lost is None
            if echo:
                # a failure that may be the echo of a peer's death on another node (its collective broke):
                # that node's word, which names the death, gets PEER_WAIT_S to come first
                self._cancel_at.setdefault(number, time.monotonic() + PEER_WAIT_S)
            elif not echo:
                self._cancel_shares(t, agent.node)
        if len(t.ended) == len(t.nodes):
            del self._trials[number]
            self._events.append(_merged_result(t))

