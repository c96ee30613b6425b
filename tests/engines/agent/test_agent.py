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
