"""The agents' driver's parts that are plain functions and records (``hpoflow.engines.slurm.agents``): the
state it keeps of each agent and trial, how a trial's result is merged from its nodes' shares, the
heartbeat interval for a fleet's size, the open-files limit, the listener's address."""

from __future__ import annotations

import os
import re
import resource
import socket
import subprocess
import time
from dataclasses import dataclass, field, replace
from fractions import Fraction

from hpoflow.engines.agent.protocol import Link
from hpoflow.engines.base import TrialRequest, TrialResult
from hpoflow.engines.cluster.layout import route_address
from hpoflow.errors import EngineError
from hpoflow.train.transport import TrialFiles
from hpoflow.trial import RANK_DIED

__all__ = ["HEARTBEATS_PER_S", "Agent", "FleetError", "Trial", "heartbeat_interval", "listen_host", "merged_result",
           "raise_open_files"]

HEARTBEATS_PER_S = 250.0  # the fleet's heartbeats reach the driver at about this rate (1 s apart up to 250 nodes)


@dataclass
class Agent:
    node: str
    link: Link
    cpus: int  # what the driver plans with: the allocation's CPUs on the node (at most the agent's slots)
    gpus: int
    last_seen: float
    index: int  # in the job's node order
    trials: set[int] = field(default_factory=set)
    used_cpus: int = 0
    used_gpus: Fraction = Fraction(0)  # GPUs, or shares of GPUs (resources.gpus_per_process: 1/k)
    warm_s: float | None = None
    held_until: float = 0.0  # no trial is placed here before (monotonic): its node failed a start (``hold``)
    start_faults: int = 0  # its node's start failures in a row (the hold doubles with each)
    version: int = 0  # bumped at every change of its load: the placement heap's entries of older ones are stale


@dataclass
class Trial:
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


class FleetError(EngineError):
    """The node agents cannot run the study: their step ended with none up, none came within
    ``agent_start_timeout_s``, or every one was lost with the step ended. The study stops (exit 1) before
    it spends a trial on a fleet that is not there."""

    exit_code = 1


def heartbeat_interval(nodes: int, agent_timeout_s: float) -> float:
    """Seconds between an agent's heartbeats (and the driver's pings) in a fleet of ``nodes``: 1 s up to
    ``HEARTBEATS_PER_S`` nodes, then longer so the driver reads that many a second, and never more than
    a quarter of ``agent_timeout_s`` (a node is lost only after several silent beats)."""
    return max(0.05, min(max(1.0, nodes / HEARTBEATS_PER_S), agent_timeout_s / 4))


def raise_open_files(need: int, nodes: int) -> int:
    """Raise this process's open-files limit to its hard limit (a fleet holds a connection per node, and
    soft limits of 1,024 are common); the new soft limit. ``EngineError`` when the hard limit is below
    ``need``."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        raise EngineError(
            f"the driver holds a connection to each of {nodes} node agents and needs {need} open files, but its "
            f"hard limit is {hard} (ulimit -Hn). Fix: raise the hard limit of open files on the batch node "
            "(limits.conf, or the site's SLURM PropagateResourceLimits), or run on fewer nodes")
    want = hard if hard != resource.RLIM_INFINITY else max(soft, need)
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (OSError, ValueError) as exc:
            if soft < need:
                raise EngineError(f"the driver needs {need} open files for {nodes} node agents, but cannot raise "
                                  f"its limit from {soft} to {want}: {exc}. Fix: ulimit -n {need} before "
                                  "hpoflow run") from exc
            return int(soft)
        return int(want)
    return int(soft)


HOLD_S = (2.0, 60.0)  # an agent's hold after its node's first start failure in a row, and the longest


def hold(agent: Agent, now: float) -> None:
    """Keep ``agent`` out of placement after its node failed to start a trial (a fault of the node, such
    as a full ``/dev/shm``): otherwise, its slots free again at once, it is the least loaded agent and
    takes the retry and every waiting trial, each failing in milliseconds. 2 s, doubling with each failure
    in a row, 60 s at most; a trial that completes there ends the row."""
    agent.start_faults += 1
    agent.held_until = now + min(HOLD_S[1], HOLD_S[0] * 2 ** (agent.start_faults - 1))


def listen_host(hosts: tuple[str, ...]) -> str:
    """The address the agents are told and the listener binds: this node's on the route to the job's
    other nodes (by name, else by SLURM's ``NodeAddr``: ``route_address``), 127.0.0.1 where the job is
    this node alone, "" (every address; the agents then use ``SLURM_LAUNCH_NODE_IPADDR``) where no route
    is known."""
    here = {socket.gethostname().split(".")[0], os.environ.get("SLURMD_NODENAME", "")}
    others = [h for h in hosts if h.split(".")[0] not in here]
    if not others:
        return "127.0.0.1"
    for host in others[:2]:
        for target in (host, _node_address(host)):  # (a name DNS does not know: SLURM's NodeAddr)
            addr = str(route_address(target))
            if addr.count(".") == 3 and addr.replace(".", "").isdigit() and not addr.startswith("127."):
                return addr
    return ""


def _node_address(host: str) -> str:
    """``host``'s ``NodeAddr`` as SLURM's controller knows it; ``host`` where it says none."""
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", host], capture_output=True, text=True,
                             timeout=10, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return host
    found = re.search(r"\bNodeAddr=(\S+)", out)
    return found.group(1) if found else host


def merged_result(t: Trial) -> TrialResult:
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
