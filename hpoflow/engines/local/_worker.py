"""A worker process of the local engine: many trials run in it, one after the other.

A warm worker is forked from the engine's forkserver (torch and hpoflow preloaded by ``_preload``);
a light worker is a fresh interpreter without torch, ready in a fraction of a second, that runs
torch-free trials while the forkserver still preloads (see ``engine``). Either loops: receive a
rank job, run it, send the outcome, and reset the state a trial may have changed before the next:
environment, working directory, ``sys.path``, user modules (dropped from ``sys.modules`` so module
globals start fresh), torch global settings, thread counts and affinity (set per trial), signal
handlers, and any child processes the trial left behind. Seeds are set by the runner at the start
of every trial. A worker whose trial crashed, hung, timed out or was cancelled is killed by the
engine (with its whole process group) and replaced, never reused.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import os
import signal
import sys
import sysconfig
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpoflow.train.runner import run_rank
from hpoflow.train.transport import NullChannel, PipeChannel
from hpoflow.trial import RankJob

log = logging.getLogger(__name__)

__all__ = ["worker_main"]


_HPOFLOW_DIR = str(Path(__file__).resolve().parent.parent)
_LIBRARY_DIRS = tuple(
    str(Path(p).resolve())
    for p in {sys.prefix, sys.base_prefix, sys.exec_prefix, *sysconfig.get_paths().values()}
    if p
)


def _die_with_parent() -> None:
    """Linux: get SIGKILL when the forkserver (our parent) exits. It exits when the engine's process
    dies, so a killed driver never leaves workers training on as orphans."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def _redirect_output(path: str) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _is_user_module(module: Any) -> bool:
    """A module of the user's code: not hpoflow's, not from the interpreter's library dirs."""
    f = getattr(module, "__file__", None)
    if not f:
        return False
    f = str(Path(f).resolve())
    return not f.startswith(_HPOFLOW_DIR) and not f.startswith(_LIBRARY_DIRS)


@dataclasses.dataclass
class _Snapshot:
    env: dict[str, str]
    cwd: str
    path: list[str]
    modules: set[str]


def _reset(snap: _Snapshot) -> None:
    """Undo what a trial may have changed in this process (see the module docstring)."""
    for name in [n for n in sys.modules if n not in snap.modules]:
        if _is_user_module(sys.modules[name]):
            del sys.modules[name]
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
    _kill_children()
    gc.collect()


def _kill_children() -> None:
    """Kill processes a trial started and left running (they would outlive it in a reused worker)."""
    try:
        import psutil

        kids = psutil.Process().children(recursive=True)
    except Exception:  # psutil missing or /proc unreadable: nothing to clean
        return
    for k in kids:
        try:
            k.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(kids, timeout=2)


def worker_main(conn: Connection, worker_id: int) -> None:
    """Serve rank jobs from ``conn`` until told to exit or the pipe closes."""
    _die_with_parent()
    os.setsid()  # own process group: the engine kills the worker and all its children at once
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # the engine's pause request; a trial's rank handles it
    devnull = os.open(os.devnull, os.O_WRONLY)
    # multiprocessing's bootstrap re-imported the parent's __main__ here (with whatever it imports):
    # freeze that too, so the collection after each trial walks only the trial's own objects.
    gc.collect()
    gc.freeze()
    base = _Snapshot(dict(os.environ), os.getcwd(), list(sys.path), set())
    try:
        conn.send(("ready", os.getpid()))
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                return
            if msg[0] != "run":
                return
            job, env, cores, log_path = msg[1]
            base.modules = set(sys.modules)
            _run_one(conn, job, env, cores, log_path)
            os.dup2(devnull, 1)
            os.dup2(devnull, 2)
            _reset(base)
    except (BrokenPipeError, EOFError):  # the engine went away: nothing left to tell
        return
    finally:
        conn.close()


def _run_one(conn: Connection, job: RankJob, env: dict[str, str], cores: tuple[int, ...], log_path: str) -> None:
    _redirect_output(log_path)
    os.environ.update(env)
    if cores and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cores)
        except OSError as exc:  # a container may forbid it; threads are still capped
            log.warning("could not pin rank %d to cores %s: %s", job.rank, cores, exc)
    channel = PipeChannel(conn) if job.rank == 0 else NullChannel()
    outcome = run_rank(job, channel)
    conn.send(("outcome", dataclasses.asdict(outcome)))
