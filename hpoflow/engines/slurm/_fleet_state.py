"""The state of the agents' driver (``hpoflow.engines.slurm.agents``) that its parts share: ``FleetState``
names what ``AgentFleet.__init__`` sets and the methods one part calls in another, so that each part
(``_links``: admitting agents and reading their frames; ``_losses``: lost agents and their relaunch;
``_placement``: placing trials on agents) is a base class of ``AgentFleet`` that the type checker reads
alone."""

from __future__ import annotations

import selectors
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.engines.agent.listener import Listener
from hpoflow.engines.base import Event, TrialResult
from hpoflow.engines.slurm._fleet import Agent, Trial
from hpoflow.engines.slurm.allocation import Allocation
from hpoflow.engines.slurm.options import SlurmOptions

__all__ = ["FleetState"]


class FleetState:
    """What the parts of ``AgentFleet`` read and write; no behaviour of its own."""

    allocation: Allocation  # the nodes trials run on: the job's, less the lost ones
    _job: Allocation  # every node of the job: a lost node comes back into ``allocation`` from it
    _index: dict[str, int]  # node -> its place in the job's node order
    options: SlurmOptions
    dir: Path
    _listener: Listener
    _sel: selectors.BaseSelector
    agents: dict[str, Agent]
    _lost: dict[str, str]  # node -> why its agent was lost
    _lost_at: dict[str, float]
    _relaunched: dict[str, list[subprocess.Popen[bytes]]]
    _trials: dict[int, Trial]
    _waiting: dict[int, Trial]  # submitted, not placed yet, in order
    _heap: list[tuple[int, int, int, str]]  # (used CPUs, node index, version, node)
    _dirty: bool  # something changed that may let a waiting trial start
    _held: set[str]  # nodes whose agent is held out of placement (``_fleet.hold``)
    _events: list[Event]
    _closed: bool
    _empty_since: float | None
    _warm: int
    heartbeats: int
    started_at: float
    warm_at: float | None
    proc: subprocess.Popen[bytes]  # the agents' step

    if TYPE_CHECKING:  # (defined by AgentFleet or one of its parts)
        def _srun(self, hosts: list[str], cpus: int, overlap: bool) -> subprocess.Popen[bytes]: ...

        def _note(self, what: str) -> None: ...

        def _send(self, node: str, msg: dict[str, Any]) -> None: ...

        def _placeable(self, agent: Agent) -> None: ...

        def _agent_lost(self, node: str, why: str) -> None: ...

        def _share_ended(self, agent: Agent, number: int, result: TrialResult | None) -> None: ...
