"""The agents' driver (``AgentFleet``) on this machine, its step a fake ``srun`` (tests/engines/agent/swarm.py):
start-up and liveness, and what it takes from an authenticated agent that misbehaves. Where a test plays
an agent itself, it speaks the real protocol on loopback."""

from __future__ import annotations

import socket
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines.agent.protocol import Link, connect
from hpoflow.engines.slurm.agents import AgentFleet, FleetError, heartbeat_interval
from hpoflow.trial import TrialRequest, TrialResult
from tests.conftest import ROOT
from tests.engines.agent.swarm import fleet, request, run_trials

# bounds a hang, not a speed: each wait here is for a loopback message or a fake srun's start (tens of ms
# on a quiet machine, seconds with other work on both of its cores)
LIMIT_S = 60.0


@pytest.fixture
def closing() -> Iterator[list[AgentFleet]]:
    fleets: list[AgentFleet] = []
    yield fleets
    for f in fleets:
        f.close(0.5)


def _join(f: AgentFleet, node: str, *, warm: bool = True) -> Link:
    """Play node ``node``'s agent: prove the secret, say hello (and warm)."""
    link = connect("127.0.0.1", f.port, f._secret)
    link.send({"kind": "hello", "node": node, "pid": 1, "cores": [0, 1], "gpus": []})
    if warm:
        link.send({"kind": "warm", "seconds": 0.5})
    return link


def _until(f: AgentFleet, what: str, done: Any) -> None:
    end = time.monotonic() + LIMIT_S
    while not done():
        if time.monotonic() > end:
            raise TimeoutError(f"no {what} within {LIMIT_S} s")
        f.serve(0.05)


def _next(link: Link, kind: str) -> dict[str, Any]:
    end = time.monotonic() + LIMIT_S
    while time.monotonic() < end:
        msg = link.recv_one(0.5)
        if msg is not None and msg.get("kind") == kind:
            return msg
    raise TimeoutError(f"no {kind!r} from the driver within {LIMIT_S} s")


def test_an_agent_step_that_fails_stops_the_study_before_a_trial_is_asked(
        tmp_path: Path, closing: list[AgentFleet]) -> None:
    """The step's srun exits 1 at once (an interpreter that cannot start): the first ``capacity`` (the
    driver's, before it asks the study for a trial) raises ``FleetError`` (exit 1), one line that says the
    fleet never came up and ends with the step's log; before, capacity answered and every trial failed."""
    f = fleet(4, tmp_path, fail=True)
    closing.append(f)
    started = time.monotonic()
    with pytest.raises(FleetError) as info:
        f.capacity(request(0, tmp_path))
    assert time.monotonic() - started < LIMIT_S  # at the step's end, not after agent_start_timeout_s
    text = str(info.value)
    assert info.value.exit_code == 1 and "\n" not in text, text
    assert "step ended (srun exit 1) with no agent up" in text and "HPOFLOW_SWARM_FAIL" in text, text


def test_a_fleet_with_no_agent_within_agent_start_timeout_s_stops_the_study(
        tmp_path: Path, closing: list[AgentFleet]) -> None:
    f = fleet(2, tmp_path, idle=True, agent_start_timeout_s=1.0)
    closing.append(f)
    with pytest.raises(FleetError, match=r"agent_start_timeout_s"):
        f.capacity(request(0, tmp_path))


def test_a_stop_while_the_fleet_is_awaited_ends_the_wait(tmp_path: Path, closing: list[AgentFleet]) -> None:
    """SIGTERM or the walltime warning while no agent is up yet (a cold start of many nodes): the driver's
    stop (``interrupt``, called from its signal handler) ends the wait at once, not after
    ``agent_start_timeout_s``, and the stopping driver starts nothing."""
    import threading

    f = fleet(2, tmp_path, idle=True, agent_start_timeout_s=3 * LIMIT_S)  # (before: FleetError after it)
    closing.append(f)
    threading.Timer(0.5, f.interrupt).start()
    started = time.monotonic()
    assert f.capacity(request(0, tmp_path)) >= 1
    assert time.monotonic() - started < LIMIT_S and not f.agents


