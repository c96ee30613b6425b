"""Processes of one cluster trial, each a fresh interpreter (no CUDA/NCCL state reaches a COMPSs worker).

``python -m hpoflow.engines.cluster.node node --job JOB`` — one per node, the *node launcher*: becomes
the leader of a new process group, starts this node's ``processes_per_node`` ranks in it
(``RANK = node_index * ppn + local_rank``) on its share of the node's cores and GPUs, and waits for
them; if a rank fails, it kills the others (they would hang in a collective).
``python -m hpoflow.engines.cluster.node rank --job JOB --rank R ...`` — one rank: ``run_rank`` with a
``FileChannel`` on rank 0; its outcome goes to ``outcome-<rank>.json``.
``python -m hpoflow.engines.cluster.node step --job JOB`` — one rank as a task of a SLURM job step
(the slurm engine's steps mode): SLURM started every rank, so no node launcher; the rank, its node and
the world come from ``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``; its log says on which node
and address it ran.

All of them start a watcher thread that kills the whole process group (launcher, ranks and their children)
as soon as the attempt's ``STOP`` file appears: a cancelled COMPSs task's children survive the task,
and ranks started by srun/ssh on other nodes are not the task's children at all.

A rank's stdout and stderr go through a pipe to the node launcher, which writes ``rank<r>.log`` with
a cap (``hpoflow.engines.logcap``, ``HPOFLOW_RANK_LOG_MB``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import dataclasses
import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hpoflow.credentials import scrub
from hpoflow.engines.cluster.layout import (
    bound_cpus,
    bound_gpus,
    choose_ifname,
    fabric_candidates,
    gloo_ifname_from_nccl,
    node_index_from_env,
    parse_id_list,
    resolve_node_index,
    split_for_ranks,
    step_rank_gpus,
)
from hpoflow.engines.logcap import LogPump, LogStream, cap_bytes
from hpoflow.engines.machine import gpu_lock_dir, parse_visible_devices
from hpoflow.fileio import read_json, write_json_atomic
from hpoflow.train.transport import TrialFiles

if TYPE_CHECKING:
    from hpoflow.engines.machine import GpuId

__all__ = ["gloo_interface", "host_addresses", "main"]

_WATCH_S = 0.2
_PEER_GRACE_S = 3.0


def _log(msg: str) -> None:
    print(f"hpoflow[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def _die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the node launcher) dies."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:
        os._exit(1)


def _kill_own_group() -> None:
    """Kill this process group, and the process group of a command trial's program this rank runs
    (``hpoflow.train.command``: a group of its own, which killing ours would leave running)."""
    command = sys.modules.get("hpoflow.train.command")
    for group in command.running_groups() if command is not None else ():
        with contextlib.suppress(OSError):
            os.killpg(group, signal.SIGKILL)
    try:
        os.killpg(os.getpgrp(), signal.SIGKILL)
    finally:
        os._exit(137)


def start_stop_watcher(files: TrialFiles, deadline: float | None = None, *, pause: bool = False,
                       watch_files: bool = True) -> threading.Thread:
    """A daemon thread that kills this process group when ``files.stop`` exists (or at ``deadline``);
    with ``pause`` (a rank), it also turns ``files.pause`` into SIGUSR1 to this process, once: the
    rank's training loop then stops at its next step with a checkpoint. ``watch_files=False`` (a SLURM
    step's rank, which srun signals: SIGTERM to stop, SIGUSR1 to pause): the deadline only, so the rank
    makes no periodic ``stat`` on the shared file system."""

    def watch() -> None:
        paused = False
        while True:
            if watch_files and files.stop_requested():
                _log(f"{files.stop} appeared: killing process group {os.getpgrp()}")
                _kill_own_group()
            if deadline is not None and time.time() > deadline:
                _log("the trial's deadline passed: killing process group")
                _kill_own_group()
            if watch_files and pause and not paused and files.pause.exists():
                paused = True
                _log(f"{files.pause} appeared: pausing at the next step")
                os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(_WATCH_S)

    t = threading.Thread(target=watch, name="hpoflow-stop-watcher", daemon=True)
    t.start()
    return t


def _load_job(path: str) -> dict[str, Any]:
    data = read_json(Path(path))
    if not isinstance(data, dict):
        raise SystemExit(f"hpoflow: job file {path} is missing or not valid JSON")
    return data


def _request(job: dict[str, Any]) -> Any:
    from hpoflow.engines.base import TrialRequest

    return TrialRequest.from_json(json.dumps(job["request"]))


# -- node launcher ------------------------------------------------------------------------------
def _node_index(args: argparse.Namespace) -> int:
    if args.node_index is not None:
        return int(args.node_index)
    if args.index_from == "mpi":
        idx = node_index_from_env(os.environ)
        if idx is None:
            raise SystemExit("hpoflow: --index-from mpi but no OMPI_COMM_WORLD_RANK/PMIX_RANK/PMI_RANK")
        return idx
    hosts = [h for h in (args.hosts or "").split(",") if h]
    if not hosts:
        return 0
    return resolve_node_index(hosts, os.environ)


def _rank_env(job: dict[str, Any], rank: int, local_rank: int, ppn: int, cores: tuple[int, ...],
              gpus: tuple[GpuId, ...], use_gpu_env: bool) -> dict[str, str]:
    env = dict(os.environ)
    scrub(env, any_database_url=True)  # a storage URL with a password in the job's environment: not for ranks
    for name in ("COMPSS_BINDED_CPUS", "COMPSS_BINDED_GPUS"):
        env.pop(name, None)  # the rank's own share is below; these described the whole task
    threads = str(max(1, len(cores)))
    env.update({str(k): str(v) for k, v in (job.get("env") or {}).items()})
    env.update({
        "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HPOFLOW_RANK": str(rank),
        "HPOFLOW_TRIAL": str(job["request"]["number"]), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(ppn), "RANK": str(rank), "WORLD_SIZE": str(job["world_size"]),
        "MASTER_ADDR": str(job["master_addr"]), "MASTER_PORT": str(job["master_port"]),
    })
    if use_gpu_env:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    return env


def _node(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a pause is for the ranks (they watch PAUSE themselves)
    if os.getpgrp() != os.getpid():
        try:
            os.setsid()
        except OSError:
            os.setpgid(0, 0)
    job = _load_job(args.job)
    req = job["request"]
    files = TrialFiles(Path(req["trial_dir"]), int(req.get("attempt", 0)))
    start_stop_watcher(files, job.get("deadline"))
    try:
        node_index = _node_index(args)
    except ValueError as exc:
        _log(str(exc))
        return 3
    log_fd = os.open(files.node_log(node_index), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    ppn = int(job["ppn"])
    cpus = job.get("cpus") or bound_cpus(os.environ)
    if not cpus:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    gpus = job.get("gpus")
    if gpus is None:
        gpus = bound_gpus(os.environ)
        if not gpus and int(req["gpus_per_process"]) > 0:
            from hpoflow.engines.machine import detect_gpus

            gpus = detect_gpus()
    core_shares = split_for_ranks(cpus, ppn, int(req["cpus_per_process"]))
    gpu_shares = split_for_ranks(gpus, ppn, int(req["gpus_per_process"]))
    if job.get("socket_ifname") == "auto" and int(job["world_size"]) > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
        # the node that started this launcher (srun sets its address) is the executing node: rank 0's
        ifname = choose_ifname(os.environ.get("SLURM_LAUNCH_NODE_IPADDR") or str(job["master_addr"]))
        if ifname:
            job.setdefault("env", {})["GLOO_SOCKET_IFNAME"] = ifname
    _log(f"node {node_index} on {os.environ.get('SLURMD_NODENAME') or os.uname().nodename}: ranks "
         f"{node_index * ppn}..{node_index * ppn + ppn - 1}, cores {cpus}, gpus {gpus}, rendezvous "
         f"{job['master_addr']}:{job['master_port']}, gloo interface "
         f"{(job.get('env') or {}).get('GLOO_SOCKET_IFNAME') or os.environ.get('GLOO_SOCKET_IFNAME', 'default')}")
    procs: list[tuple[int, subprocess.Popen[bytes]]] = []
    try:
        cap = cap_bytes()
    except ValueError as exc:  # the driver checked its own environment; this node's may differ
        _log(f"{exc}; using the default")
        cap = cap_bytes({})
    pump = LogPump(cap)
    streams: list[LogStream] = []
    try:
        for lr in range(ppn):
            rank = node_index * ppn + lr
            cores, gshare = core_shares[lr], gpu_shares[lr]
            argv = [sys.executable, "-m", "hpoflow.engines.cluster.node", "rank", "--job", args.job,
                    "--rank", str(rank), "--local-rank", str(lr),
                    "--cores", ",".join(str(c) for c in cores)]
            env = _rank_env(job, rank, lr, ppn, cores, gshare, bool(gpus) or int(req["gpus_per_process"]) > 0)
            out, stream = pump.open(str(files.rank_log(rank)))
            streams.append(stream)
            try:
                procs.append((rank, subprocess.Popen(argv, env=env, stdout=out, stderr=out,
                                                     stdin=subprocess.DEVNULL)))
            finally:
                os.close(out)  # the rank holds it now
        return _wait_ranks(procs)
    finally:
        for _, p in procs:  # never leave a rank behind
            if p.poll() is None:
                _kill_tree(p.pid)
        for _, p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        pump.wait(streams, 10.0)  # what the ranks wrote last, into their logs
        pump.close()


def _kill_tree(pid: int) -> None:
    try:
        import psutil

        parent = psutil.Process(pid)
        for child in parent.children(recursive=True):
            child.kill()
        parent.kill()
    except Exception:  # already gone, or psutil missing: kill the rank alone
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def _wait_ranks(procs: Sequence[tuple[int, subprocess.Popen[bytes]]]) -> int:
    code = 0
    failed_at: float | None = None
    while True:
        alive = [(r, p) for r, p in procs if p.poll() is None]
        for r, p in procs:
            rc = p.returncode
            if rc not in (None, 0) and code == 0:
                code = rc if rc > 0 else 128 - rc
                failed_at = time.monotonic()
                _log(f"rank {r} exited with code {rc}; stopping the other ranks of this node")
        if not alive:
            return code
        if failed_at is not None and time.monotonic() - failed_at > _PEER_GRACE_S:
            for r, p in alive:
                _log(f"killing rank {r}")
                _kill_tree(p.pid)
        time.sleep(0.05)


# -- one rank -----------------------------------------------------------------------------------
def _rank(args: argparse.Namespace) -> int:
    _die_with_parent()
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until run_rank handles a pause
    job = _load_job(args.job)
    req = job["request"]
    files = TrialFiles(Path(req["trial_dir"]), int(req.get("attempt", 0)))
    start_stop_watcher(files, pause=True)
    cores = [int(c) for c in args.cores.split(",") if c.strip().isascii() and c.strip().isdigit()]
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:
            _log(f"could not pin rank {args.rank} to cores {cores}: {exc}")
    return _run(job, files, args.rank, int(job["world_size"]), args.local_rank, max(1, len(cores)))


def _step(args: argparse.Namespace) -> int:
    """One rank as one task of a SLURM job step (the slurm engine's steps mode): SLURM started every
    rank itself, so the rank, its node and the world come from the step's environment."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # until run_rank handles a pause
    env = os.environ
    job = _load_job(args.job)
    req = job["request"]
    files = TrialFiles(Path(req["trial_dir"]), int(req.get("attempt", 0)))
    try:
        rank, local, world = int(env["SLURM_PROCID"]), int(env.get("SLURM_LOCALID", "0")), int(env["SLURM_NTASKS"])
    except (KeyError, ValueError):
        _log("not a task of a SLURM job step (SLURM_PROCID/SLURM_NTASKS missing)")
        return 3
    # the rank runs in a forked child whose output goes through a pipe into its capped log; this task
    # process holds the read end (a rank that dies abruptly loses nothing it wrote) and passes on the
    # signals srun forwards to the task (SIGUSR1: pause; SIGTERM/SIGINT: end)
    try:
        cap = cap_bytes()
    except ValueError as exc:
        _log(f"{exc}; using the default")
        cap = cap_bytes({})
    pump = LogPump(cap)
    out, stream = pump.open(str(files.rank_log(rank)))
    child = os.fork()
    if child:
        os.close(out)
        return _supervise_step(child, pump, stream)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    if world != int(job["world_size"]):
        _log(f"the step has {world} tasks but the trial {job['world_size']} ranks")
        return 3
    start_stop_watcher(files, job.get("deadline"), pause=True, watch_files=False)  # srun signals a step's ranks
    threads = max(1, int(req["cpus_per_process"]))
    os.environ.update({str(k): str(v) for k, v in (job.get("env") or {}).items()})
    os.environ.update({
        "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HPOFLOW_RANK": str(rank),
        "HPOFLOW_TRIAL": str(req["number"]), "LOCAL_RANK": str(local), "RANK": str(rank), "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": env.get("SLURM_NTASKS_PER_NODE", str(job.get("ppn", world))).split("(")[0],
    })
    why = _choose_gloo_interface(job, world)
    node_name = env.get("SLURMD_NODENAME") or os.uname().nodename
    per_rank = int(req.get("gpus_per_process") or 0)
    if per_rank:
        node_gpus = [int(g) for g in (job.get("node_gpus") or {}).get(node_name, [])]
        error = _bind_step_gpus(rank, local, int(job.get("ppn") or 1), per_rank, node_name, node_gpus)
        if error:
            _log(error)
            write_json_atomic(files.outcome(rank), {"status": "error", "error": error, "error_type": "GpuBindingError",
                                                    "host": node_name})
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
    _log(f"rank {rank} of {world} (local rank {local}) on node {node_name} "
         f"({host_addresses(os.environ.get('GLOO_SOCKET_IFNAME'))}), step {env.get('SLURM_JOB_ID')}."
         f"{env.get('SLURM_STEP_ID')}, gloo interface {os.environ.get('GLOO_SOCKET_IFNAME', 'default')} ({why})")
    # the ranks meet without a file lock on the shared file system: a trial on one node through a file
    # store on the node's own memory file system, one on several through a TCP store its rank 0 holds
    store = announce = ""
    if world > 1 and int(req.get("nodes") or 1) == 1:
        step = f"{env.get('SLURM_JOB_ID')}.{env.get('SLURM_STEP_ID')}"
        store = _node_local_store(str(job.get("rendezvous_id") or step))
    elif world > 1:
        announce = str(files.dir / "rendezvous.addr")
    code = _run(job, files, rank, world, local, threads, store=store, announce=announce, socket_channel=True)
    if store and rank == 0:  # the ranks left the group together (or failed): the store is done with
        with contextlib.suppress(OSError):
            os.unlink(store)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


_GPU_LOCKS: list[int] = []  # the lock files of this rank's GPUs, held open (and flocked) while it runs


def _gpu_lock_dir() -> Path:
    """Node-local, shared by every job of this user on the node (``hpoflow.engines.machine.gpu_lock_dir``)."""
    return gpu_lock_dir()


def _bind_step_gpus(rank: int, local: int, ranks_on_node: int, per_rank: int, node: str,
                    node_gpus: list[int]) -> str | None:
    """Give this step rank its own GPUs (``CUDA_VISIBLE_DEVICES``) and hold a lock on each (``flock`` on a
    node-local file named by the node and the GPU); the error line when it sees the wrong number of GPUs
    or another rank holds one of them (two ranks on one GPU: NCCL would stop with "Duplicate GPU
    detected", or the two would share its memory).

    SLURM names a step's GPUs in CUDA_VISIBLE_DEVICES (``step_rank_gpus`` takes the rank's share).
    With ``--gpu-bind=none`` SLURM 22.05 names none: every GPU of the node is visible, and which ones
    are the step's is not said anywhere a task can read. The rank then claims ``per_rank`` of the job's
    GPUs on the node (``node_gpus``, from ``scontrol -d show job``) that no other rank holds."""
    env = os.environ
    step = f"{env.get('SLURM_JOB_ID', '?')}.{env.get('SLURM_STEP_ID', '?')}"
    try:
        lock_dir = _gpu_lock_dir()
    except OSError as exc:
        _log(f"cannot check that rank {rank} has its GPUs to itself: {exc}")
        lock_dir = None
    if "CUDA_VISIBLE_DEVICES" not in env and node_gpus:
        if lock_dir is None:
            return (f"rank {rank} on node {node}: SLURM named none of the step's GPUs, and there is no lock "
                    "directory to claim any in")
        claimed: list[int] = []
        for gpu in node_gpus:
            if len(claimed) == per_rank:
                break
            if isinstance(_lock_gpu(lock_dir, node, f"gpu{gpu}", rank, step), int):
                claimed.append(gpu)
        if len(claimed) < per_rank:
            return (f"rank {rank} (step {step}) on node {node} found {len(claimed)} of the job's GPUs {node_gpus} "
                    f"free, but needs {per_rank}: SLURM named none of the step's GPUs (CUDA_VISIBLE_DEVICES unset, "
                    "--gpu-bind=none?). Fix: drop --gpu-bind from engine_options.srun_args")
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in claimed)
        _log(f"rank {rank} GPUs: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} "
             f"({', '.join(f'gpu{g}' for g in claimed)} of node {node}; SLURM named none of the step's GPUs: "
             f"claimed among the job's {node_gpus})")
        return None
    visible = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES", ""))
    try:
        mine, names = step_rank_gpus(visible, parse_id_list(env.get("SLURM_STEP_GPUS")), local, ranks_on_node,
                                     per_rank)
    except ValueError as exc:
        return (f"rank {rank} on node {node}: {exc}. Fix: ask for GPUs per rank (resources.gpus_per_process) and "
                "leave the GPU flags of srun to the engine (engine_options.srun_args)")
    for device, name in zip(mine, names, strict=True):
        if lock_dir is None:
            break
        held = _lock_gpu(lock_dir, node, name if name.startswith("gpu") else f"{name}-step{step}", rank, step)
        if isinstance(held, str):
            return (f"rank {rank} (step {step}) on node {node} was given GPU {device} ({name}), which {held} holds: "
                    "SLURM gave one GPU to two ranks. Fix: let SLURM bind GPUs per task (drop --gpu-bind from "
                    "engine_options.srun_args) or ask the site why its steps share GPUs")
    env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in mine)
    _log(f"rank {rank} GPUs: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']} ({', '.join(names)} of node {node}; "
         f"SLURM_STEP_GPUS={env.get('SLURM_STEP_GPUS', 'unset')})")
    return None


