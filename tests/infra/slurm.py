"""A real SLURM cluster on this host: ``slurmctld`` on a bridge, one ``slurmd`` per network namespace.

``SlurmCluster(n).start()`` makes a private tree under the system temp dir (never under the repo)::

    ROOT/munge/        munged's key, socket, pid, seed (munged runs in the foreground as our child)
    ROOT/etc/slurm.conf
    ROOT/ctld/         slurmctld's state, pid
    ROOT/nodes/NAME/   each slurmd's spool and pid (``%n`` in slurm.conf)
    ROOT/log/          every daemon's log (and the job completion log, see below)
    ROOT/shared/       scratch space that every "node" sees (they share this host's filesystem)

then a ``NetnsCluster``: a bridge holding 198.18.X.1/24 and namespaces n1 = 198.18.X.2, n2 =
198.18.X.3, ...; ``munged`` with its own key and socket (``AuthInfo=socket=`` points every daemon and
client at it), ``slurmctld -D`` on the host (``SlurmctldHost=<hostname>(198.18.X.1)``), and one
``slurmd -D -N nK`` per namespace entered with ``nsenter --net`` (``ip netns exec`` would remount /sys).
Ports and ``ClusterName`` are chosen per session. Clients find the cluster through ``SLURM_CONF``:
pass ``cluster.env`` to subprocesses, or use ``cluster.run``.

No accounting storage is configured, so ``sacct`` answers "Slurm accounting storage is disabled":
``scontrol show job ID`` (``cluster.job_info``) describes a job for ``MinJobAge`` s after it ends, and
the job completion log ``cluster.jobcomp_path`` (``jobcomp/filetxt``) keeps one line per finished job.

``private_shm(NAME)`` (a context manager) restarts node NAME's slurmd in a mount namespace of its own
(``unshare --mount --propagation private``) whose ``/dev/shm`` is a small tmpfs, so every step, agent and
rank on that node sees it, and the host's ``/dev/shm`` stays as it was; ``fill_shm(NAME)`` fills it from
inside that namespace. On leaving, the node's jobs are cancelled, what is left in the namespace is killed
(the tmpfs goes with it) and its slurmd runs as before.

``stop()`` cancels every job, kills the daemons it started by pid and every process left in the
namespaces (slurmstepd, job tasks), deletes the namespaces and the bridge and removes ROOT; it is
idempotent and undoes a ``start()`` that failed half way. ``start()`` undoes itself when it fails, and
first sweeps what an earlier session killed without teardown left (``sweep_stale_sessions``).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tests.infra.netns import NetnsCluster
from tests.infra.netns import sweep_stale as sweep_stale_netns
from tests.infra.netns import unavailable_reason as netns_unavailable_reason

REPO = Path(__file__).resolve().parents[2]
DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("srun", "sbatch", "squeue", "scontrol", "scancel", "sinfo")
KEEP_ENV = "HPOFLOW_INFRA_KEEP"  # set to 1 to keep ROOT (logs, conf) after stop() for debugging
# "plain": CR_Core, one thread per core as this host has, no GRES, memory not accounted, one network.
# "site": what a GPU site declares: memory a consumable resource (CR_Core_Memory, no DefMemPerCPU: a job
# or step without --mem takes all of its nodes' memory), nodes of 2 cores x 2 threads, 4 GRES GPUs per
# node backed by stand-in device files (character devices 1:3, /dev/null's), which SLURM hands out
# through CUDA_VISIBLE_DEVICES and SLURM_STEP_GPUS as it would real ones, 16 GPU shards per node
# (gres/shard, 4 per GPU, as a site that shares GPUs between jobs declares), and two networks per node.
PROFILES = ("plain", "site")
SITE_NODE = {"CPUs": "4", "Boards": "1", "SocketsPerBoard": "1", "CoresPerSocket": "2", "ThreadsPerCore": "2"}
SITE_GPUS = 4
SITE_SHARDS = 16  # gres/shard per node: 4 per GPU
SITE_MEMORY_MB = 3000
# the site profile's two networks per node: "management" (eth0: NodeAddr, so slurmctld, srun and the launch
# node's address use it), rate-limited, and "fabric" (fab0), which nothing names unless the job's
# environment does (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, as a site's module sets them)
SITE_MANAGEMENT_RATE = "200mbit"
# A node's own /dev/shm (``private_shm``): ``unshare --mount --propagation private -- sh -c SHM_WRAPPER
# hpoflow-private-shm OPTIONS HOST_MNT_NS ARGV...`` mounts a tmpfs named SHM_SOURCE on /dev/shm, then execs
# ARGV (slurmd, so its pid stays the daemon's). It refuses to mount where its mount namespace is the host's
# (HOST_MNT_NS, the test process's), so a failed unshare can never cover or fill the host's /dev/shm.
SHM_SOURCE = "hpoflow-node-shm"
SHM_WRAPPER = f"""\
options=$1 host=$2
shift 2
if [ "$(readlink /proc/self/ns/mnt)" = "$host" ]; then
    echo "hpoflow-private-shm: not in a mount namespace of its own: /dev/shm left alone" >&2
    exit 97
