"""A node agent on this machine, driven by the test as the slurm engine's driver drives it: the secret
is checked before anything else, and a trial runs on the agent's warm pool (``hpoflow.engines.agent``)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines import TrialRequest
from hpoflow.engines.agent.protocol import SECRET_ENV, AuthError, Link, accept, connect, new_secret
from hpoflow.spec import TrainConfig
from tests.conftest import ROOT

PYPATH = (str(ROOT / "tests"),)
WAIT_S = 120.0  # bounds a hang (the agent's forkserver imports torch first on a loaded machine)


def _request(tmp_path: Path, number: int, **params: Any) -> TrialRequest:
    train = TrainConfig(function="trainfns:behave", epochs=1).model_dump(mode="json")
    return TrialRequest(number, params, train, "value", "maximize", str(tmp_path / "trials" / str(number)),
                        python_path=PYPATH)


def _until(link: Link, kind: str, limit_s: float = WAIT_S) -> dict[str, Any]:
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        msg = link.recv_one(max(0.0, end - time.monotonic()))
        if msg is not None and msg.get("kind") == kind:
            return msg
    raise TimeoutError(f"no {kind!r} message from the agent within {limit_s} s")


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[Link, subprocess.Popen[bytes]]]:
    """An agent process on this machine, connected to this test as its driver."""
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0))
    env = {**os.environ, SECRET_ENV: secret, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    proc = subprocess.Popen([sys.executable, "-m", "hpoflow.engines.agent", "--host", "127.0.0.1", "--port",
                             str(server.getsockname()[1])], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    server.settimeout(WAIT_S)
    try:
        sock, _ = server.accept()
        link = accept(sock, secret)
        yield link, proc
    finally:
        proc.kill()
        proc.wait(30)
        server.close()


def test_a_connection_without_the_runs_secret_is_refused_before_any_message() -> None:
    """The driver's side of the challenge (``accept``) drops a peer with another secret and a peer that
    says nothing, and admits one with the run's secret; a refused peer reads nothing but a nonce."""
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    seen: list[str] = []

    def serve(n: int) -> None:
        for _ in range(n):
            sock, _ = server.accept()
            try:
                link = accept(sock, secret, timeout_s=2.0)
                link.send({"kind": "welcome"})
                seen.append("admitted")
            except AuthError:
                seen.append("dropped")

    th = threading.Thread(target=serve, args=(3,), daemon=True)
    th.start()
    with server:
        with pytest.raises(AuthError):
            connect("127.0.0.1", port, new_secret())  # another run's secret
        silent = socket.create_connection(("127.0.0.1", port))  # says nothing: dropped at the timeout
        assert silent.recv(4)  # the frame header of the nonce: all it ever reads
        silent.settimeout(10.0)
        rest = b""
        while chunk := silent.recv(4096):
            rest += chunk
        assert len(rest) == 32  # the nonce, then the connection closed
        silent.close()
        link = connect("127.0.0.1", port, secret)
        assert link.recv_one(10.0) == {"kind": "welcome"}
        link.close()
        th.join(10)
    assert seen == ["dropped", "dropped", "admitted"]