def _lock_gpu(lock_dir: Path, node: str, key: str, rank: int, step: str) -> int | str:
    """Hold the lock of GPU ``key`` of ``node`` for the life of this process: its fd, or who holds it."""
    fd = os.open(lock_dir / f"{node}-{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"rank {rank} of step {step} (pid {os.getpid()})".encode(), 0)
    _GPU_LOCKS.append(fd)
    return fd


def _supervise_step(child: int, pump: LogPump, stream: LogStream) -> int:
    """The task process of a step rank: forward the signals srun passes on to the rank (its child),
    wait for it, move the last of its output into its log; the rank's exit code (128 + signal if killed)."""
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: os.kill(child, signum))
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            status = 0
            break
    pump.wait([stream], 10.0)
    pump.close()
    code = os.waitstatus_to_exitcode(status)
    return code if code >= 0 else 128 - code


def host_addresses(ifname: str | None) -> str:
    """This host's IPv4 addresses (of ``ifname`` when given), for the rank log."""
    try:
        import psutil

        found = [a.address for name, addrs in psutil.net_if_addrs().items() if ifname in (None, name)
                 for a in addrs if a.family == socket.AF_INET and not a.address.startswith("127.")]
    except (ImportError, OSError):
        found = []
    return ", ".join(found) or "no address"


