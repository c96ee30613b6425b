"""Where the ranks of a compss trial run: bindings, rank layout, node order, launcher command lines.

Pure functions of the environment COMPSs gives a task (``COMPSS_BINDED_CPUS``/``GPUS``,
``COMPSS_HOSTNAMES``, ``SLURM_*``) so they are tested without the runtime. Nothing here imports
pycompss or torch. Commands are argv lists; the one place a remote shell is unavoidable (ssh
joins its arguments into a command line) quotes every element with ``shlex.quote``.
"""

from __future__ import annotations

import math
import os
import shlex
import socket
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from hpoflow.engines.base import TrialRequest
from hpoflow.engines.machine import GpuId, parse_visible_devices
from hpoflow.registry import LAUNCHERS

__all__ = [
    "LaunchJob",
    "NodePlan",
    "RankSlot",
    "bound_cpus",
    "bound_gpus",
    "choose_ifname",
    "export_flags",
    "fabric_candidates",
    "gloo_ifname_from_nccl",
    "launcher_argv",
    "mpirun_argv",
    "nccl_ifnames",
    "node_index_from_env",
    "ordered_hosts",
    "parse_id_list",
    "processes_per_node",
    "rank_layout",
    "repeated_hosts",
    "resolve_node_index",
    "route_address",
    "split_for_ranks",
    "srun_argv",
    "ssh_argv",
    "step_rank_gpus",
]

T = TypeVar("T")

RANK_CLI = "hpoflow.engines.cluster.node"


