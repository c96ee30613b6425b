"""Many node agents in few processes, speaking the real protocol to a real ``AgentFleet``: the scale
harness of tests/engines/agent/test_fleet_scale.py and bench/agent_fleet.py.

Each simulated agent is one TCP connection that proves the run's secret (``protocol.connect``, the
agents' own code), says ``hello`` and ``warm``, sends a heartbeat every ``--heartbeat-s`` (the interval
the driver passes), and answers each ``start`` with a ``complete`` result ``--trial-s`` later; it ends
at ``exit`` or when the driver's connection closes. Torch-free: a process of this module imports the
protocol and the standard library only, and serves ``--count`` agents from one selector.

``fake_srun(bin_dir)`` writes an ``srun`` that the fleet starts as its agents' step: it reads the
fleet's own argv (``--port``, ``--host``, ``--heartbeat-s``, ``--nodelist``) and runs the agents of
``HPOFLOW_SWARM_NODES`` (comma-separated node names) in ``HPOFLOW_SWARM_PROCS`` processes of this
module. ``HPOFLOW_SWARM_FAIL=1`` makes it exit 1 at once, as an agent step that cannot start does;
``HPOFLOW_SWARM_IDLE=1`` makes the first step start no agent and run until killed (the test then plays
the agents; a later step, a relaunch on one node, does start its agent).
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import random
import selectors
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpoflow.engines.agent.protocol import SECRET_ENV, Link, connect
from hpoflow.engines.slurm.agents import AgentFleet
from hpoflow.engines.slurm.allocation import Allocation
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.trial import TrialRequest, TrialResult

__all__ = ["fake_srun", "fleet", "main", "request", "run_trials", "swarm_env"]

ROOT = Path(__file__).resolve().parents[3]

_SRUN = '''#!{python}
"""A fake srun for the agent swarm (tests/engines/agent/swarm.py): runs the step's agents as swarm processes."""
import os, subprocess, sys
argv = sys.argv[1:]
if os.environ.get("HPOFLOW_SWARM_FAIL"):
    print("srun: error: the swarm's agents cannot start (HPOFLOW_SWARM_FAIL)", file=sys.stderr)
    sys.exit(1)
if os.environ.get("HPOFLOW_SWARM_IDLE") and "--overlap" not in argv:  # the test is the agents
    import time
    time.sleep(3600)
