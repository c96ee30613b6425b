"""What the local engine keeps of its slots and trials: the placement of a trial's ranks on free cores
and GPUs (whole GPUs, or shares ``1/k`` of one: ``resources.gpus_per_process``), their release, and the
record of a running trial."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

from hpoflow.engines.base import Placement, TrialRequest
from hpoflow.engines.elastic import Segments
from hpoflow.engines.gpushare import is_mig
from hpoflow.engines.local._pool import Worker
from hpoflow.engines.logcap import LogStream
from hpoflow.engines.machine import GpuId
from hpoflow.spec import shares_per_gpu
from hpoflow.trial import RankOutcome

__all__ = ["GpuFree", "RankShare", "RunningTrial", "all_free", "give_back", "plan_placement", "take"]


GpuFree = dict[GpuId, Fraction]
"""How much of each GPU is free (1: whole, 0: taken), in the engine's order of its GPUs."""


def all_free(gpus: Sequence[GpuId]) -> GpuFree:
    """Every GPU of ``gpus`` free (an id listed twice: two GPUs' worth of slots)."""
    return {g: Fraction(n) for g, n in Counter(gpus).items()}


def plan_placement(request: TrialRequest, free_cores: list[int], free_gpus: Sequence[GpuId] | GpuFree
                   ) -> list[Placement] | None:
    """Cores and GPUs for each rank of ``request`` from the free ones, or ``None`` if they don't fit.

    Whole GPUs: each rank its ``gpus_per_process`` GPUs of those wholly free, in order. A share ``1/k``:
    each rank a share of a different GPU (ranks of one trial never share one), the GPUs with the least
    free first (shares are packed, so whole GPUs stay free for whole-GPU trials); MIG instances are
    never shared."""
    free = free_gpus if isinstance(free_gpus, dict) else all_free(free_gpus)
    need_c = request.processes * request.cpus_per_process
    if need_c > len(free_cores):
        return None
    k = shares_per_gpu(request.gpus_per_process)
    cores = [tuple(free_cores[r * request.cpus_per_process : (r + 1) * request.cpus_per_process])
             for r in range(request.processes)]
    if k:
        share = Fraction(1, k)
        order = list(free)
        fits = sorted((g for g, f in free.items() if f >= share and not is_mig(g)),
                      key=lambda g: (free[g], order.index(g)))
        if len(fits) < request.processes:
            return None
        return [Placement(r, cores[r], (fits[r],), share) for r in range(request.processes)]
    per = int(request.gpus_per_process)
    whole = [g for g, f in free.items() for _ in range(int(f))]
    if request.processes * per > len(whole):
        return None
    return [Placement(r, cores[r], tuple(whole[r * per : (r + 1) * per])) for r in range(request.processes)]


def take(free_gpus: GpuFree, placement: list[Placement]) -> None:
    """Mark the GPUs (or shares of GPUs) of ``placement`` taken."""
    for p in placement:
        for g in p.gpus:
            free_gpus[g] -= p.share if p.share is not None else 1


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


def give_back(free_cores: list[int], free_gpus: GpuFree, placement: list[Placement], cores: Sequence[int],
              gpus: Sequence[GpuId]) -> tuple[list[int], GpuFree]:
    """The free cores and GPUs once ``placement`` is released, of an engine that has ``cores`` and ``gpus``."""
    free_c = Counter(free_cores)
    free_g = dict(free_gpus)
    have = all_free(gpus)
    for p in placement:
        free_c.update(p.cores)
        for g in p.gpus:
            # never more of a GPU than the engine has: releasing twice frees nothing twice
            free_g[g] = min(have.get(g, Fraction(0)), free_g.get(g, Fraction(0)) + (p.share or 1))
    # never more of one id than the engine has: a core listed twice in ``cores`` is two slots (a
    # bench oversubscribing the cores does that), and releasing twice frees nothing twice
    free_c &= Counter(cores)
    return sorted(free_c.elements()), free_g