fi
mount -t tmpfs -o "$options" {SHM_SOURCE} /dev/shm || exit 98
exec "$@"
"""
# Fills a node's own /dev/shm from inside its mount namespace: every inode, then every block; refuses unless
# the /dev/shm it sees (the last mount there) is that tmpfs. Prints ``df`` and ``df -i`` of it.
SHM_FILL = f"""\
awk '$5 == "/dev/shm" {{ src = $(NF - 1) }} END {{ exit src != "{SHM_SOURCE}" }}' /proc/self/mountinfo || {{
    echo "this /dev/shm is not the node's own tmpfs: left alone" >&2
    exit 97
}}
i=0
while touch /dev/shm/hpoflow-fill-$i 2>/dev/null; do i=$((i + 1)); done
dd if=/dev/zero of=/dev/shm/hpoflow-fill-0 bs=4k 2>/dev/null
df -k /dev/shm
df -i /dev/shm
"""


class SlurmError(RuntimeError):
    """The cluster did not come up or a daemon misbehaved; the message ends with the logs' tails."""


class SlurmCommandError(subprocess.CalledProcessError):
    """A client command exited non-zero; unlike its base class, its message includes stdout and stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def unavailable_reason() -> str | None:
    """Why a cluster cannot be started here (not root, a program missing), or None."""
    reason = netns_unavailable_reason()
    if reason:
        return reason
    missing = [tool for tool in (*DAEMONS, *CLIENTS) if shutil.which(tool) is None]
    if missing:
        return f"not installed: {', '.join(missing)} (Debian: apt-get install slurm-wlm munge)"
    return None


def temp_root(prefix: str) -> Path:
    """A fresh directory (mode 0755) in the system temp dir, or in /tmp if that dir is inside the repo or
    not searchable by all users (munged and a postgres server running as ``postgres`` need that)."""
    base = Path(tempfile.gettempdir()).resolve()
    searchable = all(p.stat().st_mode & 0o001 for p in (base, *base.parents))
    if base == REPO or REPO in base.parents or not searchable:
        base = Path("/tmp")
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    path.chmod(0o755)
    return path


STALE_ROOT = re.compile(r"hpoflow-(?:slurm|pg)-(\d+)-\w+")  # temp_root()s of this module and postgres.py


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (a zombie counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale_sessions() -> list[str]:
    """Undo what a test session killed without teardown (SIGKILL) left, when its pid is dead: its
    namespaces and links with every process in them (slurmstepd, job tasks), host processes whose
    ``SLURM_CONF`` is in its temp root (a test's ``srun``), and its temp roots (unless HPOFLOW_INFRA_KEEP=1).
    Its daemons need no sweeping: they get SIGTERM from the kernel when the session dies
    (PR_SET_PDEATHSIG). Returns what was removed."""
    swept = sweep_stale_netns()
    base = Path(tempfile.gettempdir()).resolve()
    roots = [path for b in {base, Path("/tmp")} if b.is_dir() for path in b.iterdir()
             if (m := STALE_ROOT.fullmatch(path.name)) and not pid_alive(int(m.group(1)))]
    prefixes = tuple(f"SLURM_CONF={root}/".encode() for root in roots)
    for proc in Path("/proc").iterdir() if prefixes else ():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(var.startswith(prefixes) for var in environ):
            with contextlib.suppress(OSError):
                os.kill(int(proc.name), signal.SIGKILL)
                swept.append(f"pid {proc.name}")
    if os.environ.get(KEEP_ENV) != "1":
        for root in roots:
            shutil.rmtree(root, ignore_errors=True)
            swept.append(str(root))
    return swept


def free_port() -> int:
    """A TCP port nothing on this host listens on now (the kernel's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        port: int = s.getsockname()[1]
        return port


def clean_environ() -> dict[str, str]:
    """This process's environment without SLURM_* variables (a surrounding real job must not leak in)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Have the kernel SIGTERM this child if the test process dies without tearing down."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(argv: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start a daemon in the foreground as our child in its own session, its output appended to ``log``."""
    with open(log, "ab") as out:
        return subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=dict(env), start_new_session=True, preexec_fn=_die_with_parent)


def terminate(proc: subprocess.Popen[bytes] | None, grace: float = 10.0) -> None:
    """SIGTERM ``proc``, SIGKILL it after ``grace`` s, and reap it; nothing if it is None or gone."""
    if proc is None or proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        proc.wait(10)


def mount_namespace(pid: int | str = "self") -> str:
    """The mount namespace of process ``pid`` (``mnt:[4026531841]``), or "" when it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return ""


def private_shm_argv(argv: Sequence[str], options: str) -> list[str]:
    """``argv`` run in a mount namespace of its own whose /dev/shm is a tmpfs mounted with ``options``
    (``size=1m,nr_inodes=64,mode=1777``); exec'd, so its pid is ``argv``'s (see ``SHM_WRAPPER``)."""
    return ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", SHM_WRAPPER, "hpoflow-private-shm",
            options, mount_namespace(), *argv]


def tail(path: Path, lines: int = 25) -> str:
    """The last ``lines`` lines of a text file, or a note that it cannot be read."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({exc})"


def detect_hardware() -> dict[str, str]:
    """This host's ``slurmd -C`` topology (CPUs, Boards, SocketsPerBoard, CoresPerSocket, ThreadsPerCore);
    a plain ``CPUs=<count>`` if ``slurmd -C`` fails."""
    cpus = str(len(os.sched_getaffinity(0)))
    try:
        out = subprocess.run(["slurmd", "-C"], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return {"CPUs": cpus}
    first = out.splitlines()[0] if out else ""
    fields = dict(word.split("=", 1) for word in first.split() if "=" in word)
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
    hw = {k: fields[k] for k in keep if k in fields}
    return hw if "CPUs" in hw else {"CPUs": cpus}


class SlurmCluster:
    """A SLURM 22.05 cluster of ``n_nodes`` slurmd in namespaces plus slurmctld and munged on the host."""

    def __init__(self, n_nodes: int = 2, *, slurmd_timeout: int = 10, real_memory: int | None = None,
                 profile: str = "plain") -> None:
        if profile not in PROFILES:
            raise ValueError(f"profile must be one of {sorted(PROFILES)}, not {profile!r}")
        self.n_nodes = n_nodes
        self.slurmd_timeout = slurmd_timeout
        self.profile = profile
        self.real_memory = real_memory if real_memory is not None else (SITE_MEMORY_MB if profile == "site" else 1000)
        self.node_names = [f"n{i + 1}" for i in range(n_nodes)]
        self.root = Path()
        self.net: NetnsCluster | None = None
        self.munged: subprocess.Popen[bytes] | None = None
        self.slurmctld: subprocess.Popen[bytes] | None = None
        self.slurmd: dict[str, subprocess.Popen[bytes]] = {}
        self.shm_options: dict[str, str] = {}  # node -> the tmpfs options of its own /dev/shm (private_shm)
        self.shm_namespaces: dict[str, str] = {}  # node -> the mount namespace its slurmd made for that /dev/shm
        self._slurmd_started: dict[str, float] = {}  # node -> when its slurmd was last started (time.time())
        self.env: dict[str, str] = clean_environ()
        self.cluster_name = ""  # hpo<pid>x<k>, from the namespaces' tag, at start()
        self.ctld_port = 0
        self.slurmd_port = 0
        self.started = False

    # -- paths -------------------------------------------------------------------------------------
    @property
    def conf_dir(self) -> Path:
        """The directory holding ``slurm.conf``."""
        return self.root / "etc"

    @property
    def conf_path(self) -> Path:
        """The generated ``slurm.conf`` (``SLURM_CONF`` in ``env``)."""
        return self.conf_dir / "slurm.conf"

    @property
    def shared_dir(self) -> Path:
        """Scratch space every node sees at the same path (they share this host's filesystem)."""
        return self.root / "shared"

    @property
    def log_dir(self) -> Path:
        """Where every daemon logs: munged.log, slurmctld.log, slurmd-NAME.log."""
        return self.root / "log"

    @property
    def jobcomp_path(self) -> Path:
        """The job completion log: one ``JobId=... JobState=...`` line per finished job."""
        return self.log_dir / "jobcomp.txt"

    @property
    def gpu_dir(self) -> Path:
        """The site profile's stand-in GPU device files: ``NAME-gpu0`` .. ``NAME-gpu3`` per node."""
        return self.root / "dev"

    @property
    def munge_socket(self) -> Path:
        """munged's socket (``AuthInfo=socket=`` in slurm.conf)."""
        return self.root / "munge" / "munge.socket.2"

    @property
    def node_addresses(self) -> dict[str, str]:
        """Node name -> its address on the bridge (198.18.X.2, ...)."""
        if self.net is None:
            return {}
        return {name: node.address for name, node in zip(self.node_names, self.net.nodes, strict=True)}

    def host_addresses(self, name: str) -> list[str]:
        """Every address of node ``name``, as ``hostname -I`` lists them there: its management address,
        then its fabric address where the profile has one."""
        fabric = self.fabric_addresses.get(name)
        return [self.node_addresses[name], *([fabric] if fabric else [])]

    @property
    def fabric_addresses(self) -> dict[str, str]:
        """Node name -> its address on the fabric network (site profile; empty otherwise)."""
        if self.net is None or not self.net.fabric_bridge:
            return {}
        return {name: node.fabric_address for name, node in zip(self.node_names, self.net.nodes, strict=True)}

    @property
    def controller_address(self) -> str:
        """slurmctld's address: the bridge's (198.18.X.1)."""
        if self.net is None:
            raise SlurmError("the cluster is not started")
        return self.net.bridge_address

    def namespace(self, name: str) -> str:
        """The network namespace of node ``name``."""
        if self.net is None:
            raise SlurmError("the cluster is not started")
        return self.net.nodes[self.node_names.index(name)].name

    # -- life cycle --------------------------------------------------------------------------------
    def start(self, timeout: float = 180.0) -> None:
        """Bring everything up and wait until every node is idle; on failure stop() and raise.

        Raises ``NetnsError`` when namespaces cannot be made and ``SlurmError`` when a daemon does not
        come up in ``timeout`` s (generous: on a loaded 2-core machine each daemon start, munge
        round-trip and node registration takes seconds, and slurmctld only marks a node idle after
        the node's registration message was processed)."""
        reason = unavailable_reason()
        if reason:
            raise SlurmError(reason)
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise
        self.started = True

    def _start(self, timeout: float) -> None:
        sweep_stale_sessions()
        self.root = temp_root(f"hpoflow-slurm-{os.getpid()}-")
        for sub in ("munge", "etc", "ctld/state", "log", "shared", *(f"nodes/{n}/spool" for n in self.node_names)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        site = self.profile == "site"
        self.net = NetnsCluster(self.n_nodes, fabric=site, management_rate=SITE_MANAGEMENT_RATE if site else None)
        self.net.create()
        self.cluster_name = f"hpo{self.net.tag}"
        self._start_munged(timeout)
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        while self.slurmd_port == self.ctld_port:
            self.slurmd_port = free_port()
        if self.profile == "site":
            self._make_gpus()
        self.conf_path.write_text(self.render_conf())
        self.env = {**clean_environ(), "SLURM_CONF": str(self.conf_path)}
        self.slurmctld = spawn(["slurmctld", "-D", "-f", str(self.conf_path)], self.log_dir / "slurmctld.out",
                               self.env)
        self._wait(lambda: self.run(["scontrol", "ping"], check=False, timeout=30).stdout.count("UP") > 0,
                   timeout, "slurmctld to answer `scontrol ping`", self.slurmctld)
        for name in self.node_names:
            self.start_slurmd(name)
        self.wait_idle(timeout)

    def _start_munged(self, timeout: float) -> None:
        key = self.root / "munge" / "munge.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(os.urandom(128))
        mdir = self.root / "munge"
        argv = ["munged", "--foreground", f"--socket={self.munge_socket}", f"--key-file={key}",
                f"--pid-file={mdir / 'munged.pid'}", f"--seed-file={mdir / 'munged.seed'}",
                f"--log-file={self.log_dir / 'munged.log'}"]
        self.munged = spawn(argv, self.log_dir / "munged.out", clean_environ())
        self._wait(self.munge_socket.exists, timeout, "munged to create its socket", self.munged)

    def _make_gpus(self) -> None:
        """The site profile's GPUs: ``SITE_GPUS`` character devices per node (``mknod c 1 3``) and a
        ``gres.conf`` beside slurm.conf that names them (SLURM takes a GPU's index from the number
        its file name ends with), and ``SITE_SHARDS`` GPU shards per node (``gres/shard``, as a site that
        shares GPUs declares them: no file, SLURM spreads them evenly over the node's GPUs)."""
        self.gpu_dir.mkdir(exist_ok=True)
        lines = ["# Generated by tests/infra/slurm.py: stand-in GPUs (character devices 1:3)"]
        for name in self.node_names:
            for i in range(SITE_GPUS):
                os.mknod(self.gpu_dir / f"{name}-gpu{i}", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            lines.append(f"NodeName={name} Name=gpu File={self.gpu_dir}/{name}-gpu[0-{SITE_GPUS - 1}]")
            lines.append(f"NodeName={name} Name=shard Count={SITE_SHARDS}")
        (self.conf_dir / "gres.conf").write_text("\n".join(lines) + "\n")

    def render_conf(self) -> str:
        """The slurm.conf of this cluster (every path under ROOT, every port this session's own)."""
        if self.net is None:
            raise SlurmError("the namespaces are not made yet")
        host = socket.gethostname().split(".")[0]
        site = self.profile == "site"
        hw = " ".join(f"{k}={v}" for k, v in (SITE_NODE if site else detect_hardware()).items())
        gres = f" Gres=gpu:{SITE_GPUS},shard:{SITE_SHARDS}" if site else ""
        nodes = "\n".join(f"NodeName={name} NodeAddr={addr} {hw} RealMemory={self.real_memory}{gres} State=UNKNOWN"
                          for name, addr in self.node_addresses.items())
        select = "CR_Core_Memory" if site else "CR_Core"
        gres_types = "GresTypes=gpu,shard\n" if site else ""
        r = self.root
        return f"""\
# Generated by tests/infra/slurm.py for one test session; everything lives under {r}.
ClusterName={self.cluster_name}
SlurmctldHost={host}({self.net.bridge_address})
SlurmctldPort={self.ctld_port}
SlurmdPort={self.slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
StateSaveLocation={r}/ctld/state
SlurmctldPidFile={r}/ctld/slurmctld.pid
SlurmctldLogFile={self.log_dir}/slurmctld.log
SlurmdSpoolDir={r}/nodes/%n/spool
SlurmdPidFile={r}/nodes/%n/slurmd.pid
SlurmdLogFile={self.log_dir}/slurmd-%n.log
SlurmctldDebug=info
MailProg=/bin/true
SlurmdDebug=info
# no cgroups: the namespaces share this host's cgroup tree, and a test must not depend on its layout
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc={self.jobcomp_path}
SelectType=select/cons_tres
SelectTypeParameters={select}
{gres_types}SchedulerType=sched/backfill
# schedule a submitted batch job at once (the default waits up to 3 s to batch submissions)
SchedulerParameters=batch_sched_delay=0
MpiDefault=none
SwitchType=switch/none
PropagateResourceLimits=NONE
# the nodes share one machine: trust slurm.conf over what each slurmd detects
SlurmdParameters=config_overrides
# a node whose slurmd stops answering is marked DOWN (down*) after SlurmdTimeout s plus up to a ping
# period (~27 s for 10 s here) and comes back when its slurmd registers again (ReturnToService=1); one
# set DOWN by `scontrol update` stays DOWN until `state=resume`
SlurmdTimeout={self.slurmd_timeout}
SlurmctldTimeout=30
MessageTimeout=10
ReturnToService=1
KillWait=2
InactiveLimit=0
# `scontrol show job ID` describes an ended job for MinJobAge s (there is no sacct without accounting)
MinJobAge=600
# a job whose node fails ends (NODE_FAIL) rather than silently running again: tests see failures
JobRequeue=0
{nodes}
PartitionName=debug Nodes={",".join(self.node_names)} Default=YES MaxTime=INFINITE State=UP
"""

    def start_slurmd(self, name: str) -> None:
        """Start (or restart) the slurmd of node ``name`` inside its namespace."""
        if self.net is None:
            raise SlurmError("the cluster is not started")
        old = self.slurmd.get(name)
        if old is not None and old.poll() is None:
            raise SlurmError(f"slurmd of {name} is running already (pid {old.pid})")
        argv = ["slurmd", "-D", "-N", name, "-f", str(self.conf_path)]
        if name in self.shm_options:
            argv = private_shm_argv(argv, self.shm_options[name])
        self._slurmd_started[name] = time.time()
        self.slurmd[name] = spawn(self.net.nsenter(self.namespace(name), argv), self.log_dir / f"slurmd-{name}.out",
                                  self.env)

    @contextlib.contextmanager
    def private_shm(self, name: str, size: str = "1m", nr_inodes: int = 64, timeout: float = 180.0) -> Iterator[str]:
        """Node ``name``'s slurmd, and so every step, agent and rank it starts, in a mount namespace of its own
        whose /dev/shm is a tmpfs of ``size`` and ``nr_inodes`` (``SHM_WRAPPER``); yields that namespace. On
        leaving, also after a failure: the node's jobs cancelled, its slurmd stopped, every process left in
        the namespace killed (the tmpfs goes with the last one), and its slurmd started as before. The node is
        idle, with its new slurmd registered, on entering and on leaving."""
        if name in self.shm_options:
            raise SlurmError(f"node {name} has a /dev/shm of its own already")
        try:
            self._restart_slurmd(name, f"size={size},nr_inodes={nr_inodes},mode=1777", timeout)
            yield self.shm_namespaces[name]
        finally:
            self._restart_slurmd(name, None, timeout)

    def fill_shm(self, name: str) -> str:
        """Fill node ``name``'s own /dev/shm (``private_shm``; every inode and every block) from inside its mount
        namespace; ``df`` and ``df -i`` of it. ``SlurmError`` where the node has none: the host's is never
        filled."""
        proc = self.slurmd.get(name)
        if (proc is None or proc.poll() is not None or self.net is None or not self.shm_namespaces.get(name)
                or mount_namespace(proc.pid) != self.shm_namespaces[name]):
            raise SlurmError(f"node {name} has no /dev/shm of its own (SlurmCluster.private_shm) with its slurmd "
                             "running: refusing to fill one")
        argv = ["nsenter", f"--net={self.net.node(self.namespace(name)).path}", f"--mount=/proc/{proc.pid}/ns/mnt",
                "--", "sh", "-c", SHM_FILL]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if r.returncode != 0:
            raise SlurmError(f"filling the /dev/shm of {name} failed (exit {r.returncode}): {r.stderr.strip()}")
        return r.stdout

    def _restart_slurmd(self, name: str, shm_options: str | None, timeout: float) -> None:
        """Cancel node ``name``'s jobs, stop its slurmd, kill what is left in its own mount namespace, and start
        it again with a /dev/shm of its own (``shm_options``) or the host's (None); wait until slurmctld has
        its registration (its ``SlurmdStartTime`` changed) and the node is idle."""
        if self.net is None:
            raise SlurmError("the cluster is not started")
        ids = self.run(["squeue", "-h", "-w", name, "-o", "%i"], check=False, timeout=30).stdout.split()
        if ids:
            self.run(["scancel", *ids], check=False, timeout=30)
            self._wait(lambda: not self.run(["squeue", "-h", "-w", name, "-o", "%i"], check=False,
                                            timeout=30).stdout.strip(), timeout, f"the jobs on {name} to end")
        old = self.slurmd.pop(name, None)
        # the namespace made on entering, and the one of a slurmd ensure_healthy() started again since
        namespaces = {self.shm_namespaces.pop(name, ""),
                      mount_namespace(old.pid) if old is not None and old.poll() is None and name in self.shm_options
                      else ""} - {"", mount_namespace()}
        terminate(old)
        for namespace in namespaces:
            kill_mount_namespace(namespace)
        before = self._slurmd_start_time(name)
        # SlurmdStartTime counts seconds: a new slurmd must not start in the second the last one did
        time.sleep(max(0.0, self._slurmd_started.get(name, 0.0) + 1.1 - time.time()))
        if shm_options is None:
            self.shm_options.pop(name, None)
        else:
            self.shm_options[name] = shm_options
        self.start_slurmd(name)
        try:
            self._wait(lambda: self._slurmd_start_time(name) not in ("", before), timeout,
                       f"the new slurmd of {name} to register", self.slurmd[name])
        except SlurmError as exc:  # what the wrapper said is in the daemon's stderr, which logs() leaves out
            raise SlurmError(f"{exc}\n--- slurmd-{name}.out\n{tail(self.log_dir / f'slurmd-{name}.out')}") from exc
        if shm_options is not None:
            pid = self.slurmd[name].pid
            namespace = mount_namespace(pid)
            if not namespace or namespace == mount_namespace():
                raise SlurmError(f"slurmd of {name} (pid {pid}) is not in a mount namespace of its own "
                                 f"({namespace or 'gone'})")
            self.shm_namespaces[name] = namespace
        self.wait_states({name: ("idle",)}, timeout)

    def _slurmd_start_time(self, name: str) -> str:
        """``SlurmdStartTime`` of node ``name`` as slurmctld has it (when its slurmd that registered last
        started), or ""."""
        out = self.run(["scontrol", "show", "node", "-o", name], check=False, timeout=30).stdout
        found = re.search(r"\bSlurmdStartTime=(\S+)", out)
        return found.group(1) if found and found.group(1) != "None" else ""

    def kill_slurmd(self, name: str) -> None:
        """SIGKILL the slurmd of node ``name`` (its job steps go on, as on a node whose daemon crashed)."""
        proc = self.slurmd.get(name)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def kill_node(self, name: str) -> None:
        """SIGKILL every process in node ``name``'s namespace (slurmd, slurmstepd, tasks): a lost node."""
        if self.net is None:
            return
        for pid in self.net.pids(self.namespace(name)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc = self.slurmd.get(name)
        if proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def stop(self) -> None:
        """Cancel all jobs, stop every daemon, remove namespaces, bridge and ROOT; idempotent."""
        self.started = False
        ctld_up = self.slurmctld is not None and self.slurmctld.poll() is None
        if ctld_up:
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self._cancel_all(timeout=30)
        for name in list(self.slurmd):
            terminate(self.slurmd.pop(name))
        if self.net is not None:
            self.net.destroy()  # kills what is left in the namespaces: slurmstepd, job tasks
        terminate(self.slurmctld, grace=15)
        self.slurmctld = None
        terminate(self.munged)
        self.munged = None
        if self.root != Path() and self.root.is_dir() and os.environ.get(KEEP_ENV) != "1":
            shutil.rmtree(self.root, ignore_errors=True)

    def _cancel_all(self, timeout: float) -> None:
        ids = self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=30).stdout.split()
        if not ids:
            return
        self.run(["scancel", *ids], check=False, timeout=30)
        end = time.monotonic() + timeout
        while time.monotonic() < end and self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=30).stdout.strip():
            time.sleep(0.5)

    def __enter__(self) -> SlurmCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- clients -----------------------------------------------------------------------------------
    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 120.0,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        """Run a client (``srun``, ``sbatch``, ``scontrol``...) against this cluster; output captured as
        text. ``check`` raises ``SlurmCommandError`` (with stdout and stderr) on a non-zero exit."""
        kw.setdefault("capture_output", True)
        env = {**self.env, **kw.pop("env", {})}
        proc = subprocess.run(list(argv), env=env, text=True, timeout=timeout, check=False, **kw)
        if check and proc.returncode != 0:
            raise SlurmCommandError(proc.returncode, list(argv), proc.stdout, proc.stderr)
        return proc

    def node_states(self) -> dict[str, str]:
        """Node name -> ``sinfo``'s long state: idle, allocated, mixed, down, down*, drained... (``*``: not
        responding)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False, timeout=30).stdout
        return {parts[0]: parts[1] for parts in (line.split() for line in out.splitlines()) if len(parts) == 2}

    def wait_states(self, wanted: Mapping[str, Sequence[str]], timeout: float = 180.0) -> dict[str, str]:
        """Wait until each named node's state is one of those listed; returns all states. Raises SlurmError
        with the last states seen and the daemons' log tails after ``timeout`` s."""
        end = time.monotonic() + timeout
        while True:
            states = self.node_states()
            if all(states.get(name) in allowed for name, allowed in wanted.items()):
                return states
            if time.monotonic() > end:
                raise SlurmError(f"timed out after {timeout:.0f} s waiting for node states {dict(wanted)}; "
                                 f"last seen {states}\n{self.logs()}")
            time.sleep(0.5)

    def wait_idle(self, timeout: float = 180.0) -> None:
        """Wait until ``sinfo`` shows every node idle (see ``start`` for why the bound is generous). A node
        an earlier test left down or drained (taken down mid-step, SLURM may drain it a second time when its
        step's processes take long to die) is resumed, at most every 10 s, as an administrator would."""
        end = time.monotonic() + timeout
        while True:
            states = self.node_states()
            stuck = [name for name in self.node_names
                     if any(word in states.get(name, "") for word in ("down", "drain", "fail"))]
            if not stuck or time.monotonic() > end:
                break
            for name in stuck:
                self.resume_node(name, check=False)
            with contextlib.suppress(SlurmError):
                self.wait_states({name: ("idle",) for name in self.node_names}, min(10.0, end - time.monotonic()))
                return
        self.wait_states({name: ("idle",) for name in self.node_names}, max(0.0, end - time.monotonic()))

    def ensure_healthy(self, timeout: float = 180.0) -> None:
        """Ready for the next test, whatever the last one did: munged, slurmctld and every slurmd running
        (a slurmd a test killed is started again), slurmctld answering a client (which checks munge
        too), no job left over, and every node idle. ``SlurmError`` with the logs when it cannot be."""
        for name, proc in (("munged", self.munged), ("slurmctld", self.slurmctld)):
            if proc is None or proc.poll() is not None:
                raise SlurmError(f"{name} of this cluster is not running (exit {proc and proc.returncode})"
                                 f"\n{self.logs()}")
        for name in self.node_names:
            proc = self.slurmd.get(name)
            if proc is None or proc.poll() is not None:
                self.start_slurmd(name)
        self._wait(lambda: "UP" in self.run(["scontrol", "ping"], check=False, timeout=30).stdout, timeout,
                   "slurmctld to answer `scontrol ping`", self.slurmctld)
        if self.run(["squeue", "-h", "-o", "%i"], check=False, timeout=30).stdout.strip():
            self._cancel_all(timeout=60)
        self.wait_idle(timeout)

    def down_node(self, name: str, reason: str = "test") -> None:
        """``scontrol update nodename=NAME state=down reason=REASON``: jobs on it are killed."""
        self.run(["scontrol", "update", f"nodename={name}", "state=down", f"reason={reason}"])

    def resume_node(self, name: str, *, check: bool = True) -> None:
        """``scontrol update nodename=NAME state=resume`` (its slurmd must be running to become idle)."""
        self.run(["scontrol", "update", f"nodename={name}", "state=resume"], check=check)

    def job_info(self, job_id: str | int) -> dict[str, str]:
        """``scontrol show job -o ID`` as a dict (JobState, ExitCode, NodeList...): what ``sacct`` would
        tell, available for MinJobAge s after the job ends."""
        out = self.run(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(word.split("=", 1) for word in out.split() if "=" in word)

    def jobs(self) -> list[str]:
        """Ids of the jobs slurmctld knows and has not purged (pending, running, or ended < MinJobAge s)."""
        return self.run(["squeue", "-h", "-t", "all", "-o", "%i"]).stdout.split()

    # -- internals ---------------------------------------------------------------------------------
    def _wait(self, ok: Callable[[], bool], timeout: float, what: str,
              proc: subprocess.Popen[bytes] | None = None) -> None:
        """Poll ``ok`` until true; raise SlurmError with the logs after ``timeout`` s or if ``proc`` exits."""
        end = time.monotonic() + timeout
        while True:
            if proc is not None and proc.poll() is not None:
                raise SlurmError(f"the daemon (pid {proc.pid}) exited {proc.returncode} while waiting for {what}"
                                 f"\n{self.logs()}")
            if ok():
                return
            if time.monotonic() > end:
                raise SlurmError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.logs()}")
            time.sleep(0.5)

    def logs(self, lines: int = 25) -> str:
        """The tails of every daemon log, for error messages."""
        if not self.log_dir.is_dir():
            return "(no logs)"
        parts = []
        for path in sorted(self.log_dir.iterdir()):
            log = path.with_suffix(".log")
            if path.suffix == ".out" and log.exists() and log.stat().st_size > 0:
                continue  # the daemon's stderr, which repeats its log file once that is open
            parts.append(f"--- {path.name}\n{tail(path, lines)}")
        return "\n".join(parts)


def kill_mount_namespace(namespace: str, timeout: float = 30.0) -> None:
    """SIGKILL every process in mount namespace ``namespace`` (``mnt:[N]``, never this process's) and wait
    until none is left: the namespace, and what is mounted only there, then go."""
    if namespace == mount_namespace():
        raise SlurmError(f"refusing to kill the processes of this process's own mount namespace {namespace}")
    end = time.monotonic() + timeout
    while True:
        pids = [int(p.name) for p in Path("/proc").iterdir()
                if p.name.isdigit() and mount_namespace(p.name) == namespace]
        if not pids:
            return
        if time.monotonic() > end:
            raise SlurmError(f"processes {pids} of mount namespace {namespace} outlived SIGKILL by {timeout:.0f} s")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def write_script(path: Path, body: str) -> Path:
    """Write an executable shell script (``#!/bin/sh`` + body) for sbatch; returns its path."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path