def value(flag, default=""):
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return default
nodes = value("--nodelist") or os.environ["HPOFLOW_SWARM_NODES"]
nodes = nodes.split(",")
procs = max(1, min(len(nodes), int(os.environ.get("HPOFLOW_SWARM_PROCS", "4"))))
per = -(-len(nodes) // procs)
children = []
for k in range(procs):
    part = nodes[k * per:(k + 1) * per]
    if part:
        children.append(subprocess.Popen([{python!r}, "-m", "tests.engines.agent.swarm", "--port", value("--port"),
                                          "--host", value("--host") or "127.0.0.1", "--heartbeat-s",
                                          value("--heartbeat-s", "1"), "--nodes", ",".join(part)],
                                         cwd={root!r}))
sys.exit(max(c.wait() for c in children))
'''


def fake_srun(bin_dir: Path) -> Path:
    """Write the fake ``srun`` into ``bin_dir`` (put it first on the fleet's ``PATH``); its path."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "srun"
    path.write_text(_SRUN.format(python=sys.executable, root=str(ROOT)))
    path.chmod(0o755)
    return path


class _Swarm:
    def __init__(self, links: dict[str, Link], heartbeat_s: float, trial_s: float) -> None:
        self.sel = selectors.DefaultSelector()
        self.links = links
        self.trial_s = trial_s
        self.heartbeat_s = heartbeat_s
        self.timers: list[tuple[float, int, str, dict[str, Any] | None]] = []  # (when, seq, node, message)
        self.seq = 0
        now = time.monotonic()
        for node, link in links.items():
            self.sel.register(link.sock, selectors.EVENT_READ, node)
            self._at(now + random.uniform(0, heartbeat_s), node, None)  # heartbeats spread over the interval

    def _at(self, when: float, node: str, msg: dict[str, Any] | None) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (when, self.seq, node, msg))

    def run(self) -> None:
        while self.links:
            now = time.monotonic()
            while self.timers and self.timers[0][0] <= now:
                _, _, node, msg = heapq.heappop(self.timers)
                link = self.links.get(node)
                if link is None:
                    continue
                if msg is None:
                    link.send({"kind": "heartbeat"})
                    self._at(now + self.heartbeat_s, node, None)
                else:
                    link.send(msg)
            wait = max(0.0, min(1.0, self.timers[0][0] - now)) if self.timers else 1.0
            for key, _ in self.sel.select(wait):
                self._read(str(key.data))

    def _read(self, node: str) -> None:
        link = self.links[node]
        for msg in link.read():
            kind = msg.get("kind")
            if kind == "start":
                request = json.loads(str(msg["request"]))
                number = int(request["number"])
                result = {"number": number, "status": "complete", "value": float(number), "metrics": {},
                          "error": None, "stderr_tail": "", "timings": {"duration_s": self.trial_s},
                          "retryable": False, "system": {}}
                self._at(time.monotonic() + self.trial_s, node, {"kind": "result", "number": number, "result": result})
            elif kind == "exit":
                link.close()
        if link.closed:
            self.sel.unregister(link.sock)
            del self.links[node]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.engines.agent.swarm")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--heartbeat-s", type=float, default=1.0)
    p.add_argument("--trial-s", type=float, default=float(os.environ.get("HPOFLOW_SWARM_TRIAL_S", "0.01")))
    p.add_argument("--nodes", required=True)
    p.add_argument("--cpus", type=int, default=4)
    args = p.parse_args(argv)
    secret = os.environ.pop(SECRET_ENV, "")
    links: dict[str, Link] = {}
    for node in args.nodes.split(","):
        for attempt in range(50):  # as an agent does: again, with back-off (a listener's stage may be full)
            try:
                links[node] = connect(args.host, args.port, secret)
                break
            except OSError:
                time.sleep(min(2.0, 0.05 * 2 ** attempt))
        else:
            print(f"swarm: {node} cannot join the driver at {args.host}:{args.port}", file=sys.stderr)
            continue
        links[node].send({"kind": "hello", "node": node, "pid": os.getpid(), "cores": list(range(args.cpus)),
                          "gpus": []})
        links[node].send({"kind": "warm", "seconds": 0.0})
    _Swarm(links, args.heartbeat_s, args.trial_s).run()
    return 0


def fleet(n: int, run_dir: Path, *, procs: int = 4, fail: bool = False, idle: bool = False, cpus: int = 1,
          **options: Any) -> AgentFleet:
    """A real ``AgentFleet`` over ``n`` swarm agents (nodes ``s0000``...), ``cpus`` CPUs each, on loopback."""
    hosts = tuple(f"s{i:04d}" for i in range(n))
    allocation = Allocation("swarm", hosts, (cpus,) * n, 0)
    env = swarm_env(hosts, fake_srun(run_dir / "bin"), procs)
    if fail:
        env["HPOFLOW_SWARM_FAIL"] = "1"
    if idle:
        env["HPOFLOW_SWARM_IDLE"] = "1"
    opts = SlurmOptions(agents="on", mode="steps", **options)
    return AgentFleet(allocation, opts, run_dir, sys.executable, env, "swarm")


def request(number: int, run_dir: Path) -> TrialRequest:
    return TrialRequest(number, {}, {"function": "swarm:none"}, "value", "maximize",
                        str(run_dir / "trials" / str(number)))


def run_trials(f: AgentFleet, n: int, run_dir: Path, slots: int, limit_s: float) -> dict[int, int]:
    """Submit ``n`` trials, ``slots`` at a time, poll until every one ended (or ``limit_s``); how many
    complete results each trial number got."""
    done: dict[int, int] = {}
    submitted = 0
    inflight = 0
    end = time.monotonic() + limit_s
    while (submitted < n or inflight) and time.monotonic() < end:
        while submitted < n and inflight < slots:
            f.submit(request(submitted, run_dir))
            submitted += 1
            inflight += 1
        for event in f.poll(1.0):
            if isinstance(event, TrialResult):
                inflight -= 1
                if event.status == "complete":
                    done[event.number] = done.get(event.number, 0) + 1
    return done


def swarm_env(nodes: Sequence[str], srun: Path, procs: int = 4) -> dict[str, str]:
    """The environment to give the fleet: the fake ``srun`` first on ``PATH``, the swarm's nodes."""
    return {**os.environ, "PATH": f"{srun.parent}{os.pathsep}{os.environ.get('PATH', '')}",
            "HPOFLOW_SWARM_NODES": ",".join(nodes), "HPOFLOW_SWARM_PROCS": str(procs),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


if __name__ == "__main__":
    sys.exit(main())

