"""Lost agents (``hpoflow.engines.slurm.agents``): ``Losses``, the part of ``AgentFleet`` that checks, at a
fixed rate, for silent agents, the end of the agents' step and agents that never came; drops a lost agent
(its node leaves the allocation, its trials fail as retryable); starts a new agent step on a lost node
while the agents' step runs (at most ``RELAUNCHES`` times, each ``RELAUNCH_AFTER_S`` after the loss); and
stops the study (``FleetError``) when the fleet never came up or is gone."""

from __future__ import annotations

import contextlib
import sys
import time

from hpoflow.engines.proc import tail
from hpoflow.engines.slurm._fleet import FleetError
from hpoflow.engines.slurm._fleet_state import FleetState

__all__ = ["RELAUNCHES", "RELAUNCH_AFTER_S", "Losses"]

RELAUNCHES = 2  # new agent steps started on a lost node, each RELAUNCH_AFTER_S after the loss
RELAUNCH_AFTER_S = 5.0


class Losses(FleetState):
    """Lost agents and their relaunch; a part of ``AgentFleet``."""

    def _check_lost(self, now: float) -> None:
        """The fixed-rate checks: silent agents, the step's end, agents that never came, relaunches."""
        limit = self.options.agent_timeout_s
        for agent in [a for a in self.agents.values() if now - a.last_seen > limit]:
            self._agent_lost(agent.node, f"no word from it for {now - agent.last_seen:.0f} s (agent_timeout_s)")
        ended = self.proc.poll() is not None
        start_limit = self.options.agent_start_timeout_s
        if ended and not self.agents and not self._relaunched:  # it never came up: one line says so
            self._fleet_failed(f"the node agents' step ended (srun exit {self.proc.returncode}) with no agent up")
        if ended or now - self.started_at > start_limit:
            for node in self.allocation.hosts:
                if node not in self.agents and node not in self._relaunched:
                    self._agent_lost(node, f"the agents' step ended (srun exit {self.proc.returncode})" if ended
                                     else f"its agent did not connect within {start_limit:g} s "
                                          "(agent_start_timeout_s)")
        self._relaunch(now, ended)
        if self.agents:
            return
        if self._empty_since is None:
            self._empty_since = now
        relaunching = any(p.poll() is None for ps in self._relaunched.values() for p in ps)
        if ended and not relaunching:
            self._fleet_failed(f"the node agents' step ended (srun exit {self.proc.returncode}) and no agent is up")
        if now - max(self._empty_since, self.started_at) > start_limit:
            self._fleet_failed(f"no node agent has been up for {start_limit:g} s (agent_start_timeout_s)")

    def _fleet_failed(self, why: str) -> None:
        log = tail(self.dir / "srun.log", 600).strip().replace("\n", " | ")
        outs = sorted(self.dir.glob("agent-*.out"))
        agent_log = tail(outs[0], 300).strip().replace("\n", " | ") if outs else ""
        raise FleetError(f"{why}: no trial can run, so the study stops before it spends one. The step's log "
                         f"({self.dir / 'srun.log'}) ends: {log or '(empty)'}"
                         + (f"; {outs[0].name} ends: {agent_log}" if agent_log else "")
                         + ". Fix: run `python -m hpoflow.engines.agent --help` with engine_options.python on a node")

    def _relaunch(self, now: float, ended: bool) -> None:
        """A new agent step on each node lost a while ago, while the agents' step runs (the node may be
        up and only its agent gone), at most ``RELAUNCHES`` times per node."""
        if ended or self._closed:
            return
        for node, at in list(self._lost_at.items()):
            runs = self._relaunched.setdefault(node, [])
            if any(p.poll() is None for p in runs) or len(runs) >= RELAUNCHES or now - at < RELAUNCH_AFTER_S:
                continue
            self._lost_at[node] = now
            print(f"hpoflow: starting a new node agent on {node} ({len(runs) + 1} of {RELAUNCHES})", file=sys.stderr,
                  flush=True)
            runs.append(self._srun([node], self._job.cpus[self._index[node]], True))

    def _agent_lost(self, node: str, why: str) -> None:
        agent = self.agents.pop(node, None)
        if agent is not None:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(agent.link.sock)
            agent.link.close()
            agent.version += 1
            if agent.warm_s is not None:
                self._warm -= 1
        if node in self._lost:
            return
        self._lost[node] = why
        self._lost_at[node] = time.monotonic()
        self.allocation = self.allocation.keeping(h for h in self.allocation.hosts if h != node)
        print(f"hpoflow: node agent on {node} lost ({why}); trials now run on "
              f"{len(self.allocation.hosts)} node(s)", file=sys.stderr, flush=True)
        if agent is None:
            return
        for number in sorted(agent.trials):
            t = self._trials.get(number)
            if t is None:
                continue
            t.lost = t.lost or f"its node agent on {node} was lost ({why})"
            self._share_ended(agent, number, None)