def gloo_interface(job: Mapping[str, Any], world: int, env: Mapping[str, str]) -> tuple[str | None, str]:
    """The ``GLOO_SOCKET_IFNAME`` a rank of a multi-rank trial on several nodes should get here (None:
    leave it as it is) and why (for the rank log). The site's ``GLOO_SOCKET_IFNAME`` stands; else the
    interface its ``NCCL_SOCKET_IFNAME`` selects here (prefix, ``=`` exact or ``^`` exclusion form, as a
    site module sets it for its fabric), resolved to one exact name (``gloo_ifname_from_nccl``); else,
    with ``socket_ifname: auto``, the interface that
    routes to the launch node (the one the step's hosts share; never all of them)."""
    if "GLOO_SOCKET_IFNAME" in env:
        return None, "GLOO_SOCKET_IFNAME was set"
    if world <= 1:
        return None, "one rank"
    nccl = env.get("NCCL_SOCKET_IFNAME", "").strip()
    target = env.get("SLURM_LAUNCH_NODE_IPADDR") or str(job.get("master_addr") or "")
    if nccl and (named := gloo_ifname_from_nccl(nccl, choose_ifname(target) if target else None))[0]:
        return named  # NCCL's prefix, exact or exclusion form, resolved to one exact name here
    if job.get("socket_ifname") == "auto" and target:
        ifname = choose_ifname(target)
        others = fabric_candidates(exclude=ifname)
        if ifname and len(others) == 1:
            return others[0], (f"the one other network besides {ifname}, which routes to the launch node {target} "
                               "(a site's management network)")
        if ifname:
            more = (f"; other networks here: {', '.join(others)}: set GLOO_SOCKET_IFNAME to the fabric's"
                    if others else "")
            return ifname, f"routes to the launch node {target}{more}"
    return None, "gloo's default"