def test_an_agent_that_sends_a_hostile_frame_is_dropped_and_the_others_serve_on(
        tmp_path: Path, closing: list[AgentFleet]) -> None:
    """After the handshake, a frame nested 100,000 deep (``RecursionError`` in the driver's poll before) and
    a report whose metric is a string (``ValueError``) each drop the agent that sent it, as if it died; the
    driver's poll goes on and the trial runs again elsewhere."""
    f = fleet(3, tmp_path, idle=True)
    closing.append(f)
    a, b, c = (_join(f, f"s000{i}") for i in range(3))
    f.capacity(request(0, tmp_path))
    _until(f, "three agents", lambda: len(f.agents) == 3)
    for n in range(3):
        f.submit(request(n, tmp_path))
    starts = {name: _next(link, "start") for name, link in (("a", a), ("b", b), ("c", c))}
    numbers = {name: TrialRequest.from_json(m["request"]).number for name, m in starts.items()}
    depth = 100_000
    nested = b"[" * depth + b"]" * depth
    a.sock.sendall(struct.pack(">I", len(nested)) + nested)
    b.send({"kind": "report", "number": numbers["b"], "step": 0, "metrics": {"loss": "not a number"}})
    events: list[Any] = []

    def polled(enough: Any) -> Any:
        def check() -> bool:
            events.extend(f.poll(0.05))
            return bool(enough())
        return check

    _until(f, "two agents dropped", polled(lambda: len(f.agents) == 1 and len(events) >= 2))
    assert sorted(f.agents) == ["s0002"]
    lost = {e.number: e for e in events if isinstance(e, TrialResult)}
    assert set(lost) == {numbers["a"], numbers["b"]}
    assert all(r.status == "failed" and r.retryable for r in lost.values()), lost
    assert "nested deeper" in str(lost[numbers["a"]].error) and "not a number" in str(lost[numbers["b"]].error)
    c.send({"kind": "result", "number": numbers["c"], "result": {"number": numbers["c"], "status": "complete",
                                                                  "value": 1.0}})
    _until(f, "the third agent's result", polled(lambda: any(isinstance(e, TrialResult) and e.number == numbers["c"]
                                                            and e.status == "complete" for e in events)))
    for link in (a, b, c):
        link.close()


def test_a_request_too_large_for_an_agent_fails_its_trial_and_keeps_the_agent(
        tmp_path: Path, closing: list[AgentFleet]) -> None:
    """A trial whose request (its parameters, ``training.options``) is larger than a message to an agent may
    hold fails at once with one line that says so; before, the agent dropped the link at the frame, the node
    was lost, and the retry took down the next agent."""
    import dataclasses

    f = fleet(1, tmp_path, idle=True)
    closing.append(f)
    a = _join(f, "s0000")
    f.capacity(request(0, tmp_path))
    options = {"blob": "x" * (5 << 20)}  # 5 MiB
    big = dataclasses.replace(request(0, tmp_path), train={"function": "swarm:none", "options": options})
    f.submit(big)
    events: list[Any] = []

    def polled() -> bool:
        events.extend(f.poll(0.05))
        return bool(events)

    _until(f, "the trial's result", polled)
    (res,) = events
    assert res.status == "failed" and not res.retryable and "too large to send" in str(res.error), res
    assert list(f.agents) == ["s0000"]
    a.close()


