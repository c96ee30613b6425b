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
``report``, ``result`` and ``heartbeat`` every ``--heartbeat-s``. The agent ends, killing its ranks,
when the driver's connection closes; the step's end kills it and every rank (they are in its cgroup).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import wait
from typing import Any

from hpoflow.engines.agent.protocol import SECRET_ENV, AuthError, Link, connect

__all__ = ["main"]

HEARTBEAT_S = 1.0
MEMORY_WATCH_S = 0.5  # how often the agent looks at its ranks' memory


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


class _Agent:
    def __init__(self, link: Link, pg_timeout_s: float, socket_ifname: str) -> None:
        from hpoflow.engines.cluster.node import gloo_interface
        from hpoflow.engines.local import LocalEngine

        self.link = link
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

    def _beat(self) -> None:
        while not self._done.is_set() and self.link.send({"kind": "heartbeat"}):
            self._done.wait(HEARTBEAT_S)

    def _wait_warm(self) -> None:
        if self.engine.wait_warm(None):
            self.warm_s = time.monotonic() - self._t0

    def hello(self) -> None:
        e = self.engine
        self.link.send({"kind": "hello", "node": self.node, "pid": os.getpid(), "cores": list(e.cores),
                        "gpus": [str(g) for g in e.gpus], "gloo": self.gloo_env.get("GLOO_SOCKET_IFNAME", ""),
                        "gloo_why": self.gloo_why})
        # heartbeats (after the hello: the driver's first message from an agent must be it) from a thread
        # of their own: the serving loop may wait seconds for a warm worker (a torch trial sent while the
        # forkserver still preloads), and the agent is alive meanwhile
        threading.Thread(target=self._beat, name="hpoflow-agent-heartbeat", daemon=True).start()

    def handle(self, msg: dict[str, Any]) -> bool:
        """Act on one message from the driver; False when told to exit."""
        from hpoflow.engines.local import RankShare
        from hpoflow.errors import EngineError
        from hpoflow.trial import TrialRequest, TrialResult

        kind = msg.get("kind")
        number = int(msg.get("number", -1))
        if kind == "start":
            request = TrialRequest.from_json(str(msg["request"]))
            s = msg.get("share")
            share = None if not s else RankShare(int(s["first_rank"]), int(s["ranks"]), int(s["world"]),
                                                 str(s["announce"]), {**self.gloo_env})
            try:
                self.engine.start(request, share)
                self.memory_mb[request.number] = int(msg.get("memory_mb") or 0)
            except EngineError as exc:
                self.link.send({"kind": "result", "number": request.number,
                                "result": TrialResult(request.number, "failed", error=str(exc)).to_dict()})
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

        warm_sent = False
        while True:
            for msg in self.link.read():
                if not self.handle(msg):
                    return
            if self.link.closed:
                _log("the driver's connection closed: stopping")
                return
            if not warm_sent and self.warm_s is not None:
                warm_sent = True
                self.link.send({"kind": "warm", "seconds": self.warm_s})
            wait_s = 1.0 if warm_sent else 0.1
            if self.engine.running():
                events = self.engine.poll(wait_s, wake=[self.link.sock])
            else:
                wait([self.link.sock], wait_s)
                events = []
            self._watch_memory()
            for e in events:
                if isinstance(e, TrialReport):
                    self.link.send({"kind": "report", "number": e.number, "step": e.step, "metrics": e.metrics,
                                    "wants": e.wants_answer})
                else:
                    self.memory_mb.pop(e.number, None)
                    self.link.send({"kind": "result", "number": e.number, "result": e.to_dict()})

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
        self.link.close()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m hpoflow.engines.agent")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="")
    p.add_argument("--pg-timeout-s", type=float, default=120.0)
    p.add_argument("--socket-ifname", choices=["auto", "none"], default="auto")
    args = p.parse_args(argv)
    secret = os.environ.pop(SECRET_ENV, "")  # nothing this agent starts inherits it
    if not secret:
        _log(f"{SECRET_ENV} is not set: an agent needs the run's secret in its environment")
        return 2
    host = args.host or os.environ.get("SLURM_LAUNCH_NODE_IPADDR", "")
    if not host:
        _log("no driver address: pass --host, or run as a task of a SLURM step (SLURM_LAUNCH_NODE_IPADDR)")
        return 2
    try:
        link = connect(host, args.port, secret)
    except (AuthError, OSError) as exc:
        _log(f"cannot join the driver at {host}:{args.port}: {exc}")
        return 1
    del secret
    agent = _Agent(link, args.pg_timeout_s, args.socket_ifname)
    try:
        agent.hello()
        _log(f"serving the driver at {host}:{args.port} on {agent.node} ({len(agent.engine.cores)} CPU(s), "
             f"{len(agent.engine.gpus)} GPU(s); gloo: {agent.gloo_env or 'default'}: {agent.gloo_why})")
        agent.serve()
    finally:
        agent.close()
    return 0
