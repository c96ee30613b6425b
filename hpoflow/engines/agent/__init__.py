"""Node agents: the local engine's warm pool on every node of a SLURM allocation.

``agent``: the process that runs on each node (a ``LocalEngine`` driven over TCP); ``fleet``: the
driver's end, which starts the agents' step, admits agents that prove the run's secret, places trials
on their slots (several agents for a multi-node trial) and turns their messages into engine events;
``protocol``: the framed, authenticated connection between them.
"""

from __future__ import annotations

__all__: list[str] = []