def test_a_node_that_failed_a_start_is_held_out_of_placement_for_a_while(
        tmp_path: Path, closing: list[AgentFleet]) -> None:
    """An agent whose node could not start a trial (a full ``/dev/shm``: ``node_fault``) frees its slots at
    once and would be the least loaded: without a hold it took the retry and every waiting trial, each
    failing in milliseconds. It gets none for ``_fleet.HOLD_S[0]`` s; then trials go there again."""
    from hpoflow.engines.slurm._fleet import HOLD_S

    f = fleet(2, tmp_path, idle=True)
    closing.append(f)
    a, b = _join(f, "s0000"), _join(f, "s0001")
    f.capacity(request(0, tmp_path))
    _until(f, "two warm agents", lambda: len(f.agents) == 2 and all(x.warm_s is not None for x in f.agents.values()))
    f.submit(request(0, tmp_path))
    assert TrialRequest.from_json(_next(a, "start")["request"]).number == 0  # the first of two idle agents
    a.send({"kind": "result", "number": 0, "node_fault": True, "result": {
        "number": 0, "status": "failed", "retryable": True, "error": "its node agent on s0000 could not start it: "
        "OSError: [Errno 28] No space left on device"}})
    held_at = time.monotonic()
    _until(f, "the start failure", lambda: bool(f.poll(0.05)))
    f.submit(request(1, tmp_path))  # a is idle and first in node order, but held: b takes it
    assert TrialRequest.from_json(_next(b, "start")["request"]).number == 1
    f.submit(request(2, tmp_path))  # b is full (one CPU an agent here) and a held: it waits out the hold
    early: list[str] = []
    while time.monotonic() - held_at < HOLD_S[0] - 0.5:  # (before: a took it at once)
        f.serve(0.05)
        msg = a.recv_one(0.05)
        if msg is not None:
            early.append(str(msg.get("kind")))
    assert "start" not in early, early
    _until(f, "the hold's end", lambda: time.monotonic() - held_at > HOLD_S[0] + 1.0)
    start = _next(a, "start")
    assert TrialRequest.from_json(start["request"]).number == 2
    assert f.agents["s0000"].held_until <= time.monotonic()
    a.close()
    b.close()