def _digits(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` is true of "²", which ``int`` refuses."""
    return text.isascii() and text.isdigit()


def parse_id_list(text: str | None) -> list[int]:
    """``"0,1,4-6"`` -> ``[0, 1, 4, 5, 6]``; empty, ``None`` or unparsable parts give nothing."""
    out: list[int] = []
    for part in (text or "").replace(" ", "").split(","):
        if not part:
            continue
        lo, sep, hi = part.partition("-")
        if sep and _digits(lo) and _digits(hi):
            out.extend(range(int(lo), int(hi) + 1))
        elif _digits(part):
            out.append(int(part))
    return list(dict.fromkeys(out))


def bound_cpus(env: Mapping[str, str]) -> list[int] | None:
    """The cores COMPSs bound to this task (``COMPSS_BINDED_CPUS``), or ``None`` if it bound none."""
    cpus = parse_id_list(env.get("COMPSS_BINDED_CPUS"))
    return cpus or None


def bound_gpus(env: Mapping[str, str]) -> list[GpuId]:
    """The GPUs bound to this task: ``COMPSS_BINDED_GPUS``, else ``CUDA_VISIBLE_DEVICES`` (indices, or
    GPU and MIG UUIDs as SLURM sets them: ``hpoflow.engines.machine.parse_visible_devices``), else none."""
    if env.get("COMPSS_BINDED_GPUS", "").strip():
        return list(parse_id_list(env["COMPSS_BINDED_GPUS"]))
    if env.get("CUDA_VISIBLE_DEVICES", "").strip():
        return parse_visible_devices(env["CUDA_VISIBLE_DEVICES"])
    return []


def step_rank_gpus(visible: Sequence[GpuId], step_gpus: Sequence[int], local_rank: int, ranks_on_node: int,
                   per_rank: int) -> tuple[list[GpuId], list[str]]:
    """A SLURM step rank's own GPUs: ``(as CUDA names them, a name of each that no other GPU of the node
    shares)``.

    ``visible``: the task's ``CUDA_VISIBLE_DEVICES``; ``step_gpus``: ``SLURM_STEP_GPUS`` (the node's
    indices of the step's GPUs). Where SLURM bound the task's GPUs itself, ``visible`` holds just
    ``per_rank`` of them: they are the rank's. Where it did not (``--gres`` steps, ``--gpu-bind=none``, a
    site that binds nothing), ``visible`` holds all of the node's ranks' GPUs: local rank ``k`` takes
    the ``k``-th ``per_rank`` of them. The names: ``gpu<i>`` by the node's index where ``step_gpus``
    lists the same GPUs as ``visible`` (in order), else ``visible<id>``, unique only within the step
    (SLURM may number a task's devices from 0 within a device cgroup). ``ValueError`` (what it sees,
    what it expected) for any other count."""
    if len(visible) == per_rank:
        mine = list(visible)
    elif len(visible) == ranks_on_node * per_rank:
        mine = list(visible[local_rank * per_rank:(local_rank + 1) * per_rank])
    else:
        raise ValueError(f"local rank {local_rank} sees {len(visible)} GPU(s) (CUDA_VISIBLE_DEVICES="
                         f"{','.join(str(g) for g in visible) or 'unset'}), but the step gives this node's "
                         f"{ranks_on_node} rank(s) {per_rank} GPU(s) each")
    if len(step_gpus) == len(visible):
        names = [f"gpu{step_gpus[list(visible).index(g)]}" for g in mine]
    else:
        names = [f"visible{g}" for g in mine]
    return mine, names


def split_for_ranks(items: Sequence[T], n_ranks: int, per_rank: int) -> list[tuple[T, ...]]:
    """Give each of ``n_ranks`` its ``per_rank`` items in order; if there are too few, share them
    round-robin (never an empty share while any item exists)."""
    if per_rank <= 0 or not items:
        return [() for _ in range(n_ranks)]
    if len(items) >= n_ranks * per_rank:
        return [tuple(items[r * per_rank : (r + 1) * per_rank]) for r in range(n_ranks)]
    out = []
    for r in range(n_ranks):
        share = tuple(items[(r * per_rank + i) % len(items)] for i in range(per_rank))
        out.append(tuple(dict.fromkeys(share)))
    return out


def processes_per_node(request: TrialRequest) -> int:
    """Ranks on each node. ``ValueError`` (rule, values, fix) if processes do not split evenly."""
    if request.nodes < 1 or request.processes % request.nodes:
        raise ValueError(
            f"resources.processes must be a multiple of resources.nodes (each node runs the same "
            f"number of ranks), but got processes={request.processes}, nodes={request.nodes}. Fix: "
            f"set processes to {request.nodes * max(1, request.processes // max(1, request.nodes))} "
            "or change nodes"
        )
    return request.processes // request.nodes


@dataclass(frozen=True)
class RankSlot:
    rank: int
    node_index: int
    local_rank: int


def rank_layout(nodes: int, ppn: int) -> list[RankSlot]:
    """RANK = node_index * ppn + local_rank; node 0 holds rank 0 (and the rendezvous)."""
    return [RankSlot(n * ppn + lr, n, lr) for n in range(nodes) for lr in range(ppn)]


def repeated_hosts(env: Mapping[str, str]) -> list[str]:
    """Host names ``COMPSS_HOSTNAMES`` lists more than once (in order of first appearance; ``[]`` when every
    name is distinct or the variable is unset). COMPSs places the actions of a multi-node task one by one,
    so two of them can land on one worker; the task then sees that worker's name twice."""
    names = [h.strip() for h in env.get("COMPSS_HOSTNAMES", "").split(",") if h.strip()]
    return [h for h in dict.fromkeys(names) if names.count(h) > 1]


def ordered_hosts(env: Mapping[str, str], nodes: int) -> list[str]:
    """Hosts of a multi-node task, the executing node first (it holds rank 0 and the rendezvous).

    Under COMPSs, ``COMPSS_HOSTNAMES`` lists them with the executing node last; in a SLURM batch job
    (the slurm engine's jobs mode), ``SLURM_JOB_NODELIST`` lists them and ``SLURMD_NODENAME`` is this
    node. ``ValueError`` if neither is set or the list does not have ``nodes`` distinct, option-free names.
    """
    raw = [h.strip() for h in env.get("COMPSS_HOSTNAMES", "").split(",") if h.strip()]
    source = "COMPSS_HOSTNAMES"
    if not raw and env.get("SLURM_JOB_NODELIST"):
        from hpoflow.engines.cluster.hostlist import HostlistError, expand

        try:
            listed = expand(env["SLURM_JOB_NODELIST"])
        except HostlistError as exc:
            raise ValueError(str(exc)) from None
        me = env.get("SLURMD_NODENAME", "")
        raw = [*[h for h in listed if h != me], *([me] if me in listed else [])]  # this node last, as COMPSs
        source = "SLURM_JOB_NODELIST"
    if not raw:
        raise ValueError(
            "neither COMPSS_HOSTNAMES nor SLURM_JOB_NODELIST is set, so this is not a multi-node task. Fix: run "
            "multi-node trials under runcompss/enqueue_compss (hpoflow launch SPEC --engine compss --nodes N) or "
            "with the slurm engine"
        )
    hosts = list(dict.fromkeys(raw))
    if len(raw) == nodes and len(hosts) < nodes:
        raise ValueError(
            f"the trial needs resources.nodes={nodes} distinct nodes, but COMPSs placed several of its nodes on one "
            f"host: {source}={env.get(source)!r} names {', '.join(h for h in hosts if raw.count(h) > 1)} more than "
            "once. Fix: give compss.cpus_per_node (hpoflow launch --cpus-per-node), so each node of a multi-node "
            "trial asks for a whole worker (the compss task retries such a placement: docs/cluster.md)")
    if len(hosts) != nodes:
        raise ValueError(
            f"the trial needs resources.nodes={nodes} nodes but {source} names {len(hosts)}: "
            f"{source}={env.get(source)!r}"
        )
    for h in hosts:
        if h.startswith("-") or any(c.isspace() for c in h):
            raise ValueError(f"host name {h!r} in {source} is not a plain host name")
    return [hosts[-1], *hosts[:-1]]


def _names_of_this_node(env: Mapping[str, str]) -> list[str]:
    names = [env.get("HPOFLOW_NODE_NAME", ""), env.get("SLURMD_NODENAME", ""), socket.gethostname()]
    try:
        names.append(socket.getfqdn())
    except OSError:
        pass
    out = []
    for n in names:
        n = n.strip().lower()
        if n:
            out += [n, n.split(".")[0]]
    return list(dict.fromkeys(out))


def resolve_node_index(hosts: Sequence[str], env: Mapping[str, str]) -> int:
    """This node's index in ``hosts`` by name (``HPOFLOW_NODE_NAME``, ``SLURMD_NODENAME``, hostname);
    a host entry may carry a network suffix (``node12-ib0`` matches ``node12``)."""
    names = _names_of_this_node(env)
    matches = []
    for i, host in enumerate(hosts):
        h = host.lower()
        short = h.split(".")[0]
        if h in names or short in names or any(short.startswith(n + "-") for n in names):
            matches.append(i)
    if len(matches) != 1:
        raise ValueError(
            f"this node (names {names}) matches {len(matches)} of the trial's hosts {list(hosts)}, so "
            "its node index (and the ranks it must start) is unknown. Fix: set compss: {launcher: ssh} "
            "(indices passed explicitly), or export HPOFLOW_NODE_NAME to the name COMPSs uses for "
            "each node"
        )
    return matches[0]


def node_index_from_env(env: Mapping[str, str]) -> int | None:
    """The launcher's index from an MPI launcher's environment (one launcher per node)."""
    for name in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        v = env.get(name, "")
        if _digits(v):
            return int(v)
    return None


def export_flags(args: Sequence[str], needed: Iterable[str] = ("PYTHONPATH",)) -> list[str]:
    """``args`` (a user's srun flags) with the ``--export`` every srun of hpoflow carries.

    A job submitted with ``sbatch --export=NONE`` (a site's default, or a user's habit) has
    ``SLURM_EXPORT_ENV=NONE`` in its environment, which every ``srun`` inside reads as its own
    ``--export``: its tasks would get the ``SLURM_*`` variables only, without ``PYTHONPATH``, the
    agents' secret or the site's settings. So ``--export=ALL`` goes first, and the tasks get the
    environment the engine gave srun. Where ``args`` name an ``--export`` of their own, that one
    stands, with the ``needed`` names added: a list (``--export=A,B``) gets them appended; ``NONE``,
    which takes no names, becomes the list of them (SLURM still adds its ``SLURM_*``); ``ALL...``
    exports them already."""
    out = list(args)
    mine = [i for i, a in enumerate(out) if a.startswith("--export=")]
    if not mine:
        return ["--export=ALL", *out]
    i = mine[-1]  # srun takes the last one
    value = out[i].partition("=")[2]
    names = [n for n in value.split(",") if n]
    if names[:1] == ["ALL"]:
        return out
    wanted = [n for n in dict.fromkeys(needed) if n not in names]
    if names == ["NONE"]:
        names = []
        if not wanted:
            return out
    out[i] = "--export=" + ",".join([*names, *wanted])
    return out


def route_address(target: str, port: int = 9) -> str:
    """This host's IPv4 address on the route to ``target`` (where ``target`` reaches it back); the host
    name where there is no route."""
    try:
        infos = socket.getaddrinfo(target, port, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])  # UDP connect: picks a route, sends nothing
            return str(s.getsockname()[0])
    except (OSError, IndexError):
        return socket.gethostname()


def choose_ifname(master_addr: str, port: int = 9) -> str | None:
    """The local network interface whose address routes to ``master_addr`` (for gloo), or None."""
    try:
        import psutil

        infos = socket.getaddrinfo(master_addr, port, socket.AF_INET, socket.SOCK_DGRAM)
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(infos[0][4])  # UDP connect: picks a route, sends nothing
            local_ip = s.getsockname()[0]
        for name, addrs in psutil.net_if_addrs().items():
            if any(a.family == socket.AF_INET and a.address == local_ip for a in addrs):
                return str(name)
    except (OSError, IndexError, ImportError):
        return None
    return None


# interfaces that are never a cluster's fabric: containers, virtual machines, tunnels
_VIRTUAL = ("lo", "docker", "virbr", "veth", "br-", "cni", "flannel", "cali", "vxlan", "tun", "tap", "podman", "lxc")


def fabric_candidates(exclude: str | None = None) -> list[str]:
    """This host's interfaces that could carry a trial's collectives besides ``exclude``: up, with an
    IPv4 address that is neither loopback nor link-local, and not a container's or a VM's bridge."""
    try:
        import psutil

        stats = psutil.net_if_stats()
        addrs = psutil.net_if_addrs()
    except (ImportError, OSError):
        return []
    out = []
    for name, items in sorted(addrs.items()):
        if name == exclude or name.startswith(_VIRTUAL) or not (name in stats and stats[name].isup):
            continue
        if any(a.family == socket.AF_INET and not a.address.startswith(("127.", "169.254.")) for a in items):
            out.append(name)
    return out


def nccl_ifnames(value: str, interfaces: Sequence[str]) -> list[str]:
    """The interfaces among ``interfaces`` that ``NCCL_SOCKET_IFNAME=value`` selects, in their order, as
    NCCL reads the variable: a comma-separated list of name prefixes (``hsn`` selects ``hsn0`` and
    ``hsn1``), of exact names after ``=`` (``=hsn0``), or of prefixes (``^docker,lo``) or exact names
    (``^=eth1``) to leave out, every other interface but loopback selected."""
    text = value.strip()
    exclude = text.startswith("^")
    text = text.removeprefix("^")
    exact = text.startswith("=")
    items = [p.strip() for p in text.removeprefix("=").split(",") if p.strip()]

    def named(name: str) -> bool:
        return any(name == p if exact else name.startswith(p) for p in items)

    if exclude:
        return [n for n in interfaces if n != "lo" and not named(n)]
    return [n for n in interfaces if named(n)]


def _up_interfaces() -> list[str]:
    """This host's interfaces that are up and hold an IPv4 address, by name (loopback included)."""
    try:
        import psutil

        stats = psutil.net_if_stats()
        addrs = psutil.net_if_addrs()
    except (ImportError, OSError):
        return []
    return sorted(name for name, items in addrs.items()
                  if name in stats and stats[name].isup and any(a.family == socket.AF_INET for a in items))


def gloo_ifname_from_nccl(value: str, route: str | None = None,
                          interfaces: Sequence[str] | None = None) -> tuple[str | None, str]:
    """One exact interface name for gloo from a site's ``NCCL_SOCKET_IFNAME`` (gloo takes names, not
    NCCL's prefixes or exclusions: ``GLOO_SOCKET_IFNAME=hsn`` fails where the fabric is ``hsn0``), and
    why, for the rank log. ``interfaces``: this host's (default: up, with an IPv4 address); ``route``:
    the interface that routes to the launch node. Of several selected, the first by name that is
    neither ``route`` (at most sites the management network) nor a container's or a VM's bridge;
    ``(None, why)`` where none is selected."""
    up = _up_interfaces() if interfaces is None else sorted(interfaces)
    chosen = nccl_ifnames(value, up)
    if not chosen:
        return None, (f"NCCL_SOCKET_IFNAME={value} selects none of this host's interfaces "
                      f"({', '.join(up) or 'none found'})")
    if len(chosen) == 1:
        return chosen[0], f"the one interface NCCL_SOCKET_IFNAME={value} selects"
    pick = min(chosen, key=lambda n: (n == route, n.startswith(_VIRTUAL)))  # min keeps the name order
    besides = f"; {route} routes to the launch node" if route in chosen else ""
    return pick, f"the first of {', '.join(chosen)}, which NCCL_SOCKET_IFNAME={value} selects{besides}"


@dataclass(frozen=True)
class NodePlan:
    """How a multi-node task starts its node launchers: one argv per launcher process."""

    hosts: tuple[str, ...]  # executing node first
    master_addr: str
    master_port: int
    commands: tuple[tuple[str, ...], ...]


def _node_cli(python: str, job_path: str) -> list[str]:
    return [python, "-m", RANK_CLI, "node", "--job", job_path]


@dataclass(frozen=True)
class LaunchJob:
    """What a launcher needs to start one node launcher per host of a multi-node trial."""

    hosts: tuple[str, ...]  # executing node first
    cpus: int  # per node
    gpus: int  # per node
    python: str
    job_path: str
    args: tuple[str, ...] = ()  # the launcher's extra arguments (compss.<launcher>_args)
    pythonpath: str | None = None


def srun_argv(job: LaunchJob) -> list[list[str]]:
    """One srun step with one task per node, inside the allocation COMPSs rewrote ``SLURM_*`` for;
    each node launcher finds its index by its node name in ``--hosts``."""
    n, host_list = len(job.hosts), ",".join(job.hosts)
    argv = ["srun", f"--nodes={n}", f"--ntasks={n}", "--ntasks-per-node=1", f"--cpus-per-task={job.cpus}",
            "--kill-on-bad-exit=1", *export_flags(job.args)]
    if job.gpus:
        argv.append(f"--gres=gpu:{job.gpus}")
    return [[*argv, *_node_cli(job.python, job.job_path), "--hosts", host_list]]


def mpirun_argv(job: LaunchJob) -> list[list[str]]:
    """One process per node in ``hosts`` order; the node index is the MPI rank."""
    n, host_list = len(job.hosts), ",".join(job.hosts)
    argv = ["mpirun", "-np", str(n), "--host", host_list, "--map-by", "ppr:1:node", *job.args]
    return [[*argv, *_node_cli(job.python, job.job_path), "--hosts", host_list, "--index-from", "mpi"]]


def ssh_argv(job: LaunchJob) -> list[list[str]]:
    """One ssh per host with an explicit ``--node-index`` (the remote command is quoted element by
    element, since ssh hands it to a shell)."""
    host_list = ",".join(job.hosts)
    out = []
    for i, host in enumerate(job.hosts):
        remote = ["env"]
        if job.pythonpath:
            remote.append(f"PYTHONPATH={job.pythonpath}")
        remote += [*_node_cli(job.python, job.job_path), "--hosts", host_list, "--node-index", str(i)]
        out.append(["ssh", *job.args, host, *(shlex.quote(a) for a in remote)])
    return out


def launcher_argv(launcher: str, hosts: Sequence[str], ppn: int, request: TrialRequest, job_path: str,
                  *, python: str | None = None, srun_args: Sequence[str] = ("--overlap",),
                  mpirun_args: Sequence[str] = (), ssh_args: Sequence[str] = ("-o", "BatchMode=yes"),
                  pythonpath: str | None = None) -> list[list[str]]:
    """The commands that start one node launcher on each of ``hosts`` (executing node first), by
    the launcher registered as ``launcher`` in ``hpoflow.registry.LAUNCHERS``."""
    if launcher not in LAUNCHERS:
        raise ValueError(LAUNCHERS.unknown(launcher))
    args = {"srun": srun_args, "mpirun": mpirun_args, "ssh": ssh_args}.get(launcher, ())
    # (cluster engines give whole GPUs: slurm and compss refuse a share of one before a trial starts)
    job = LaunchJob(tuple(hosts), ppn * request.cpus_per_process, ppn * math.ceil(request.gpus_per_process),
                    python or sys.executable, job_path, tuple(args), pythonpath)
    argv: list[list[str]] = LAUNCHERS.get(launcher)(job)
    return argv


def default_pythonpath() -> str:
    """PYTHONPATH for remote launchers: this one plus the directory holding the hpoflow package."""
    pkg_parent = str(Path(__file__).resolve().parents[3])  # <parent>/hpoflow/engines/cluster/layout.py
    parts = [pkg_parent, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    return os.pathsep.join(dict.fromkeys(parts))