def test_an_agent_runs_trials_on_its_warm_pool_and_forwards_reports_and_results(
        agent: tuple[Link, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    link, _ = agent
    hello = link.recv_one(WAIT_S)  # the first message: the driver knows the agent's node by it
    assert hello is not None and hello["kind"] == "hello" and hello["cores"] and hello["pid"], hello
    link.send({"kind": "start", "request": _request(tmp_path, 0, value=0.75, reports=2).to_json(),
               "share": None})
    link.send({"kind": "start", "request": _request(tmp_path, 1, mode="raise").to_json(), "share": None})
    results: dict[int, dict[str, Any]] = {}
    reports = []
    end = time.monotonic() + WAIT_S
    while len(results) < 2 and time.monotonic() < end:
        msg = link.recv_one(max(0.0, end - time.monotonic()))
        if msg is None:
            continue
        if msg["kind"] == "report":
            reports.append(msg)
        elif msg["kind"] == "result":
            results[msg["number"]] = msg["result"]
    assert (results[0]["status"], results[0]["value"]) == ("complete", 0.75)
    assert results[1]["status"] == "failed" and "boom from user code" in results[1]["error"]
    assert [r["step"] for r in reports if r["number"] == 0] == [0, 1]


def test_an_agent_whose_driver_goes_away_exits(agent: tuple[Link, subprocess.Popen[bytes]]) -> None:
    link, proc = agent
    _until(link, "hello")
    link.close()
    assert proc.wait(WAIT_S) == 0


def _serve_one(server: socket.socket, secret: str) -> Link:
    server.settimeout(WAIT_S)
    sock, _ = server.accept()
    return accept(sock, secret)


def _agent_proc(port: int, secret: str, *extra: str, prefix: tuple[str, ...] = ()) -> subprocess.Popen[bytes]:
    env = {**os.environ, SECRET_ENV: secret, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    return subprocess.Popen([*prefix, sys.executable, "-m", "hpoflow.engines.agent", "--host", "127.0.0.1", "--port",
                             str(port), *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_an_agent_retries_until_its_driver_listens() -> None:
    """A thousand agents importing from a cold shared file system, a driver that starts late, a listener
    that evicted the connection in a flood: the agent tries again with back-off (before: it exited 1 at the
    first refused connection)."""
    secret = new_secret()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))  # the port is taken, nothing listens yet: connections are refused
    proc = _agent_proc(server.getsockname()[1], secret, "--connect-timeout-s", "60")
    try:
        time.sleep(2.0)
        assert proc.poll() is None  # still trying
        server.listen()
        link = _serve_one(server, secret)
        assert _until(link, "hello")["node"]
        link.close()
        assert proc.wait(WAIT_S) == 0
    finally:
        proc.kill()
        proc.wait(30)
        server.close()


def test_an_agent_whose_driver_goes_silent_exits_after_its_timeout() -> None:
    """The driver's node vanished without closing the connection (TCP would wait ~15 minutes): the agent
    ends after ``--driver-timeout-s`` without a message from it (the driver pings more often)."""
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0))
    proc = _agent_proc(server.getsockname()[1], secret, "--driver-timeout-s", "2")
    try:
        link = _serve_one(server, secret)
        _until(link, "hello")
        started = time.monotonic()
        assert proc.wait(WAIT_S) == 0  # the connection stays open, silent
        assert time.monotonic() - started >= 1.5
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert "no word from the driver for" in out, out
        link.close()
    finally:
        proc.kill()
        proc.wait(30)
        server.close()


def test_an_error_starting_a_trial_fails_that_trial_and_the_agent_serves_on(
        agent: tuple[Link, subprocess.Popen[bytes]], tmp_path: Path) -> None:
    """A trial directory that cannot be made (an ``OSError``, not an ``EngineError``) killed the agent, and
    its trials on the other nodes with it; now that trial fails (retryable: a fault of the node) and the
    next one runs on the slots the failed start had taken."""
    link, proc = agent
    _until(link, "hello")
    (tmp_path / "file").write_text("")
    bad = TrialRequest(0, {}, TrainConfig(function="trainfns:behave", epochs=1).model_dump(mode="json"), "value",
                       "maximize", str(tmp_path / "file" / "trial"), python_path=PYPATH, cpus_per_process=1)
    link.send({"kind": "start", "request": bad.to_json(), "share": None})
    failed = _until(link, "result")
    assert failed["number"] == 0 and failed["result"]["status"] == "failed" and failed["result"]["retryable"]
    assert "could not start it" in failed["result"]["error"], failed
    for n in (1, 2):  # every slot free again
        link.send({"kind": "start", "request": _request(tmp_path, n, value=0.5).to_json(), "share": None})
    results: dict[int, str] = {}
    while len(results) < 2:
        msg = _until(link, "result")
        results[msg["number"]] = msg["result"]["status"]
    assert results == {1: "complete", 2: "complete"} and proc.poll() is None


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a tmpfs in a mount namespace of the agent's own (root)")
def test_an_agent_on_a_full_dev_shm_fails_that_trial_only(tmp_path: Path) -> None:
    """The agent's node has a full ``/dev/shm`` (a tmpfs of its own here, in a private mount namespace: the
    machine's is left alone): a 2-rank trial, whose ranks meet in a private directory there, fails with
    the disk's error and as retryable; the agent serves a 1-rank trial after it. Before, the ``OSError``
    ended the agent."""
    secret = new_secret()
    server = socket.create_server(("127.0.0.1", 0))
    prefix = ("unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
              'mount -t tmpfs -o size=256k,nr_inodes=64 hpoflow-shm /dev/shm && exec "$0" "$@"')
    proc = _agent_proc(server.getsockname()[1], secret, prefix=prefix)
    try:
        link = _serve_one(server, secret)
        hello = _until(link, "hello")
        _until(link, "warm")
        fill = subprocess.run(["nsenter", "-t", str(hello["pid"]), "-m", "--", "sh", "-c",
                               "i=0; while touch /dev/shm/f$i 2>/dev/null; do i=$((i+1)); done; "
                               "dd if=/dev/zero of=/dev/shm/f0 bs=4k 2>/dev/null; df /dev/shm"],
                              capture_output=True, text=True, timeout=60)
        assert "100%" in fill.stdout, fill.stdout + fill.stderr
        two = TrialRequest(0, {"value": 0.5}, TrainConfig(function="trainfns:behave", epochs=1).model_dump(mode="json"),
                           "value", "maximize", str(tmp_path / "trials" / "0"), processes=2, python_path=PYPATH)
        link.send({"kind": "start", "request": two.to_json(), "share": None})
        failed = _until(link, "result")["result"]
        assert failed["status"] == "failed" and failed["retryable"], failed
        assert "No space left" in failed["error"], failed
        link.send({"kind": "start", "request": _request(tmp_path, 1, value=0.25).to_json(), "share": None})
        ok = _until(link, "result")
        assert (ok["number"], ok["result"]["status"], ok["result"]["value"]) == (1, "complete", 0.25), ok
        assert proc.poll() is None
        link.close()
    finally:
        proc.kill()
        proc.wait(30)
        server.close()


def test_heartbeats_stop_when_the_serving_loop_is_stuck() -> None:
    """The heartbeat came from a thread of its own whatever the serving loop did: an agent stuck in a call
    (a hung file system, a deadlock) looked alive forever. Now a heartbeat goes out only while the loop
    has turned within ``SERVE_STALL_S``, or waits in a trial's start for the warm pool."""
    from hpoflow.engines.agent.agent import SERVE_STALL_S, _Agent

    mine, theirs = socket.socketpair()
    driver = Link(theirs)
    agent = _Agent.__new__(_Agent)  # (its state only: no warm pool)
    agent.link, agent.heartbeat_s, agent._done = Link(mine), 0.05, threading.Event()
    agent._tick, agent._starting, agent.warm_s = time.monotonic(), False, 1.0
    beat = threading.Thread(target=agent._beat, daemon=True)
    beat.start()
    try:
        assert driver.recv_one(5.0) == {"kind": "heartbeat"}
        agent._tick -= SERVE_STALL_S + 1  # the loop stopped turning
        time.sleep(0.2)
        driver.read()
        assert driver.recv_one(0.5) is None
        agent._starting, agent.warm_s = True, None  # in a start, waiting for the warm pool: alive
        assert driver.recv_one(5.0) == {"kind": "heartbeat"}
    finally:
        agent._done.set()
        beat.join(5)
        driver.close()
        agent.link.close()
