"""A node agent: one long-lived process per node that runs the local engine's warm pool and starts the
ranks of trials the driver sends it.

``python -m hpoflow.engines.agent --port PORT [--host HOST]``, one task per node of the slurm engine's
agents step (``srun --ntasks-per-node=1`` over the whole allocation). It reads the run's secret from
``HPOFLOW_AGENT_SECRET`` and removes it from its environment before anything starts, connects to the
driver at ``HOST:PORT`` (default host: ``SLURM_LAUNCH_NODE_IPADDR``, the node the driver started the
step from) and proves it holds the secret (``protocol``). It is a ``LocalEngine`` on this node's CPUs
and GPUs (those of the step's task): the forkserver imports torch once, warm workers run trial after
trial, each rank pinned to its cores and GPUs and reset after its trial; the engine's own checks stand
(a rank that dies fails its trial only; ``resources.timeout``; a pause is SIGUSR1 to the ranks).

Messages from the driver (JSON objects, ``kind``): ``start`` (the request, and for a trial on several
nodes this node's share: first rank, ranks, world, the file where the trial's rank 0 announces its TCP
store), ``answer`` (prune / pause), ``cancel``, ``pause``, ``exit``. To the driver: ``hello`` (the
node, its CPUs and GPUs), ``warm`` (the forkserver has preloaded and the workers are forked),
``report``, ``result`` and ``heartbeat`` every ``--heartbeat-s`` (the driver scales it with the fleet).

Start-up and liveness: the agent imports what it needs (the shared file system's slow part) before it
connects, then connects with retries and back-off for ``--connect-timeout-s`` (the driver may still be
starting, or its listener may have evicted this connection in a flood). A heartbeat says the serving
loop turns, not only that the process lives: it stops when the loop is stuck (``SERVE_STALL_S``) other
than waiting for the warm pool, and the driver then loses the agent. The driver pings as often; the
agent ends, killing its ranks, when the driver's connection closes, when it says nothing for
``--driver-timeout-s`` (its node lost the driver's), or on ``exit``; the step's end kills it and every
rank (they are in its cgroup). An error while starting a trial (a full ``/dev/shm``, any exception)
fails that trial and the agent serves on.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from hpoflow.engines.agent.protocol import SECRET_ENV, Link, connect

__all__ = ["connect_retrying", "main"]

HEARTBEAT_S = 1.0
MEMORY_WATCH_S = 0.5  # how often the agent looks at its ranks' memory
SERVE_STALL_S = 10.0  # a serving loop that has not turned for this long (not waiting for warm) stops heartbeats
CONNECT_TIMEOUT_S = 900.0  # how long an agent tries to reach the driver (a 1,000-node step starts in minutes)
DRIVER_TIMEOUT_S = 30.0  # an agent that hears nothing from its driver this long ends
_BACKOFF_S = (0.2, 5.0)  # first and longest wait between connection attempts (doubling, with jitter)


def _log(msg: str) -> None:
    print(f"hpoflow-agent[{os.getpid()}]: {msg}", file=sys.stderr, flush=True)


def _slots() -> list[int]:
    """The CPU slots of this agent: the CPUs it may run on (its affinity), as many as SLURM gave its task
    (``SLURM_CPUS_PER_TASK``). Where SLURM binds no task to its CPUs (``TaskPlugin=task/none``) and the
    node declares more CPUs than the affinity holds, the CPUs are listed again (a slot per CPU SLURM
    counts, sharing the cores), so the agent runs what the driver planned with SLURM's count."""
    from hpoflow.engines.machine import machine_cores

    cores = machine_cores()
    given = os.environ.get("SLURM_CPUS_PER_TASK", "")
    want = int(given) if given.isascii() and given.isdigit() else len(cores)
    if want > len(cores):
        _log(f"SLURM gives this task {want} CPUs but its affinity holds {len(cores)} ({cores}): slots share them")
        return [cores[i % len(cores)] for i in range(want)]
    return cores


def connect_retrying(host: str, port: int, secret: str, timeout_s: float) -> Link:
    """The driver's link, trying again with back-off (doubling from 0.2 s to 5 s, with jitter, so a
    thousand agents do not come back together) until ``timeout_s``; the last error after that."""
    end = time.monotonic() + timeout_s
    wait_s, tries = _BACKOFF_S[0], 0
    while True:
        tries += 1
        try:
            return connect(host, port, secret)
        except OSError as exc:  # (AuthError too: a dropped challenge looks the same as a wrong secret)
            left = end - time.monotonic()
            if left <= 0:
                raise ConnectionError(f"{exc} (after {tries} attempt(s) in {timeout_s:g} s)") from exc
            if tries == 1:
                _log(f"cannot join the driver at {host}:{port} yet ({exc}): trying again for {timeout_s:g} s")
            time.sleep(min(left, wait_s * random.uniform(0.5, 1.5)))
            wait_s = min(_BACKOFF_S[1], wait_s * 2)


