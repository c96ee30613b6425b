"""Network namespaces joined by a Linux bridge on this host, for tests of multi-node software.

``NetnsCluster(n)`` makes a bridge on the host holding ``198.18.X.1/24`` and ``n`` namespaces, each
joined to the bridge by a veth pair (named ``eth0`` inside the namespace) holding ``198.18.X.2``,
``198.18.X.3``, ... with ``lo`` up. Addresses come only from 198.18.0.0/15 (RFC 2544 benchmarking
space, routed nowhere). The namespaces get no default route, so whatever runs in them reaches only the
bridge's subnet and their own loopback; the host reaches them through the bridge. ``X`` is picked from
the pid among the subnets 198.18.16.0/24 .. 198.18.255.0/24 that no address or route of the host
already uses (198.18.0.x and 198.18.1.x are left to the older tests that hard-code them).

With ``fabric=True`` each namespace gets a second interface, ``fab0``, on a second bridge and subnet
(198.18.Y.2, ...): a site's "fabric" beside its "management" network (``eth0``, whose addresses SLURM
and the launch node use). ``management_rate`` limits what each namespace sends on ``eth0`` with a
token bucket (``tc qdisc ... tbf``), as a site's 1 GbE management network is slower than its fabric.

Names derive from the pid and a per-process counter k (``hib<pid>x<k>`` for the bridge, ``hif<pid>x<k>``
for the fabric bridge, ``hin<pid>x<k>n<i>`` for namespaces, ``hiv<pid>x<k>n<i>`` and ``hiw<pid>x<k>n<i>``
for the host ends), at most 15 characters.
``destroy()`` undoes everything ``create()`` did, also after a partial creation, and may be called any
number of times; before deleting a namespace it kills every process still inside it. ``create()`` first
sweeps what a process that died without tearing down (SIGKILL) left: namespaces and links of this
naming scheme whose pid is no longer alive.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

NETNS_DIR = Path("/run/netns")
ALLOWED = ipaddress.ip_network("198.18.0.0/15")
STALE = re.compile(r"hi[bfnvw](\d+)x\d+(n\d+)?")  # our names; group 1: the pid of their creator
FIRST_SUBNET = 16  # 198.18.0.x and 198.18.1.x are hard-coded by tests/engines and tests/train
_counter = itertools.count()


class NetnsError(RuntimeError):
    """Network namespaces cannot be made here (not root, no iproute2, or the kernel refuses)."""


def ip(*args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (argv, no shell); with ``check`` a failure raises ``NetnsError`` with its stderr."""
    try:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        if check:
            raise NetnsError(f"ip {' '.join(args)}: {exc}") from exc
        return subprocess.CompletedProcess(["ip", *args], 1, "", str(exc))
    if check and proc.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")
    return proc


