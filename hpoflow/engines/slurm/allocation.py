"""The SLURM allocation the driver runs in, read from the environment SLURM gives a batch script.

``SLURM_JOB_NODELIST`` (the nodes), ``SLURM_JOB_CPUS_PER_NODE`` (``36(x2),72``: CPUs per node, in
node order, run-length coded), and the GPUs per node: ``SLURM_GPUS_PER_NODE`` (``4`` or ``a100:4``,
set by ``--gpus-per-node``), else ``SLURM_GPUS_ON_NODE`` (the batch node's, taken for every node),
and memory (``SLURM_MEM_PER_NODE``, ``SLURM_MEM_PER_CPU``). ``Allocation.refined`` adds what only the
controller tells: each node's GPUs and memory (``scontrol -d show job``: ``--gres=gpu:4`` sets no
variable), threads per core (``scontrol show node``) and whether SLURM hands out whole cores
(``scontrol show config``). Pure functions of text, so they are tested without SLURM.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from fractions import Fraction

from hpoflow.engines.cluster.hostlist import HostlistError, expand
from hpoflow.errors import EngineError
from hpoflow.spec import shares_per_gpu
from hpoflow.trial import TrialRequest

__all__ = ["Allocation", "JobDetail", "NodeHardware", "config_value", "cpus_per_node", "job_detail", "job_nodes",
           "node_hardware", "whole_cores"]

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


def _memory_mb(environ: Mapping[str, str], cpus: tuple[int, ...]) -> tuple[int, ...]:
    """Memory per node from ``SLURM_MEM_PER_NODE`` (MB, ``--mem``) or ``SLURM_MEM_PER_CPU`` times the
    node's CPUs (``--mem-per-cpu``); ``()`` where neither is set."""
    for name, per_cpu in (("SLURM_MEM_PER_NODE", False), ("SLURM_MEM_PER_CPU", True)):
        raw = environ.get(name, "").strip()
        if raw.isascii() and raw.isdigit() and int(raw) > 0:
            return tuple(int(raw) * c for c in cpus) if per_cpu else (int(raw),) * len(cpus)
    return ()


def _fields(text: str) -> dict[str, str]:
    return dict(word.split("=", 1) for word in text.split() if "=" in word)


def _gres_gpus(text: str) -> int | None:
    """The GPUs in a GRES or TRES list (``gpu:4(IDX:0-3)``, ``gpu:a100:2``, ``gres/gpu=4``); None if none."""
    total = None
    for part in re.split(r",(?![^(]*\))", text):
        m = re.fullmatch(r"(?:gres[:/])?gpu(?::[^:=(]+)?[:=](\d+)(?:\(.*\))?", part.strip())
        if m:
            total = (total or 0) + int(m.group(1))
    return total


@dataclass(frozen=True)
class JobDetail:
    """What ``scontrol -d show job -o ID`` says a job holds on each node: CPUs (``CPU_IDs``), memory in MB
    (``Mem``; 0 where SLURM does not account memory) and GPUs (``GRES=gpu:4(IDX:0-3)``; ``GRES=`` with no
    GPU in it: 0). ``gpus`` names only the nodes whose group has a ``GRES=`` field: a line without one
    (a SLURM that does not print it, a group cut short) says nothing of their GPUs, not that they have
    none."""

    cpus: dict[str, int]
    memory_mb: dict[str, int]
    gpus: dict[str, int]
    gpu_ids: dict[str, tuple[int, ...]]  # the node's indices of its GPUs (``IDX:0-3``)


def job_detail(scontrol_line: str) -> JobDetail | None:
    """``scontrol -d show job -o ID``'s one line read per node (its ``Nodes=... CPU_IDs=... Mem=...
    GRES=...`` groups, a group naming one node or a host list); None where it has no such group."""
    cpus: dict[str, int] = {}
    mem: dict[str, int] = {}
    gpus: dict[str, int] = {}
    gpu_ids: dict[str, tuple[int, ...]] = {}
    hosts: list[str] = []
    for word in scontrol_line.split():
        key, sep, value = word.partition("=")
        if not sep:
            continue
        if key == "Nodes":
            try:
                hosts = expand(value)
            except HostlistError:
                return None
            for h in hosts:
                cpus.setdefault(h, 0)
                mem.setdefault(h, 0)
        elif key == "CPU_IDs" and hosts:
            n = len(_id_list(value))
            for h in hosts:
                cpus[h] = n
        elif key == "Mem" and hosts and value.isascii() and value.isdigit():
            for h in hosts:
                mem[h] = int(value)
        elif key == "GRES" and hosts:
            ids = re.search(r"gpu[^(]*\(IDX:([\d,-]+)\)", value)
            for h in hosts:
                gpus[h] = _gres_gpus(value) or 0
                gpu_ids[h] = tuple(_id_list(ids.group(1))) if ids else ()
    return JobDetail(cpus, mem, gpus, gpu_ids) if cpus else None


