"""Rank 0's control socket in steps mode (``SocketChannel``) and the engine's end of it (``ControlLink``):
reports arrive by the connection as they are made (and stay in reports.jsonl), a decision reaches a
waiting rank 0 without an answer file, a stop ends its wait, a stranger without the token is ignored,
and with no engine connected rank 0 falls back to answer files."""

from __future__ import annotations

import json
import socket
import stat
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpoflow.train import transport
from hpoflow.train.transport import ControlLink, ReportReader, SocketChannel, TrialFiles

WAIT_S = 30.0  # bounds a hang on a loaded machine


def _wait_items(link: ControlLink, n: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    end = time.monotonic() + WAIT_S
    while len(items) < n and time.monotonic() < end:
        items += link.read_new()
        time.sleep(0.01)
    return items


def _report_in_thread(channel: SocketChannel, step: int) -> tuple[threading.Thread, list[bool]]:
    got: list[bool] = []
    th = threading.Thread(target=lambda: got.append(channel.report(step, {"loss": 0.5}, True)))
    th.start()
    return th, got


def test_a_decision_reaches_rank_0_by_the_connection_and_reports_arrive_as_they_are_made(tmp_path: Path) -> None:
    files = TrialFiles(tmp_path, 0)
    channel = SocketChannel(files, answer_timeout_s=WAIT_S, address="127.0.0.1")
    assert stat.S_IMODE(files.control.stat().st_mode) == 0o600  # the token is the user's only
    link = ControlLink(files.control.read_text())
    end = time.monotonic() + WAIT_S
    while not channel.connected and time.monotonic() < end:
        time.sleep(0.01)
    assert not channel.report(1, {"loss": 0.9}, False)
    th, got = _report_in_thread(channel, 2)
    items = _wait_items(link, 2)
    assert [(i["seq"], i["step"], i["wants_answer"]) for i in items] == [(0, 1, False), (1, 2, True)]
    assert link.send({"seq": 1, "prune": True, "pause": False})
    th.join(WAIT_S)
    assert got == [True]  # pruned, by the connection
    assert not files.answer(1).exists()  # no answer file was needed
    assert [i["seq"] for i in ReportReader(files.reports).read_new()] == [0, 1]  # the durable record
    th, got = _report_in_thread(channel, 3)
    _wait_items(link, 1)
    assert link.send({"stop": "cancelled"})  # a stop ends the wait at once, as pruned
    th.join(WAIT_S)
    assert got == [True]
    link.close()


def test_a_connection_without_the_token_is_closed_and_decides_nothing(tmp_path: Path) -> None:
    files = TrialFiles(tmp_path, 0)
    channel = SocketChannel(files, answer_timeout_s=2.0, address="127.0.0.1")
    host, port, _token = files.control.read_text().split()
    with socket.create_connection((host, int(port)), timeout=WAIT_S) as s:
        s.sendall(b"guess\n" + json.dumps({"seq": 0, "prune": True}).encode() + b"\n")
        s.settimeout(WAIT_S)
        assert s.recv(10) == b""  # closed by rank 0
    assert not channel.connected
    assert channel.report(0, {"loss": 0.5}, True) is False  # no decision: it trains on after its timeout


def test_with_no_engine_connected_rank_0_falls_back_to_answer_files(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(transport, "FALLBACK_S", 0.2)
    files = TrialFiles(tmp_path, 0)
    channel = SocketChannel(files, answer_timeout_s=WAIT_S, address="127.0.0.1")
    th, got = _report_in_thread(channel, 1)
    time.sleep(0.5)
    files.answer(0).write_text(json.dumps({"prune": True}))
    th.join(WAIT_S)
    assert got == [True]