def unavailable_reason() -> str | None:
    """Why namespaces cannot be made here (not root, no ``ip``/``nsenter``), or None if they may be."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "nsenter"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    return None


def used_subnets() -> set[int]:
    """Third octets X of the 198.18.X.0/24 subnets that an address or a route of the host touches."""
    out: set[int] = set()
    text = ip("-4", "-o", "addr", "show", check=False).stdout + ip("-4", "route", "show", "table", "all",
                                                                   check=False).stdout
    for word in text.split():
        try:
            net = ipaddress.ip_network(word, strict=False)
        except ValueError:
            continue
        if not isinstance(net, ipaddress.IPv4Network) or not net.overlaps(ALLOWED):
            continue
        if net.prefixlen <= 16:  # covers all of 198.18.0.0/16 (or more): every X is taken
            return set(range(256))
        if net.network_address.packed[1] == 18:
            out.update(range(net.network_address.packed[2], net.broadcast_address.packed[2] + 1))
    return out


def pick_subnet(pid: int | None = None, avoid: set[int] | None = None) -> int:
    """A free third octet X for 198.18.X.0/24, starting from one derived from the pid."""
    pid = os.getpid() if pid is None else pid
    taken = used_subnets() | (avoid or set())
    span = 256 - FIRST_SUBNET
    for k in range(span):
        x = FIRST_SUBNET + (pid + k) % span
        if x not in taken:
            return x
    raise NetnsError("every 198.18.X.0/24 subnet is in use on this host")


@dataclass(frozen=True)
class Node:
    """One namespace: its name, its address on the bridge, and the host end of its veth pair."""

    name: str
    address: str
    host_veth: str
    fabric_address: str = ""  # on fab0 (a cluster made with fabric=True)
    fabric_host_veth: str = ""

    @property
    def path(self) -> Path:
        """The bind mount ``ip netns add`` made; ``nsenter --net=PATH`` enters the namespace."""
        return NETNS_DIR / self.name


class NetnsCluster:
    """A bridge on the host and ``n`` namespaces attached to it (see the module docstring)."""

    IFNAME = "eth0"  # the namespace end of each veth pair
    FABRIC_IFNAME = "fab0"  # the namespace end of each fabric veth pair

    def __init__(self, n: int, *, subnet: int | None = None, fabric: bool = False,
                 management_rate: str | None = None) -> None:
        if not 1 <= n <= 10:
            raise ValueError(f"between 1 and 10 namespaces, not {n}")
        self.tag = f"{os.getpid()}x{next(_counter)}"
        if len(f"hin{self.tag}n{n - 1}") > 15:
            raise ValueError(f"tag {self.tag!r} makes interface names longer than 15 characters")
        self._picked = subnet is None  # picked here (and so picked again if another process took it)
        self.bridge = f"hib{self.tag}"
        self.fabric_bridge = f"hif{self.tag}" if fabric else ""
        self.management_rate = management_rate
        self.prefix = 24
        self._n = n
        self.fabric_subnet = -1
        self._renumber(subnet if subnet is not None else pick_subnet())
        self._created: list[tuple[str, str]] = []  # ("netns"|"link", name), in creation order

    def _renumber(self, subnet: int, fabric_subnet: int = -1) -> None:
        self.subnet = subnet
        self.fabric_subnet = fabric_subnet
        self.bridge_address = f"198.18.{subnet}.1"
        self.fabric_bridge_address = f"198.18.{fabric_subnet}.1" if fabric_subnet >= 0 else ""
        self.nodes = [Node(f"hin{self.tag}n{i}", f"198.18.{subnet}.{i + 2}", f"hiv{self.tag}n{i}",
                           f"198.18.{fabric_subnet}.{i + 2}" if fabric_subnet >= 0 else "",
                           f"hiw{self.tag}n{i}" if fabric_subnet >= 0 else "")
                      for i in range(self._n)]
        fabric = [self.fabric_bridge_address, *(n.fabric_address for n in self.nodes)] if fabric_subnet >= 0 else []
        for addr in (self.bridge_address, *(node.address for node in self.nodes), *fabric):
            if ipaddress.ip_address(addr) not in ALLOWED:  # a guard against editing the scheme above
                raise ValueError(f"{addr} is outside 198.18.0.0/15")

    def create(self) -> None:
        """Make the bridge, the namespaces and the veth pairs; on any failure undo all and raise NetnsError."""
        reason = unavailable_reason()
        if reason:
            raise NetnsError(reason)
        sweep_stale()
        existing = set(ip("netns", "list", check=False).stdout.split())
        for name in (node.name for node in self.nodes):
            if name in existing:
                raise NetnsError(f"namespace {name} already exists")
        try:
            with _subnet_lock():  # another test process (a pytest-xdist worker) may be picking one now
                if self._picked and self.subnet in used_subnets():
                    self._renumber(pick_subnet())
                if self.fabric_bridge:
                    self._renumber(self.subnet, pick_subnet(self.subnet + 1, avoid={self.subnet}))
                    self._add("link", self.fabric_bridge, "link", "add", self.fabric_bridge, "type", "bridge")
                    ip("addr", "add", f"{self.fabric_bridge_address}/{self.prefix}", "dev", self.fabric_bridge)
                self._add("link", self.bridge, "link", "add", self.bridge, "type", "bridge")
                ip("addr", "add", f"{self.bridge_address}/{self.prefix}", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            if self.fabric_bridge:
                ip("link", "set", self.fabric_bridge, "up")
            for node in self.nodes:
                self._add("netns", node.name, "netns", "add", node.name)
                self._add("link", node.host_veth, "link", "add", node.host_veth, "type", "veth",
                          "peer", "name", self.IFNAME, "netns", node.name)
                ip("link", "set", node.host_veth, "master", self.bridge)
                ip("link", "set", node.host_veth, "up")
                ip("-n", node.name, "addr", "add", f"{node.address}/{self.prefix}", "dev", self.IFNAME)
                ip("-n", node.name, "link", "set", self.IFNAME, "up")
                ip("-n", node.name, "link", "set", "lo", "up")
                if self.management_rate:
                    _tc(node.name, "qdisc", "add", "dev", self.IFNAME, "root", "tbf", "rate", self.management_rate,
                        "burst", "64kbit", "latency", "400ms")
                if self.fabric_bridge:
                    self._add("link", node.fabric_host_veth, "link", "add", node.fabric_host_veth, "type", "veth",
                              "peer", "name", self.FABRIC_IFNAME, "netns", node.name)
                    ip("link", "set", node.fabric_host_veth, "master", self.fabric_bridge)
                    ip("link", "set", node.fabric_host_veth, "up")
                    ip("-n", node.name, "addr", "add", f"{node.fabric_address}/{self.prefix}", "dev",
                       self.FABRIC_IFNAME)
                    ip("-n", node.name, "link", "set", self.FABRIC_IFNAME, "up")
        except BaseException:
            self.destroy()
            raise

    def _add(self, kind: str, name: str, *args: str) -> None:
        self._created.append((kind, name))  # recorded first: a timed-out ``ip`` may still have made it
        ip(*args)

    def destroy(self) -> None:
        """Kill what runs in the namespaces, delete them, the veths and the bridge; idempotent."""
        for kind, name in reversed(self._created):
            if kind == "netns":
                kill_netns_processes(name)
                ip("netns", "del", name, check=False)  # takes its veth pair with it
            else:
                ip("link", "del", name, check=False)
        self._created.clear()

    def node(self, key: int | str) -> Node:
        """A node by index or by namespace name."""
        if isinstance(key, int):
            return self.nodes[key]
        for node in self.nodes:
            if node.name == key:
                return node
        raise KeyError(key)

    def nsenter(self, key: int | str, argv: Sequence[str]) -> list[str]:
        """``argv`` to run inside a node's namespace. ``nsenter --net`` is used rather than ``ip netns
        exec``, which also remounts /sys (and so hides the host's cgroup tree from, e.g., slurmd)."""
        return ["nsenter", f"--net={self.node(key).path}", "--", *argv]

    def byte_counters(self, key: int | str, ifname: str) -> tuple[int, int]:
        """(received, sent) bytes of interface ``ifname`` inside a node's namespace, since it was made."""
        out = ip("-n", self.node(key).name, "-s", "-j", "link", "show", "dev", ifname).stdout
        stats = json.loads(out)[0]["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])

    def pids(self, key: int | str) -> list[int]:
        """Pids of the processes inside a node's namespace."""
        return netns_pids(self.node(key).name)

    def __enter__(self) -> NetnsCluster:
        self.create()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.destroy()


def _tc(namespace: str, *args: str) -> None:
    """``tc`` inside a namespace (``ip netns exec`` is not needed: ``tc -n``); ``NetnsError`` on failure."""
    try:
        proc = subprocess.run(["tc", "-n", namespace, *args], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"tc {' '.join(args)}: {exc}") from exc
    if proc.returncode != 0:
        raise NetnsError(f"tc {' '.join(args)}: exit {proc.returncode}: {proc.stderr.strip()}")


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Held while a subnet is checked free and its bridge address added: two processes creating clusters
    at once never take the same 198.18.X.0/24."""
    with _file_lock("hpoflow-netns-subnet.lock"):
        yield


@contextlib.contextmanager
def _file_lock(name: str) -> Iterator[None]:
    """An exclusive ``flock`` on ``name`` in the system temp dir, shared by every test process."""
    fd = os.open(Path(tempfile.gettempdir()) / name, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def netns_pids(name: str) -> list[int]:
    """Pids of the live (not zombie) processes whose network namespace is ``name`` (``ip netns pids``)."""
    if not (NETNS_DIR / name).exists():
        return []
    out = ip("netns", "pids", name, check=False).stdout
    return [int(word) for word in out.split() if word.isdigit() and int(word) != os.getpid() and _alive(int(word))]


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def kill_netns_processes(name: str, grace: float = 5.0) -> None:
    """SIGTERM every process in namespace ``name``, then SIGKILL those still there after ``grace`` s."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5.0)):
        pids = netns_pids(name)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end and netns_pids(name):
            time.sleep(0.1)


@contextlib.contextmanager
def sweep_lock() -> Iterator[None]:
    """Held by each sweep (``sweep_stale``): one process sweeps at a time. A test that makes leftovers
    and sweeps them holds it across both (``sweep_stale(locked=True)``), so another worker's ``create()``
    cannot sweep them first."""
    with _file_lock("hpoflow-netns-sweep.lock"):
        yield


def sweep_stale(*, locked: bool = False) -> list[str]:
    """Delete the namespaces (killing what runs in them) and links of this module's naming scheme whose
    creating process is dead; returns their names. Names of live processes, ours included, are kept.
    Under ``sweep_lock`` (``locked``: the caller holds it already)."""
    def dead(name: str) -> bool:
        match = STALE.fullmatch(name)
        if match is None:
            return False
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    swept = []
    with contextlib.nullcontext() if locked else sweep_lock():
        for name in ip("netns", "list", check=False).stdout.split():
            if dead(name):
                kill_netns_processes(name)
                ip("netns", "del", name, check=False)
                swept.append(name)
        for line in ip("-o", "link", "show", check=False).stdout.splitlines():
            parts = line.split(":", 2)
            name = parts[1].strip().split("@")[0] if len(parts) > 2 else ""
            if dead(name):
                ip("link", "del", name, check=False)
                swept.append(name)
    return swept
