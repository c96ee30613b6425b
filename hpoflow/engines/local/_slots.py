"""What the local engine keeps of its slots and trials: the placement of a trial's ranks on free cores
and GPUs, their release, and the record of a running trial."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from hpoflow.engines.base import Placement, TrialRequest
from hpoflow.engines.elastic import Segments
from hpoflow.engines.local._pool import Worker
from hpoflow.engines.logcap import LogStream
from hpoflow.engines.machine import GpuId
from hpoflow.trial import RankOutcome

__all__ = ["RankShare", "RunningTrial", "give_back", "plan_placement"]


def plan_placement(request: TrialRequest, free_cores: list[int], free_gpus: list[GpuId]
                   ) -> list[Placement] | None:
    """Cores and GPUs for each rank of ``request`` from the free ones, or ``None`` if they don't fit."""
    need_c = request.processes * request.cpus_per_process
    need_g = request.processes * request.gpus_per_process
    if need_c > len(free_cores) or need_g > len(free_gpus):
        return None
    out = []
    for r in range(request.processes):
        c0, g0 = r * request.cpus_per_process, r * request.gpus_per_process
        out.append(Placement(r, tuple(free_cores[c0 : c0 + request.cpus_per_process]),
                             tuple(free_gpus[g0 : g0 + request.gpus_per_process])))
    return out


@dataclass(frozen=True)
class RankShare:
    """This host's part of a trial whose ranks run on several hosts (a node agent's gang share): ranks
    ``first_rank`` to ``first_rank + ranks - 1`` of ``world``; the ranks meet at the TCP store the
    trial's rank 0 holds and announces in the file ``announce`` (``hpoflow.train.dist.announced_store``);
    ``env``: more environment for its ranks (the network gloo binds)."""

    first_rank: int
    ranks: int
    world: int
    announce: str
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class RunningTrial:
    """A trial the engine runs: its ranks' workers and placement, its deadline and what it reported."""

    request: TrialRequest
    placement: list[Placement]
    workers: list[Worker]
    submitted: float
    deadline: float | None
    submitted_wall: float = 0.0
    outcomes: dict[int, RankOutcome] = field(default_factory=dict)
    first_report: float | None = None
    first_report_wall: float | None = None
    cancel_reason: str | None = None
    failure: str | None = None
    retryable: bool = False
    store: str = ""  # the rendezvous file store of a multi-rank trial
    logs: list[LogStream] = field(default_factory=list)  # its ranks' output, on the way to their logs
    # Elastic trials run in segments, one per size (see ``_restart``), and their prune decision waits
    # for the next poll (the engine adds the size to the answer then).
    segments: Segments | None = None
    deferred: bool | None = None
    paused_at: float | None = None  # pause(): when the engine asked the ranks to stop at a step
    signalled_at: float = 0.0
    share: RankShare | None = None  # the ranks of a multi-host trial that run here (a node agent's)

    @property
    def done(self) -> bool:
        return len(self.outcomes) == len(self.workers)

    def usage(self) -> list[dict[str, float]]:
        """The ranks' system usage, in rank order."""
        return [o.usage for _, o in sorted(self.outcomes.items()) if o.usage]


def give_back(free_cores: list[int], free_gpus: list[GpuId], placement: list[Placement], cores: Sequence[int],
              gpus: Sequence[GpuId]) -> tuple[list[int], list[GpuId]]:
    """The free cores and GPUs once ``placement`` is released, of an engine that has ``cores`` and ``gpus``."""
    free_c, free_g = Counter(free_cores), Counter(free_gpus)
    for p in placement:
        free_c.update(p.cores)
        free_g.update(p.gpus)
    # never more of one id than the engine has: a core listed twice in ``cores`` is two slots (a
    # bench oversubscribing the cores does that), and releasing twice frees nothing twice
    free_c &= Counter(cores)
    free_g &= Counter(gpus)
    # the engine's own order: indices and UUIDs (GpuId) may mix in CUDA_VISIBLE_DEVICES and do not sort
    return sorted(free_c.elements()), [g for g in dict.fromkeys(gpus) for _ in range(free_g[g])]