class _Agent:
    def __init__(self, pg_timeout_s: float, socket_ifname: str, heartbeat_s: float = HEARTBEAT_S,
                 driver_timeout_s: float = DRIVER_TIMEOUT_S) -> None:
        from hpoflow.engines.cluster.node import gloo_interface
        from hpoflow.engines.local import LocalEngine

        self.link: Link | None = None
        self.heartbeat_s = heartbeat_s
        self.driver_timeout_s = driver_timeout_s
        self._tick = time.monotonic()  # the serving loop's last turn
        self._starting = False  # in engine.start (which may wait for the warm pool)
        self.node = os.environ.get("SLURMD_NODENAME") or os.uname().nodename
        os.environ["HPOFLOW_AGENT_NODE"] = self.node  # its ranks' logs say where they ran (the pool inherits it)
        self.engine = LocalEngine(cores=_slots(), pg_timeout_s=pg_timeout_s)  # the warm pool starts preloading now
        ifname, self.gloo_why = gloo_interface({"socket_ifname": socket_ifname}, 2, os.environ)
        self.gloo_env = {"GLOO_SOCKET_IFNAME": ifname} if ifname else {}
        self.warm_s: float | None = None
        self.memory_mb: dict[int, int] = {}  # trial -> the memory each of its ranks may hold here (0: no limit)
        self._next_watch = 0.0
        self._t0 = time.monotonic()
        self._done = threading.Event()
        threading.Thread(target=self._wait_warm, name="hpoflow-agent-warm", daemon=True).start()

    def serving(self) -> bool:
        """Whether the serving loop turns: it did within ``SERVE_STALL_S``, or it waits in a trial's start
        for the warm pool (the forkserver still imports torch)."""
        if time.monotonic() - self._tick < SERVE_STALL_S:
            return True
        return self._starting and self.warm_s is None

    def _beat(self) -> None:
        link = self.link
        while link is not None and not self._done.is_set():
            if self.serving() and not link.send({"kind": "heartbeat"}):
                return
            self._done.wait(self.heartbeat_s)

    def _wait_warm(self) -> None:
        if self.engine.wait_warm(None):
            self.warm_s = time.monotonic() - self._t0

    def hello(self, link: Link) -> None:
        self.link = link
        e = self.engine
        link.send({"kind": "hello", "node": self.node, "pid": os.getpid(), "cores": list(e.cores),
                   "gpus": [str(g) for g in e.gpus], "gloo": self.gloo_env.get("GLOO_SOCKET_IFNAME", ""),
                   "gloo_why": self.gloo_why})
        # heartbeats (after the hello: the driver's first message from an agent must be it) from a thread
        # of their own: the serving loop may wait seconds for a warm worker (a torch trial sent while the
        # forkserver still preloads), and the agent is alive meanwhile
        threading.Thread(target=self._beat, name="hpoflow-agent-heartbeat", daemon=True).start()

    def handle(self, msg: dict[str, Any]) -> bool:
        """Act on one message from the driver; False when told to exit. An error here (a message this
        agent cannot act on, a trial it cannot start) is that message's: a trial's start fails the trial,
        anything else is logged; the agent serves on."""
        try:
            return self._handle(msg)
        except Exception as exc:
            number = msg.get("number")
            if msg.get("kind") == "start":
                self._start_failed(msg, exc)
            else:
                _log(f"could not act on the driver's {msg.get('kind')!r} message for trial {number}: "
                     f"{type(exc).__name__}: {exc}")
            return True

    def _start_failed(self, msg: dict[str, Any], exc: BaseException) -> None:
        from hpoflow.errors import EngineError
        from hpoflow.trial import TrialRequest, TrialResult

        try:
            number = TrialRequest.from_json(str(msg["request"])).number
        except Exception:
            number = int(msg.get("number", -1)) if isinstance(msg.get("number"), int) else -1
        why = str(exc) if isinstance(exc, EngineError) else f"{type(exc).__name__}: {exc}"
        _log(f"trial {number} failed to start: {why}")
        if self.link is not None:
            # not an EngineError (a full /dev/shm, an OSError): a fault of this node, retried elsewhere
            self.link.send({"kind": "result", "number": number, "result": TrialResult(
                number, "failed", error=f"its node agent on {self.node} could not start it: {why}",
                retryable=not isinstance(exc, EngineError)).to_dict(),
                "node_fault": not isinstance(exc, EngineError)})

    def _handle(self, msg: dict[str, Any]) -> bool:
        from hpoflow.engines.local import RankShare
        from hpoflow.trial import TrialRequest

        kind = msg.get("kind")
        number = int(msg.get("number", -1))
        if kind == "start":
            request = TrialRequest.from_json(str(msg["request"]))
            s = msg.get("share")
            share = None if not s else RankShare(int(s["first_rank"]), int(s["ranks"]), int(s["world"]),
                                                 str(s["announce"]), {**self.gloo_env})
            free = (list(self.engine.free_cores), dict(self.engine.free_gpus))
            self._starting = True
            try:
                self.engine.start(request, share)
            except BaseException:
                if request.number not in self.engine.running():  # give back the slots it took first
                    self.engine.free_cores, self.engine.free_gpus = free
                raise
            finally:
                self._starting = False
            self.memory_mb[request.number] = int(msg.get("memory_mb") or 0)
        elif kind == "answer":
            self.engine.answer(number, bool(msg.get("prune")), bool(msg.get("pause")))
        elif kind == "cancel":
            self.engine.cancel(number, str(msg.get("reason") or "cancelled"))
        elif kind == "pause":
            self.engine.pause(number, str(msg.get("reason") or "paused"))
        elif kind == "exit":
            return False
        return True

    def serve(self) -> None:
        from hpoflow.engines.base import TrialReport

        link = self.link
        if link is None:
            return
        warm_sent = False
        heard = time.monotonic()
        while True:
            self._tick = time.monotonic()
            msgs = link.read()
            if msgs:
                heard = self._tick
            for msg in msgs:
                if not self.handle(msg):
                    return
            if link.closed:
                _log(f"the driver's connection closed{f' ({link.error})' if link.error else ''}: stopping")
                return
            if self._tick - heard > self.driver_timeout_s:
                _log(f"no word from the driver for {self._tick - heard:.0f} s (--driver-timeout-s "
                     f"{self.driver_timeout_s:g}): it is gone; stopping")
                return
            if not warm_sent and self.warm_s is not None:
                warm_sent = True
                link.send({"kind": "warm", "seconds": self.warm_s})
            wait_s = 1.0 if warm_sent else 0.1
            if self.engine.running():
                events = self.engine.poll(wait_s, wake=[link.sock])
            else:
                wait([link.sock], wait_s)
                events = []
            self._watch_memory()
            for e in events:
                if isinstance(e, TrialReport):
                    link.send({"kind": "report", "number": e.number, "step": e.step, "metrics": e.metrics,
                                    "wants": e.wants_answer})
                else:
                    self.memory_mb.pop(e.number, None)
                    link.send({"kind": "result", "number": e.number, "result": e.to_dict()})

    def _watch_memory(self) -> None:
        """Every ``MEMORY_WATCH_S``: a rank whose private memory is over its trial's share (what a step
        of its own would have asked SLURM for) fails its trial, as a step's cgroup would have killed it;
        the agent and the other trials go on."""
        now = time.monotonic()
        if now < self._next_watch:
            return
        self._next_watch = now + MEMORY_WATCH_S
        for number, limit in list(self.memory_mb.items()):
            if not limit:
                continue
            for rank, used in self.engine.private_memory_mb(number).items():
                if used > limit:
                    self.engine.fail(number, f"rank {rank} on {self.node} held {used:.0f} MB of memory, more than "
                                     f"the {limit} MB a rank of this trial may (resources.memory_gb, else its CPUs' "
                                     "share of the node's memory): stopped by its node agent. Fix: raise "
                                     "resources.memory_gb, or lower what a rank holds")
                    break

    def close(self) -> None:
        self._done.set()
        self.engine.close()
        if self.link is not None:
            self.link.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpoflow.engines.agent")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="")
    p.add_argument("--pg-timeout-s", type=float, default=120.0)
    p.add_argument("--socket-ifname", choices=["auto", "none"], default="auto")
    p.add_argument("--heartbeat-s", type=float, default=HEARTBEAT_S)
    p.add_argument("--connect-timeout-s", type=float, default=CONNECT_TIMEOUT_S)
    p.add_argument("--driver-timeout-s", type=float, default=DRIVER_TIMEOUT_S)
    args = p.parse_args(argv)
    secret = os.environ.pop(SECRET_ENV, "")  # nothing this agent starts inherits it
    if not secret:
        _log(f"{SECRET_ENV} is not set: an agent needs the run's secret in its environment")
        return 2
    host = args.host or os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "")
    if not host:
        _log("no driver address: pass --host, or run as a task of a SLURM step (SLURM_LAUNCH_NODE_IPADDR)")
        return 2
    # the imports (and the warm pool's start) first: on a cold shared file system they are the slow part
    agent = _Agent(args.pg_timeout_s, args.socket_ifname, args.heartbeat_s, args.driver_timeout_s)
    try:
        try:
            link = connect_retrying(host, args.port, secret, args.connect_timeout_s)
        except OSError as exc:
            _log(f"cannot join the driver at {host}:{args.port}: {exc}")
            return 1
        del secret
        agent.hello(link)
        _log(f"serving the driver at {host}:{args.port} on {agent.node} ({len(agent.engine.cores)} CPU(s), "
             f"{len(agent.engine.gpus)} GPU(s); gloo: {agent.gloo_env or 'default'}: {agent.gloo_why})")
        agent.serve()
    finally:
        agent.close()
    return 0
