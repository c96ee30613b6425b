"""The agents' wire (``hpoflow.engines.agent.protocol``): a frame that breaks the rules closes the link
and says why, and a link works on any descriptor number."""

from __future__ import annotations

import json
import os
import resource
import socket
import struct
import time
from collections.abc import Iterator

import pytest

from hpoflow.engines.agent.protocol import MAX_FRAME, Link

HEADER = struct.Struct(">I")


@pytest.fixture
def pair() -> Iterator[tuple[Link, socket.socket]]:
    """A link (the reader) and the raw socket of its peer, on loopback."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        b = socket.create_connection(server.getsockname())
        a, _ = server.accept()
    link = Link(a)
    yield link, b
    link.close()
    b.close()


def _frame(data: bytes) -> bytes:
    return HEADER.pack(len(data)) + data


def _read_all(link: Link, limit_s: float = 10.0) -> list[dict[str, object]]:
    """What ``link`` reads until the peer's bytes are in (or it closed): a loopback write may arrive in parts."""
    out = link.read()
    end = time.monotonic() + limit_s
    while not link.closed and time.monotonic() < end:
        time.sleep(0.05)
        out += link.read()
    return out


def test_a_deeply_nested_frame_closes_the_link_instead_of_raising(pair: tuple[Link, socket.socket]) -> None:
    """JSON nested 100,000 deep made ``json.loads`` raise ``RecursionError`` through ``read`` (the
    driver's poll); now the link closes and ``error`` names the nesting."""
    link, peer = pair
    peer.sendall(_frame(b'{"kind": "heartbeat"}') + _frame(b"[" * 100_000 + b"]" * 100_000))
    msgs = _read_all(link)
    assert msgs == [{"kind": "heartbeat"}]  # what came before it is read
    assert link.closed and "nested deeper" in link.error, link.error


def test_a_frame_over_the_limit_closes_the_link_before_it_is_read(pair: tuple[Link, socket.socket]) -> None:
    """A 64 MiB frame was within the old limit (64 MiB): the reader buffered it whole. The limit is now
    ``MAX_FRAME`` (4 MiB), checked on the header."""
    link, peer = pair
    assert MAX_FRAME <= 4 << 20
    peer.sendall(HEADER.pack(64 << 20) + b"{" * 1000)
    assert _read_all(link) == [] and link.closed and "more than" in link.error, link.error


@pytest.mark.parametrize("body", [b"[1, 2]", b"not json", b"\xff\xfe"])
def test_a_frame_that_is_not_a_json_object_closes_the_link(pair: tuple[Link, socket.socket], body: bytes) -> None:
    """Before, such a frame was skipped in silence and the peer went on; a peer that sends one is broken
    or hostile, and its reader now drops it (the driver: that agent)."""
    link, peer = pair
    peer.sendall(_frame(body) + _frame(json.dumps({"kind": "heartbeat"}).encode()))
    assert _read_all(link) == [] and link.closed and link.error


def test_recv_one_works_on_a_descriptor_above_1023() -> None:
    """``recv_one`` waited with ``select.select``, which raises ``ValueError`` for a descriptor >= 1024: the
    driver's hello wait failed for every agent past the 1,000th connection."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1100:
        pytest.skip(f"the hard open-files limit ({hard}) holds no descriptor 1100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200) if soft != resource.RLIM_INFINITY else soft, hard))
    a, b = socket.socketpair()
    try:
        high = os.dup2(a.fileno(), 1100)
        a.close()
        link = Link(socket.socket(fileno=high))
        b.sendall(_frame(b'{"kind": "hello"}'))
        assert link.recv_one(5.0) == {"kind": "hello"}
        assert link.recv_one(0.05) is None  # and a wait that times out
        link.close()
    finally:
        b.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
