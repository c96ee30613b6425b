"""Rank 0's control connection in steps mode (``SocketChannel``) and the engine's end of it
(``ControlServer``): rank 0 connects to the engine with its attempt's token, its reports arrive by the
connection as they are made (and stay in reports.jsonl), a decision reaches a waiting rank 0 without
an answer file, a stop ends its wait, a stranger without a token is closed, and a rank 0 that cannot
reach the engine trains on without waiting for decisions."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpoflow.train import transport
from hpoflow.train.transport import ControlServer, ReportReader, SocketChannel, TrialFiles

WAIT_S = 30.0  # bounds a hang on a loaded machine


def _wait_items(server: ControlServer, token: str, n: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    end = time.monotonic() + WAIT_S
    while len([i for i in items if "step" in i]) < n and time.monotonic() < end:
        server.wait(0.05)
        items += server.messages(token)
    return items


def _closed_by_peer(s: socket.socket) -> bool:
    """Whether the other end closed ``s`` (read without blocking)."""
    s.setblocking(False)
    try:
        return s.recv(10) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True  # reset


def _report_in_thread(channel: SocketChannel, step: int) -> tuple[threading.Thread, list[bool]]:
    got: list[bool] = []
    th = threading.Thread(target=lambda: got.append(channel.report(step, {"loss": 0.5}, True)))
    th.start()
    return th, got


def test_a_decision_reaches_rank_0_by_the_connection_and_reports_arrive_as_they_are_made(tmp_path: Path) -> None:
    files = TrialFiles(tmp_path, 0)
    server = ControlServer("127.0.0.1")
    token = server.new_token()
    channel = SocketChannel(files, answer_timeout_s=WAIT_S, engine=f"127.0.0.1 {server.port} {token}",
                            hello={"step": "7", "nodes": "n[1-2]"})
    try:
        assert not channel.report(1, {"loss": 0.9}, False)
        th, got = _report_in_thread(channel, 2)
        items = _wait_items(server, token, 2)
        assert items[0] == {"hello": {"step": "7", "nodes": "n[1-2]"}}  # where the step runs, first
        assert [(i["seq"], i["step"], i["wants_answer"]) for i in items[1:]] == [(0, 1, False), (1, 2, True)]
        assert server.send(token, {"seq": 1, "prune": True, "pause": False})
        th.join(WAIT_S)
        assert got == [True]  # pruned, by the connection
        assert not files.answer(1).exists()  # no answer file was needed
        assert [i["seq"] for i in ReportReader(files.reports).read_new()] == [0, 1]  # the durable record
        th, got = _report_in_thread(channel, 3)
        _wait_items(server, token, 1)
        assert server.send(token, {"stop": "cancelled"})  # a stop ends the wait at once, as pruned
        th.join(WAIT_S)
        assert got == [True]
    finally:
        channel.close()
        server.close()


def test_a_connection_without_the_token_is_closed_and_decides_nothing(tmp_path: Path) -> None:
    server = ControlServer("127.0.0.1")
    token = server.new_token()
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) as s:
            s.sendall(b"guess\n{\"seq\": 0, \"step\": 1, \"metrics\": {}}\n")
            end = time.monotonic() + WAIT_S
            closed = False
            while not closed and time.monotonic() < end:
                server.wait(0.05)
                closed = _closed_by_peer(s)
            assert closed  # closed by the engine
        assert not server.connected(token) and server.messages(token) == []
    finally:
        server.close()


def test_connections_that_never_say_a_token_are_bounded_and_closed(tmp_path: Path) -> None:
    """A flood of connections that send nothing: at most ``max_pending`` are held, each for at most
    ``preauth_s``; rank 0 with the token still gets in."""
    server = ControlServer("127.0.0.1", preauth_s=0.5, max_pending=4)
    token = server.new_token()
    silent = [socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S) for _ in range(10)]
    files = TrialFiles(tmp_path, 0)
    channel = SocketChannel(files, answer_timeout_s=WAIT_S, engine=f"127.0.0.1 {server.port} {token}")
    try:
        channel.report(1, {"loss": 0.5}, False)
        assert [i["step"] for i in _wait_items(server, token, 1) if "step" in i] == [1]
        end = time.monotonic() + WAIT_S
        open_ = len(silent)
        while open_ and time.monotonic() < end:
            server.wait(0.05)
            open_ = sum(not _closed_by_peer(s) for s in silent)
        assert open_ == 0  # every silent one closed (4 held at most, none past 0.5 s)
        assert server.connected(token)
    finally:
        for s in silent:
            s.close()
        channel.close()
        server.close()


def test_a_rank_0_that_cannot_reach_the_engine_trains_on_without_waiting(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "CONNECT_S", 0.3)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    files = TrialFiles(tmp_path, 0)
    channel = SocketChannel(files, answer_timeout_s=WAIT_S, engine=f"127.0.0.1 {port} token")
    t0 = time.monotonic()
    assert channel.report(1, {"loss": 0.5}, True) is False  # not pruned, and not after answer_timeout_s
    assert time.monotonic() - t0 < WAIT_S / 2
    assert [i["step"] for i in ReportReader(files.reports).read_new()] == [1]  # the engine reads it at the end
