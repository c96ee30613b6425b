"""Placing trials on the agents (``hpoflow.engines.slurm.agents``): ``Placement``, the part of ``AgentFleet``
that keeps the agents in a heap by load (used CPUs, then node order; an agent's older entries are stale) and
starts waiting trials, in order, on the least loaded agents with room: one per node of the trial, each with
its share of the ranks, a trial of several nodes on warm agents only."""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable
from fractions import Fraction

from hpoflow.engines.cluster.layout import processes_per_node
from hpoflow.engines.slurm._fleet import Agent
from hpoflow.engines.slurm._fleet_state import FleetState
from hpoflow.spec import shares_per_gpu

__all__ = ["Placement"]


class Placement(FleetState):
    """The placement heap and the dispatch of waiting trials; a part of ``AgentFleet``."""

    def _placeable(self, agent: Agent) -> None:
        """(Re)enter ``agent`` in the placement heap at its load."""
        agent.version += 1
        heapq.heappush(self._heap, (agent.used_cpus, agent.index, agent.version, agent.node))
        self._dirty = True
        if len(self._heap) > 4 * len(self.agents) + 64:  # drop the stale entries
            self._heap = [(a.used_cpus, a.index, a.version, a.node) for a in self.agents.values()]
            heapq.heapify(self._heap)

    def _pick(self, n: int, fits: Callable[[Agent], bool]) -> list[Agent] | None:
        """The ``n`` least loaded agents (in node order among equals) that ``fits``, or None."""
        seen: list[tuple[int, int, int, str]] = []
        chosen: list[Agent] = []
        while self._heap and len(chosen) < n:
            entry = heapq.heappop(self._heap)
            agent = self.agents.get(entry[3])
            if agent is None or agent.version != entry[2]:
                continue  # stale
            if fits(agent):
                chosen.append(agent)
            else:
                seen.append(entry)
        if len(chosen) < n:
            seen += [(a.used_cpus, a.index, a.version, a.node) for a in chosen]
            chosen = []
        for entry in seen:
            heapq.heappush(self._heap, entry)
        return chosen or None

    def _dispatch(self) -> None:
        """Start waiting trials, in order, on agents with room (one per node of the trial; a trial of
        several nodes on warm agents only)."""
        self._dirty = False
        now = time.monotonic()
        for t in list(self._waiting.values()):
            req = t.request
            ppn = processes_per_node(req)
            k = shares_per_gpu(req.gpus_per_process)
            cpus, gpus = ppn * self.allocation.rank_cpus(req), ppn * (Fraction(1, k) if k else
                                                                       Fraction(int(req.gpus_per_process)))
            gang = req.nodes > 1

            def fits(a: Agent, cpus: int = cpus, gpus: Fraction = gpus, k: int = k, ppn: int = ppn, now: float = now,
                     gang: bool = gang) -> bool:
                return (a.cpus - a.used_cpus >= cpus and a.gpus - a.used_gpus >= gpus and (not k or ppn <= a.gpus)
                        and (not gang or a.warm_s is not None) and a.held_until <= now)

            chosen = self._pick(req.nodes, fits)
            if chosen is None:
                return
            del self._waiting[req.number]
            t.nodes, t.cpus, t.gpus = [a.node for a in chosen], cpus, gpus
            for i, agent in enumerate(chosen):
                agent.used_cpus += cpus
                agent.used_gpus += gpus
                agent.trials.add(req.number)
                self._placeable(agent)
                share = None if req.nodes == 1 else {
                    "first_rank": i * ppn, "ranks": ppn, "world": req.processes,
                    "announce": str(t.files.dir / "rendezvous.addr")}
                self._send(agent.node, {"kind": "start", "request": req.to_json(), "share": share,
                                        "memory_mb": self.allocation.rank_memory_mb(req)})
            self._dirty = False