def _choose_gloo_interface(job: dict[str, Any], world: int) -> str:
    """Set ``GLOO_SOCKET_IFNAME`` for a step rank (``gloo_interface``); why it is what it is."""
    ifname, why = gloo_interface(job, world, os.environ)
    if ifname:
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    return why


def _node_local_store(name: str) -> str:
    """The file store of a one-node step's ranks: on the node's memory file system, named by the
    attempt's random rendezvous id (every rank reads it from the job file; no stale store of an earlier
    job, of a cluster whose job ids started again, is ever joined), never on the shared file system."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, f"hpoflow-step-{name}.store")


def _run(job: dict[str, Any], files: TrialFiles, rank: int, world: int, local: int, threads: int, *,
         store: str = "", announce: str = "", socket_channel: bool = False) -> int:
    """Run this rank (``run_rank``, rank 0 with the file channel) and write its outcome."""
    from hpoflow.train.runner import run_rank
    from hpoflow.train.transport import Channel, FileChannel, NullChannel
    from hpoflow.trial import RankJob

    rj = RankJob(_request(job), rank, world, local, str(job["master_addr"]), int(job["master_port"]), threads,
                 float(job.get("pg_timeout_s", 120.0)), store or str(job.get("store") or ""),
                 announce or str(job.get("announce") or ""))
    timeout = float(job.get("answer_timeout_s", 600.0))
    channel: Channel = NullChannel()
    if rank == 0 and socket_channel and job.get("control"):  # a step: rank 0 connects to the engine
        from hpoflow.train.transport import SocketChannel

        host, port, token = str(job["control"]).split()
        env = os.environ
        where = {"step": env.get("SLURM_STEP_ID", ""), "nodes": env.get("SLURM_STEP_NODELIST", ""),
                 "host": env.get("SLURMD_NODENAME") or os.uname().nodename}
        if host == "*":  # the driver listens on every address of its host: the one SLURM launched the step from
            host = env.get("SLURM_LAUNCH_NODE_IPADDR") or socket.gethostname()
        channel = SocketChannel(files, timeout, hello=where, engine=f"{host} {port} {token}")
    elif rank == 0:
        channel = FileChannel(files, timeout)
    outcome = run_rank(rj, channel)
    host = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
    write_json_atomic(files.outcome(rank), {**dataclasses.asdict(outcome), "host": host})
    return 0 if outcome.status in ("ok", "pruned") else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpoflow.engines.cluster.node")
    sub = p.add_subparsers(dest="mode", required=True)
    n = sub.add_parser("node")
    n.add_argument("--job", required=True)
    n.add_argument("--hosts", default="")
    n.add_argument("--node-index", type=int)
    n.add_argument("--index-from", choices=["hosts", "mpi"], default="hosts")
    n.set_defaults(func=_node)
    r = sub.add_parser("rank")
    r.add_argument("--job", required=True)
    r.add_argument("--rank", type=int, required=True)
    r.add_argument("--local-rank", type=int, default=0)
    r.add_argument("--cores", default="")
    r.set_defaults(func=_rank)
    st = sub.add_parser("step")
    st.add_argument("--job", required=True)
    st.set_defaults(func=_step)
    args = p.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
