"""The SLURM allocation the driver runs in, read from the environment SLURM gives a batch script.

``SLURM_JOB_NODELIST`` (the nodes), ``SLURM_JOB_CPUS_PER_NODE`` (``36(x2),72``: CPUs per node, in
node order, run-length coded), and the GPUs per node: ``SLURM_GPUS_PER_NODE`` (``4`` or ``a100:4``,
set by ``--gpus-per-node``), else ``SLURM_GPUS_ON_NODE`` (the batch node's, taken for every node).
Pure functions of a mapping, so they are tested without SLURM.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from hpoflow.engines.cluster.hostlist import HostlistError, expand
from hpoflow.errors import EngineError
from hpoflow.trial import TrialRequest

__all__ = ["Allocation", "cpus_per_node", "job_nodes"]

_RUN = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def cpus_per_node(text: str) -> list[int]:
    """``"36(x2),72"`` -> ``[36, 36, 72]``; ``ValueError`` for anything SLURM would not write."""
    out: list[int] = []
    for part in (text or "").split(","):
        m = _RUN.match(part.strip())
        if not m:
            raise ValueError(f"SLURM_JOB_CPUS_PER_NODE={text!r} is not SLURM's 'N(xK),M' form")
        out.extend([int(m.group(1))] * int(m.group(2) or 1))
    return out


def job_nodes(scontrol_line: str) -> list[str] | None:
    """The nodes of ``scontrol show job -o ID``'s one line (``NodeList=n[1-3]``), or None where it names
    none (SLURM no longer knows the job, or it does not run)."""
    fields = dict(word.split("=", 1) for word in scontrol_line.split() if "=" in word)
    raw = fields.get("NodeList", "")
    if not raw or raw == "(null)":
        return None
    try:
        return expand(raw)
    except HostlistError:
        return None


def _gpus(environ: Mapping[str, str]) -> int:
    for name in ("SLURM_GPUS_PER_NODE", "SLURM_GPUS_ON_NODE"):
        raw = environ.get(name, "").strip()
        if raw:
            last = raw.split(",")[0].rsplit(":", 1)[-1]
            if last.isascii() and last.isdigit():
                return int(last)
    return 0


@dataclass(frozen=True)
class Allocation:
    """The nodes of the driver's job and what each offers trials."""

    job_id: str
    hosts: tuple[str, ...]
    cpus: tuple[int, ...]  # per host, in host order
    gpus_per_node: int

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Allocation:
        """The allocation this process runs in; ``EngineError`` outside one (or with unreadable variables)."""
        job = environ.get("SLURM_JOB_ID", "")
        if not job:
            raise EngineError("the slurm engine's steps mode runs inside a SLURM allocation, but SLURM_JOB_ID is not "
                              "set. Fix: submit the driver with `hpoflow launch SPEC --engine slurm` (or sbatch / "
                              "salloc), or use engine_options: {mode: jobs} to submit each trial as its own job")
        try:
            hosts = tuple(expand(environ.get("SLURM_JOB_NODELIST", "")))
            cpus = tuple(cpus_per_node(environ.get("SLURM_JOB_CPUS_PER_NODE", "")))
        except (HostlistError, ValueError) as exc:
            raise EngineError(f"cannot read the SLURM allocation: {exc}") from None
        if not hosts or len(cpus) != len(hosts):
            raise EngineError(f"cannot read the SLURM allocation: {len(hosts)} node(s) in SLURM_JOB_NODELIST but "
                              f"{len(cpus)} in SLURM_JOB_CPUS_PER_NODE")
        return cls(job, hosts, cpus, _gpus(environ))

    def keeping(self, hosts: Iterable[str]) -> Allocation:
        """This allocation reduced to ``hosts``: what SLURM still gives the job after a node failed (with
        ``--no-kill`` the job goes on without it)."""
        keep = set(hosts)
        pairs = [(h, c) for h, c in zip(self.hosts, self.cpus, strict=True) if h in keep]
        return Allocation(self.job_id, tuple(h for h, _ in pairs), tuple(c for _, c in pairs), self.gpus_per_node)

    def capacity(self, request: TrialRequest) -> int:
        """How many trials shaped like ``request`` fit the allocation at once (each node holds
        ``processes / nodes`` ranks of a trial)."""
        if request.nodes < 1 or request.processes % request.nodes:
            return 0
        ppn = request.processes // request.nodes
        per_node = []
        for cpus in self.cpus:
            by_cpu = cpus // (ppn * request.cpus_per_process)
            by_gpu = self.gpus_per_node // (ppn * request.gpus_per_process) if request.gpus_per_process else by_cpu
            per_node.append(min(by_cpu, by_gpu))
        # k trials, each one share on each of `nodes` distinct nodes, fit when every node gives at most k
        # of its shares and that adds up to nodes x k
        k = 0
        while sum(min(s, k + 1) for s in per_node) >= request.nodes * (k + 1):
            k += 1
        return k

    def check_fit(self, request: TrialRequest) -> None:
        """``EngineError`` with the numbers when a trial of this shape can never run here."""
        if self.capacity(request) >= 1:
            return
        ppn = max(1, request.processes // max(1, request.nodes))
        raise EngineError(
            f"a trial needs {request.nodes} node(s) with {ppn} x {request.cpus_per_process} CPUs and {ppn} x "
            f"{request.gpus_per_process} GPUs each, but the allocation (job {self.job_id}) has {len(self.hosts)} "
            f"node(s) with {list(self.cpus)} CPUs and {self.gpus_per_node} GPU(s) per node. Fix: submit the driver "
            "with more nodes (hpoflow launch SPEC --engine slurm --nodes N --cpus-per-node C), or lower resources")