def _id_list(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        if lo.isdigit() and (not sep or hi.isdigit()):
            out.extend(range(int(lo), int(hi) + 1) if sep else [int(lo)])
    return out


@dataclass(frozen=True)
class NodeHardware:
    """What ``scontrol show node -o`` declares of a node: threads per core and GPUs (``Gres``)."""

    threads_per_core: int
    gpus: int


def node_hardware(scontrol_lines: str) -> dict[str, NodeHardware]:
    """``scontrol show node -o NODES``: node name -> its ``ThreadsPerCore`` and GRES GPUs."""
    out = {}
    for line in scontrol_lines.splitlines():
        f = _fields(line)
        name, tpc = f.get("NodeName"), f.get("ThreadsPerCore", "1")
        if name:
            out[name] = NodeHardware(int(tpc) if tpc.isdigit() else 1, _gres_gpus(f.get("Gres", "")) or 0)
    return out


def whole_cores(select_type_parameters: str) -> bool:
    """Whether SLURM hands out whole cores (``CR_Core``, ``CR_Core_Memory``, ``CR_Socket*``), not single
    hardware threads (``CR_CPU*``), from ``scontrol show config``'s SelectTypeParameters."""
    words = select_type_parameters.upper()
    return "CR_CORE" in words or "CR_SOCKET" in words


def config_value(scontrol_config: str, key: str) -> str | None:
    """One value of ``scontrol show config`` (``MaxStepCount            = 40000``)."""
    for line in scontrol_config.splitlines():
        name, sep, value = line.partition("=")
        if sep and name.strip() == key:
            return value.strip()
    return None


@dataclass(frozen=True)
class Allocation:
    """The nodes of the driver's job and what each offers trials.

    ``cpus`` counts hardware threads, as SLURM does (``SLURM_JOB_CPUS_PER_NODE``). Where SLURM hands out
    whole cores (``whole_cores``) of nodes with ``threads_per_core`` > 1, a rank's
    ``cpus_per_process`` is rounded up to whole cores, and with ``one_thread_per_core``
    (``--hint=nomultithread``) each CPU a rank asks for is a whole core. ``memory_mb``: per node, ``()``
    where SLURM does not account memory; each rank then gets ``rank_memory_mb``."""

    job_id: str
    hosts: tuple[str, ...]
    cpus: tuple[int, ...]  # per host, in host order
    gpus_per_node: int
    memory_mb: tuple[int, ...] = ()  # per host; () where memory is not a consumable resource
    threads_per_core: int = 1
    whole_cores: bool = False
    one_thread_per_core: bool = False
    gpu_ids: tuple[tuple[int, ...], ...] = ()  # per host: the node's indices of the job's GPUs, where known
    max_step_count: int = 0  # scontrol show config's MaxStepCount: the steps a job may start (0: unknown)

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
        return cls(job, hosts, cpus, _gpus(environ), _memory_mb(environ, cpus))

    def refined(self, detail: JobDetail | None, hardware: Mapping[str, NodeHardware],
                whole_cores: bool) -> Allocation:
        """This allocation with what SLURM's controller knows and the environment does not tell: the
        GPUs and memory each node holds (``scontrol -d show job``: ``--gres=gpu:4`` sets no variable in
        the allocation's environment) and the nodes' threads per core (``scontrol show node``)."""
        memory, gpus, ids = self.memory_mb, self.gpus_per_node, self.gpu_ids
        if detail is not None and all(h in detail.cpus for h in self.hosts):
            if any(detail.memory_mb[h] for h in self.hosts):
                memory = tuple(detail.memory_mb[h] for h in self.hosts)
            if self.hosts and all(h in detail.gpus for h in self.hosts):  # else the environment's count stands
                gpus = min(detail.gpus[h] for h in self.hosts)
            ids = tuple(detail.gpu_ids.get(h, ()) for h in self.hosts)
        tpc = max((hardware[h].threads_per_core for h in self.hosts if h in hardware), default=self.threads_per_core)
        return replace(self, gpus_per_node=gpus, memory_mb=memory, threads_per_core=tpc, whole_cores=whole_cores,
                       gpu_ids=ids)

    def keeping(self, hosts: Iterable[str]) -> Allocation:
        """This allocation reduced to ``hosts``: what SLURM still gives the job after a node failed (with
        ``--no-kill`` the job goes on without it)."""
        keep = set(hosts)
        idx = [i for i, h in enumerate(self.hosts) if h in keep]
        return replace(self, hosts=tuple(self.hosts[i] for i in idx), cpus=tuple(self.cpus[i] for i in idx),
                       memory_mb=tuple(self.memory_mb[i] for i in idx) if self.memory_mb else (),
                       gpu_ids=tuple(self.gpu_ids[i] for i in idx) if self.gpu_ids else ())

    def rank_cpus(self, request: TrialRequest) -> int:
        """The CPUs (hardware threads) SLURM takes from a node for one rank of ``request``."""
        c, t = request.cpus_per_process, self.threads_per_core
        if t <= 1:
            return c
        if self.one_thread_per_core:
            return c * t
        return -(-c // t) * t if self.whole_cores else c

    def rank_memory_mb(self, request: TrialRequest) -> int:
        """The memory a step asks for each rank of ``request`` (``--mem`` is this times the ranks per
        node): ``resources.memory_gb``, else the rank's share of its node's memory: the larger of its
        share by CPUs and its share by GPUs (SLURM's ``DefMemPerGPU`` counts a job's memory by its GPUs
        too: a 1-GPU rank of a 128-CPU, 8-GPU node of 512 GB gets 64 GB, not the 4 GB of its one CPU),
        the smallest over the nodes, so a step fits any of them; 0 where memory is not accounted and
        not asked."""
        if request.memory_gb:
            return math.ceil(request.memory_gb * 1024)
        if not self.memory_mb or not any(self.cpus):
            return 0
        rank = self.rank_cpus(request)
        # the node's share a rank's GPUs are (a share 1/k of a GPU: 1/k of one GPU's), 0 without GPUs
        share = (Fraction(request.gpus_per_process).limit_denominator(1024) / self.gpus_per_node
                 if self.gpus_per_node else Fraction(0))
        return min(max(m * rank // c, math.floor(m * share)) for m, c in zip(self.memory_mb, self.cpus, strict=True)
                   if c)

    def capacity(self, request: TrialRequest) -> int:
        """How many trials shaped like ``request`` fit the allocation at once (each node holds
        ``processes / nodes`` ranks of a trial)."""
        if request.nodes < 1 or request.processes % request.nodes:
            return 0
        ppn = request.processes // request.nodes
        rank_cpus, rank_mb = self.rank_cpus(request), self.rank_memory_mb(request)
        per_node = []
        for i, cpus in enumerate(self.cpus):
            shares = [cpus // (ppn * rank_cpus)]
            k = shares_per_gpu(request.gpus_per_process)
            if k:  # a share 1/k of a GPU per rank (node agents): k ranks a GPU, a trial's ranks on distinct GPUs
                shares.append(self.gpus_per_node * k // ppn if ppn <= self.gpus_per_node else 0)
            elif request.gpus_per_process:
                shares.append(self.gpus_per_node // (ppn * int(request.gpus_per_process)))
            if self.memory_mb and rank_mb:
                shares.append(self.memory_mb[i] // (ppn * rank_mb))
            per_node.append(min(shares))
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
        cpus = self.rank_cpus(request)
        threads = (f" (a rank's {request.cpus_per_process} CPU(s) take {cpus}: SLURM gives whole cores of "
                   f"{self.threads_per_core} threads)" if cpus != request.cpus_per_process else "")
        mem = ""
        if self.memory_mb:
            mem = f", {ppn} x {self.rank_memory_mb(request)} MB memory"
        has_mem = f", {list(self.memory_mb)} MB memory" if self.memory_mb else ""
        raise EngineError(
            f"a trial needs {request.nodes} node(s) with {ppn} x {cpus} CPUs{threads}{mem} and {ppn} x "
            f"{request.gpus_per_process} GPUs each, but the allocation (job {self.job_id}) has {len(self.hosts)} "
            f"node(s) with {list(self.cpus)} CPUs{has_mem} and {self.gpus_per_node} GPU(s) per node. Fix: submit the "
            "driver with more nodes (hpoflow launch SPEC --engine slurm --nodes N --cpus-per-node C), or lower "
            "resources")
