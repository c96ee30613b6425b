"""A worker process of the local engine: many trials run in it, one after the other.

A warm worker is forked from the engine's forkserver (torch and hpoflow preloaded by ``_preload``);
a light worker is a fresh interpreter without torch, ready in a fraction of a second, that runs
torch-free trials while the forkserver still preloads (see ``engine``). Neither runs the parent's
``__main__`` (``hpoflow.engines.proc.start_without_main``). Either loops: receive a rank job and the
write end of its log pipe (``hpoflow.engines.logcap``: the engine caps the log), run it, then close
the pipe, kill and reap every process the trial left (the worker is their child subreaper, so a
double fork with ``setsid`` does not escape), send the outcome, and reset the state a trial may have
changed before the next: environment, working directory, ``sys.path``, the trial's own modules
(dropped from ``sys.modules`` so module globals start fresh; libraries stay, see ``_modules``),
torch global settings, thread counts and affinity (set per trial), and signal handlers. Seeds are set
by the runner at the start of every trial. Before each trial ``multiprocessing``'s state becomes a fresh
main process's (``hpoflow.train.processes.become_main_process``: not daemonic, no resource tracker or
forkserver of the engine's), so a trial starts DataLoader workers, a ``Pool`` or ``mp.spawn`` as a
program does; what they leave is reaped with the trial. A worker whose trial crashed, hung, timed out or was
cancelled is killed by the engine (with its whole tree) and replaced, never reused. A worker whose
engine dies (a driver killed with SIGKILL, alone) kills what its trial runs, daemons included, then
itself (``_die_with_engine``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import os
import select
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle

from hpoflow.engines.local._modules import ModuleKeeper, cache_bytecode
from hpoflow.engines.proc import become_subreaper, reap_descendants, unblock_sigint
from hpoflow.train.processes import become_main_process
from hpoflow.train.runner import run_rank
from hpoflow.train.transport import NullChannel, PipeChannel
from hpoflow.trial import RankJob, RankOutcome

log = logging.getLogger(__name__)

__all__ = ["worker_main"]


def _die_with_engine(conn: Connection) -> None:
    """Start a thread that, when the engine's process dies (even by SIGKILL: the engine's end of
    ``conn`` closes) or this worker's parent exits (the forkserver, which exits with the engine; for
    a light worker the engine's process itself), kills and reaps every process below this worker,
    then kills the worker with SIGKILL. This worker is its trials' child subreaper, so that includes
    a daemon a trial started with a double fork and ``setsid``: it would go to init, out of reach of
    any engine and of the resume, were the worker to die first (as with ``PR_SET_PDEATHSIG``, which
    this replaces). The thread watches descriptors of its own (a duplicate of the pipe, a pidfd of
    the parent), so nothing the trial does to the worker's descriptors blinds it. It needs the GIL
    to act: a trial inside C code that holds the GIL delays it until that call returns."""
    watch = select.poll()
    pipe = os.dup(conn.fileno())  # close-on-exec, like every descriptor os.dup makes
    watch.register(pipe, getattr(select, "POLLRDHUP", 0))  # POLLHUP (the peer closed) is always reported
    parent = os.getppid()
    with contextlib.suppress(AttributeError, OSError):  # no pidfd (Linux < 5.3): the pipe alone
        watch.register(os.pidfd_open(parent), select.POLLIN)  # readable once the parent has exited
    orphaned = os.getppid() != parent  # the parent exited before its pidfd was opened

    def wait_then_clean_up() -> None:
        if not orphaned:
            watch.poll()  # returns on one of the events above only (POLLIN of the pipe is not asked for)
        reap_descendants()
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=wait_then_clean_up, name="hpoflow-engine-watch", daemon=True).start()


def _keep_fds_to_self() -> None:
    """Mark every descriptor this worker inherited (its pipe to the engine, the resource tracker's)
    close-on-exec: a program a trial starts never holds them (a daemon holding them would keep the
    engine's pipes, and a pipe reader such as ``hpoflow run | cat``, waiting)."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        if fd > 2:
            try:
                os.set_inheritable(fd, False)
            except OSError:  # the listing's own descriptor, closed by now
                pass


@dataclasses.dataclass
class _Snapshot:
    env: dict[str, str]
    cwd: str
    path: list[str]


# A trial this long or longer is followed by a full collection (below it, the young generations only)
FULL_GC_AFTER_S = 1.0


def _reset(snap: _Snapshot, keeper: ModuleKeeper, job: RankJob, ran_s: float) -> None:
    """Undo what a trial may have changed in this process (see the module docstring), and collect its
    garbage: all of it (a full collection: 0.3-0.7 ms, though the freeze leaves it a few thousand objects
    to walk) after a trial of ``FULL_GC_AFTER_S`` or more, or one that used CUDA (its garbage in reference
    cycles may hold device memory the interpreter does not count); after a shorter CPU trial, the young
    generations only (~20 us, on the path to the next trial: what such a trial leaves is young, and what
    it promoted waits for the interpreter's own full collection or the next long trial's)."""
    for name in keeper.trial_modules(job.request.python_path, job.request.train.get("function")):
        sys.modules.pop(name, None)
    sys.path[:] = snap.path
    os.environ.clear()
    os.environ.update(snap.env)
    try:
        os.chdir(snap.cwd)
    except OSError:
        pass
    torch = sys.modules.get("torch")
    if torch is not None:  # a light worker whose trials never imported torch has nothing to reset
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        torch.use_deterministic_algorithms(False)
        torch.autograd.set_detect_anomaly(False)
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = False
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # a pause request (the engine's) that came too late
    signal.alarm(0)
    if ran_s >= FULL_GC_AFTER_S or (torch is not None and torch.cuda.is_initialized()):
        gc.collect()
    else:
        gc.collect(1)


def worker_main(conn: Connection, worker_id: int) -> None:
    """Serve rank jobs from ``conn`` until told to exit or the pipe closes."""
    os.setsid()  # own process group: the engine kills the worker and all its children at once
    unblock_sigint()  # out of the terminal's group now: a trial sees SIGINT as any process does
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the engine's pause request; a trial's rank handles it
    become_subreaper()  # orphaned descendants of a trial stay below this worker (reap_descendants)
    cache_bytecode()  # the trial's modules are imported anew for each trial: compiled once, not each time
    _die_with_engine(conn)  # ... and die with it when the engine dies
    _keep_fds_to_self()
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    # Freeze what the worker holds now, so the collection after each trial walks only the trial's own
    # objects.
    gc.collect()
    gc.freeze()
    base = _Snapshot(dict(os.environ), os.getcwd(), list(sys.path))
    keeper = ModuleKeeper(base.path)
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] != "run":
                return
            job, env, cores = msg[1]
            out = recv_handle(conn)  # the write end of the rank's log pipe (the engine reads the other)
            keeper.start_trial()
            began = time.monotonic()
            outcome = _run_one(conn, job, env, cores, out)
            os.dup2(devnull, 1)  # the log pipe's last write ends: here, and in what the trial left running
            os.dup2(devnull, 2)
            reap_descendants()
            conn.send(("outcome", dataclasses.asdict(outcome)))
            _reset(base, keeper, job, time.monotonic() - began)
    except (BrokenPipeError, EOFError):  # the engine went away: nothing left to tell
        return
    finally:
        conn.close()


def _run_one(conn: Connection, job: RankJob, env: dict[str, str], cores: tuple[int, ...], out: int) -> RankOutcome:
    become_main_process()  # the trial may start processes (DataLoader workers, Pool, mp.spawn); see that function
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.environ.update(env)
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:  # a container may forbid it; threads are still capped
            log.warning("could not pin rank %d to cores %s: %s", job.rank, cores, exc)
    if job.announce_path or os.environ.get("HPOFLOW_AGENT_NODE"):  # a node agent's rank says where it runs
        from hpoflow.engines.cluster.node import host_addresses

        ifname = os.environ.get("GLOO_SOCKET_IFNAME")
        node = os.environ.get("HPOFLOW_AGENT_NODE") or os.uname().nodename
        print(f"hpoflow: rank {job.rank} of {job.world_size} (local rank {job.local_rank}) on node {node} "
              f"({host_addresses(ifname)}) in its node agent's worker (pid {os.getpid()}), gloo interface "
              f"{ifname or 'default'}",
              file=sys.stderr, flush=True)
    channel = PipeChannel(conn) if job.rank == 0 else NullChannel()
    return run_rank(job, channel)