def test_a_lost_node_gets_a_new_agent_step_and_is_admitted_again(tmp_path: Path, closing: list[AgentFleet],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent whose connection closes is lost (its node leaves the plan); while the agents' step runs the
    driver starts a new agent step on that node (``--nodelist=NODE --overlap``), whose agent is admitted
    and runs trials again. Before, the node never came back: a returning agent was refused."""
    monkeypatch.setattr("hpoflow.engines.slurm._losses.RELAUNCH_AFTER_S", 0.2)
    f = fleet(2, tmp_path, idle=True)
    closing.append(f)
    a = _join(f, "s0000")
    b = _join(f, "s0001")
    f.capacity(request(0, tmp_path))
    _until(f, "two agents", lambda: len(f.agents) == 2)
    b.close()  # its agent died
    _until(f, "the loss", lambda: "s0001" not in f.allocation.hosts)
    # the fake srun of the relaunch runs a swarm agent for s0001 (its --nodelist): it joins
    _until(f, "the node back", lambda: "s0001" in f.agents and "s0001" in f.allocation.hosts)
    log = (f.dir / "srun.log").read_text()
    assert "--nodelist=s0001 --overlap" in log, log
    a.close()  # (the test's agent answers no trial: it goes too, and the agent that came back runs them)
    _until(f, "s0000 lost", lambda: list(f.agents) == ["s0001"])
    done = run_trials(f, 6, tmp_path, slots=1, limit_s=LIMIT_S)
    assert done == {n: 1 for n in range(6)}, done


def test_a_trial_of_two_nodes_waits_for_warm_agents(tmp_path: Path, closing: list[AgentFleet]) -> None:
    """A gang's ranks must meet within the process-group timeout: it goes to agents whose warm pool is up
    only (before, to any two agents, one of them maybe still importing torch)."""
    f = fleet(2, tmp_path, idle=True)
    closing.append(f)
    a = _join(f, "s0000", warm=False)
    b = _join(f, "s0001", warm=True)
    f.capacity(request(0, tmp_path))
    _until(f, "two agents", lambda: len(f.agents) == 2)
    gang = TrialRequest(7, {}, {"function": "swarm:none"}, "value", "maximize", str(tmp_path / "trials" / "7"),
                        processes=2, nodes=2)
    f.submit(gang)
    f.poll(0.5)
    assert f._trials[7].nodes == []  # still waiting: s0000 is not warm
    a.send({"kind": "warm", "seconds": 3.0})
    _until(f, "the gang placed", lambda: f._trials[7].nodes != [])
    assert sorted(f._trials[7].nodes) == ["s0000", "s0001"]
    assert _next(a, "start")["share"]["ranks"] == 1 and _next(b, "start")["share"]["world"] == 2
    a.close()
    b.close()


def test_the_driver_pings_its_agents_and_tells_them_the_fleets_intervals(
        tmp_path: Path, closing: list[AgentFleet]) -> None:
    """Agents end when their driver is silent for agent_timeout_s, so the driver pings each (from a thread:
    also while its loop waits on the study's storage); the step's argv carries the heartbeat interval, the
    agents' timeout and the address the listener is bound to."""
    f = fleet(1, tmp_path, idle=True, agent_timeout_s=1.5)
    closing.append(f)
    a = _join(f, "s0000")
    f.capacity(request(0, tmp_path))
    assert f.ping_s <= 0.5
    started = time.monotonic()
    _next(a, "ping")  # nobody polls the fleet meanwhile
    assert time.monotonic() - started < LIMIT_S
    log = (f.dir / "srun.log").read_text()
    assert f"--heartbeat-s {f.heartbeat_s:g}" in log and "--driver-timeout-s 1.5" in log, log
    a.close()


def test_the_heartbeat_interval_grows_with_the_fleet_within_the_timeout() -> None:
    """A heartbeat a second from each of 1,000 agents pegged a core; now the driver reads about 250 a
    second, and an agent still beats 4 times within agent_timeout_s."""
    assert heartbeat_interval(8, 30.0) == 1.0
    assert heartbeat_interval(1000, 30.0) == pytest.approx(4.0)
    assert heartbeat_interval(4000, 30.0) == 7.5  # a quarter of the timeout at most
    assert heartbeat_interval(1000, 2.0) == 0.5


def test_the_listener_is_bound_to_the_address_the_agents_are_told(tmp_path: Path,
                                                                  closing: list[AgentFleet]) -> None:
    """A job of this node alone: the agents are told 127.0.0.1 and the listener is bound there (it was bound
    to every address, 0.0.0.0, whatever the agents were told)."""
    from hpoflow.engines.slurm.allocation import Allocation
    from hpoflow.engines.slurm.options import SlurmOptions
    from tests.engines.agent.swarm import fake_srun, swarm_env

    here = socket.gethostname().split(".")[0]
    env = {**swarm_env([here], fake_srun(tmp_path / "bin")), "HPOFLOW_SWARM_IDLE": "1"}
    f = AgentFleet(Allocation("1", (here,), (2,), 0), SlurmOptions(agents="on", mode="steps"), tmp_path,
                   sys.executable, env, "one")
    closing.append(f)
    assert f.host == "127.0.0.1" and f._listener.server.getsockname()[0] == "127.0.0.1"
    assert "--host 127.0.0.1" in (f.dir / "srun.log").read_text()


def test_a_hard_open_files_limit_below_the_fleet_is_one_clear_error(tmp_path: Path) -> None:
    """1,024 agents need more than 1,024 descriptors: under a hard limit of 600 the fleet refuses at once,
    with the numbers and the fix (before: agents past the limit were never admitted, without a word)."""
    code = ("import sys; from pathlib import Path; from tests.engines.agent.swarm import fleet\n"
            "from hpoflow.errors import EngineError\n"
            "try:\n    fleet(1024, Path(sys.argv[1]))\nexcept EngineError as exc:\n    print(exc); sys.exit(3)\n")
    proc = subprocess.run(["bash", "-c", f'ulimit -n 600 && exec "{sys.executable}" -c "$0" "$1"', code,
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "1024 node agents" in proc.stdout and "hard limit is 600" in proc.stdout and "Fix:" in proc.stdout
