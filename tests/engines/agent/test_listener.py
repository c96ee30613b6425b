"""The agents' listener under abuse: a flood of connections that never authenticate costs a bounded
number of threads and descriptors and loses no trial; running out of descriptors pauses admission and
never ends it."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines.agent.listener import Listener
from hpoflow.engines.agent.protocol import connect, new_secret
from tests.engines.agent.swarm import fleet, request, run_trials

FLOOD = 1000
# bounds a hang, not a speed: a study of 8 agents' 10 ms trials takes a second or two on a quiet machine,
# many times that with other work on both of its cores
LIMIT_S = 120.0


def _open_files_at_least(n: int) -> tuple[int, int]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < n:
        pytest.skip(f"the hard open-files limit ({hard}) is below the {n} the test holds")
    if soft != resource.RLIM_INFINITY and soft < n:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n, hard))
    return soft, hard


def test_a_flood_of_unauthenticated_connections_loses_no_trial_and_costs_bounded_threads(tmp_path: Path) -> None:
    """1,000 connections to the agents' port, held open and silent, while 8 agents run 300 trials: every
    trial completes exactly once, the driver's threads stay within a few of what it had (before: a thread
    per connection, each held for the 10 s challenge), and the flood is dropped (evicted from the bounded
    challenge stage, or timed out)."""
    saved = _open_files_at_least(4 * FLOOD)
    f = fleet(8, tmp_path, procs=2)
    flood: list[socket.socket] = []
    peak = [threading.active_count()]
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.02):
            peak[0] = max(peak[0], threading.active_count())

    try:
        f.capacity(request(0, tmp_path))
        end = time.monotonic() + LIMIT_S
        while len(f.agents) < 8 and time.monotonic() < end:
            f.serve(0.1)
        base = threading.active_count()
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        for _ in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", f.port), timeout=10)
            flood.append(s)
        done = run_trials(f, 300, tmp_path, slots=8, limit_s=LIMIT_S)
        f.serve(0.5)
        stop.set()
        watcher.join(5)
        assert len(done) == 300 and set(done.values()) == {1}, (len(done), set(done.values()))
        assert peak[0] <= base + 2, (base, peak[0])  # (+1: the watcher itself)
        assert f.refused >= FLOOD - 256, f.refused  # all but the last stage's worth are dropped already
        assert len(f.agents) == 8  # no agent was lost to the flood
    finally:
        stop.set()
        for s in flood:
            s.close()
        f.close(2.0)
        resource.setrlimit(resource.RLIMIT_NOFILE, saved)


def test_running_out_of_descriptors_pauses_admission_and_an_agent_gets_in_after(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``accept`` failing with ``EMFILE`` ended the accept thread for good: no agent was admitted after
    it. Now accepting pauses and resumes; an agent that retries gets in."""
    secret = new_secret()
    listener = Listener("127.0.0.1", secret, auth_timeout_s=2.0)
    saved = resource.getrlimit(resource.RLIMIT_NOFILE)
    held: list[socket.socket] = []
    try:
        # as many descriptors as the process may open, less a few: the clients' ends and the listener's
        # accepted ends then run out together
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 40, saved[1]))
        with contextlib.suppress(OSError):
            for _ in range(100):
                held.append(socket.create_connection(("127.0.0.1", listener.port), timeout=2))
        time.sleep(1.0)  # the listener's accept meets EMFILE
        for s in held:
            s.close()
        held.clear()
        resource.setrlimit(resource.RLIMIT_NOFILE, saved)
        end = time.monotonic() + 30.0
        admitted: list[tuple[Any, dict[str, Any]]] = []
        while not admitted and time.monotonic() < end:
            with contextlib.suppress(OSError):
                link = connect("127.0.0.1", listener.port, secret)
                link.send({"kind": "hello", "node": "n1", "cores": [0], "gpus": []})
                deadline = time.monotonic() + 5.0
                while not admitted and time.monotonic() < deadline:
                    admitted = listener.take()
                    time.sleep(0.05)
            time.sleep(0.2)
        assert [h["node"] for _, h in admitted] == ["n1"]
        assert "ran out of file descriptors" in capsys.readouterr().err  # (it did meet EMFILE)
    finally:
        for s in held:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, saved)
        listener.close()

