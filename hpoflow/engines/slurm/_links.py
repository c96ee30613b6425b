"""Admitting the agents and reading their frames (``hpoflow.engines.slurm.agents``): ``Links``, the part of
``AgentFleet`` that takes the agents the listener let in (one per node of the job; a lost node's agent is
re-admitted), reads a ready agent's messages (heartbeats, warm pools, reports, results) and drops an agent
whose connection closed or that sent a malformed message."""

from __future__ import annotations

import selectors
import sys
import time
from typing import Any

from hpoflow.engines.agent import messages
from hpoflow.engines.slurm._fleet import Agent, hold
from hpoflow.engines.slurm._fleet_state import FleetState

__all__ = ["Links"]


class Links(FleetState):
    """Admitting agents and reading their messages; a part of ``AgentFleet``."""

    def _admit_new(self) -> None:
        for link, hello in self._listener.take():
            node = str(hello.get("node", ""))
            why = ""
            if node not in self._index:
                why = f"which is not a node of job {self.allocation.job_id}"
            elif node in self.agents:
                why = "which has an agent already"
            cores, gpus = hello.get("cores"), hello.get("gpus")
            if not isinstance(cores, list) or not isinstance(gpus, list):
                why = why or "with a hello that lists no cores and GPUs"
                cores = gpus = []
            if why:
                print(f"hpoflow: an agent from {link.peer} named node {node[:80]!r}, {why}: closed", file=sys.stderr,
                      flush=True)
                link.close()
                continue
            back = self._lost.pop(node, None)
            self._lost_at.pop(node, None)
            if back is not None:
                self.allocation = self._job.keeping({*self.allocation.hosts, node})
                print(f"hpoflow: node agent on {node} is back (it was lost: {back}); trials run on it again",
                      file=sys.stderr, flush=True)
            i = self._index[node]
            agent = Agent(node, link, min(self._job.cpus[i], len(cores)), min(self._job.gpus_per_node, len(gpus)),
                           time.monotonic(), i)
            self.agents[node] = agent
            self._empty_since = None
            self._sel.register(link.sock, selectors.EVENT_READ, agent)
            self._placeable(agent)
            if len(self.agents) == len(self.allocation.hosts) and back is None:
                self._note("connected")
                print(f"hpoflow: {len(self.agents)} node agent(s) up {time.monotonic() - self.started_at:.1f} s after "
                      "their step started", file=sys.stderr, flush=True)
            self._read(agent)  # what came with its hello (the listener read it first)

    def _read(self, agent: Agent) -> None:
        if self.agents.get(agent.node) is not agent:
            return
        msgs = agent.link.read()
        if msgs:
            agent.last_seen = time.monotonic()
        for msg in msgs:
            try:
                self._on_message(agent, msg)
            except (messages.BadMessage, ValueError, TypeError) as exc:
                self._agent_lost(agent.node, f"it sent a malformed {str(msg.get('kind'))[:40]!r} message ({exc}): "
                                 "dropped")
                return
        if agent.link.closed:
            self._agent_lost(agent.node, f"it broke the protocol ({agent.link.error}): dropped" if agent.link.error
                             else "its connection closed: the agent died or was killed")

    def _on_message(self, agent: Agent, msg: dict[str, Any]) -> None:
        kind = msg.get("kind")
        if kind == "heartbeat":
            self.heartbeats += 1
        elif kind == "warm":
            if agent.warm_s is None:
                self._warm += 1
                self._dirty = True  # a trial of several nodes may wait for warm agents
            agent.warm_s = messages.number(msg.get("seconds") or 0.0, "seconds")
            if self.warm_at is None and self._warm >= len(self.allocation.hosts):
                self.warm_at = time.monotonic()
                self._note("warm")
                print(f"hpoflow: node agents warm (torch preloaded, workers forked) "
                      f"{self.warm_at - self.started_at:.1f} s after their step started", file=sys.stderr,
                      flush=True)
        elif kind == "report":
            report = messages.report(msg)
            t = self._trials.get(report.number)
            if t is None or not t.nodes or t.nodes[0] != agent.node:
                return
            t.pending_answer = t.pending_answer or report.wants_answer
            self._events.append(report)
        elif kind == "result":
            result = messages.result(msg)
            if msg.get("node_fault") is True:  # the node could not start it (a full /dev/shm): not the next trial
                hold(agent, time.monotonic())  # there at once, nor this one's retry
                self._held.add(agent.node)
            elif result.status in ("complete", "pruned"):
                agent.start_faults = 0
            self._share_ended(agent, result.number, result)

