"""The wire between the slurm engine's driver and its node agents: framed JSON over TCP, after a mutual
HMAC-SHA256 challenge on the run's secret.

A frame is a 4-byte big-endian length and that many bytes; a message is one frame holding one JSON
object, at most ``MAX_FRAME`` bytes and nested no deeper than the interpreter's JSON parser takes. A
frame that breaks either rule, is not JSON or is not an object closes the connection (``Link.error``
says why): a peer that sends one is broken or hostile, and the reader drops that peer, nothing else.
Before any message, the side that accepted the connection (the driver) sends a random nonce;
the connecting side (an agent) answers ``HMAC(secret, "agent" + nonce)`` and a nonce of its own; the
driver checks it with ``hmac.compare_digest`` (a peer without the secret is dropped there, having read
nothing but a nonce) and proves itself the same way (``"driver" + nonce``). The secret never travels
and never appears in argv: agents read it from ``SECRET_ENV`` (the step's environment) and drop it from
their environment at once, so nothing a trial starts inherits it.

Standard library only (no torch, no pydantic: the agent imports it before its pool's forkserver starts).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import selectors
import socket
import struct
import threading
import time
from typing import Any

__all__ = ["ANSWER_BYTES", "AUTH_TIMEOUT_S", "MAX_FRAME", "SECRET_ENV", "AuthError", "Link", "accept", "challenge",
           "connect", "decode", "frame_of", "new_secret", "proof"]

SECRET_ENV = "HPOFLOW_AGENT_SECRET"
AUTH_TIMEOUT_S = 10.0  # a peer that has not proved itself by then is dropped
_NONCE = 32
_DIGEST = hashlib.sha256().digest_size
MAX_FRAME = 4 << 20  # a message is a request or an event (a stderr tail of 2 KB at most): far below this
_HEADER = struct.Struct(">I")
_CHUNK = 1 << 16
_HEARTBEAT = json.dumps({"kind": "heartbeat"}).encode()


class AuthError(ConnectionError):
    """The peer did not prove it holds the run's secret."""


def new_secret() -> str:
    """A fresh per-run secret (hex)."""
    return secrets.token_hex(32)


def _mac(secret: str, who: bytes, nonce: bytes) -> bytes:
    return hmac.new(secret.encode(), who + nonce, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the peer closed the connection")
        buf += chunk
    return bytes(buf)


def _send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_frame(sock: socket.socket, limit: int) -> bytes:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    if n > limit:
        raise ConnectionError(f"a frame of {n} bytes, more than {limit}")
    return _recv_exact(sock, n)


class Link:
    """One authenticated connection: ``send`` a message (thread-safe), ``read`` what has arrived
    (``poll`` first, or after the socket is readable); ``closed`` once the peer is gone."""

    def __init__(self, sock: socket.socket, buffered: bytes = b"") -> None:
        self.sock = sock
        sock.settimeout(None)
        with contextlib.suppress(OSError):  # (not TCP: a socketpair in tests)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = buffered  # what arrived after the handshake, before this link existed
        self._send_lock = threading.Lock()
        self.closed = False
        self.error = ""  # why this side closed the link: the peer broke the framing rules
        self.peer = ""
        with contextlib.suppress(OSError):
            name = sock.getpeername()
            self.peer = f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the connection is gone."""
        data = json.dumps(message).encode()
        return self.send_frame(_HEADER.pack(len(data)) + data)

    def send_frame(self, frame: bytes) -> bool:
        """Send a frame made once for many links (``frame_of``); False when the connection is gone."""
        with self._send_lock:
            if self.closed:
                return False
            try:
                self.sock.sendall(frame)
                return True
            except OSError:
                self.close()
                return False

    def recv_one(self, timeout_s: float) -> dict[str, Any] | None:
        """Block for the next message (None: nothing within ``timeout_s``, or not an object); what
        arrives after it stays for ``read``."""
        end = time.monotonic() + timeout_s
        while not self.closed:
            msgs = self._frames(1)
            if msgs:
                return msgs[0]
            left = end - time.monotonic()
            if left <= 0:
                return None
            with selectors.DefaultSelector() as sel:  # (select.select fails for a descriptor >= 1024)
                sel.register(self.sock, selectors.EVENT_READ)
                if not sel.select(left):
                    return None
            self._fill()
        return None

    def read(self) -> list[dict[str, Any]]:
        """The messages that have arrived (without blocking); sets ``closed`` at the peer's end."""
        self._fill()
        return self._frames()

    def _fill(self) -> None:
        """Read what the socket holds, without blocking (a short read means it held no more: a selector
        says when more comes); ``closed`` at the peer's end."""
        while not self.closed:
            try:
                chunk = self.sock.recv(_CHUNK, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self.close()
                return
            if not chunk:
                self.close()
                return
            self._buf += chunk
            if len(chunk) < _CHUNK or len(self._buf) > MAX_FRAME + _HEADER.size:
                return

    def _frames(self, limit: int = -1) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while len(self._buf) >= _HEADER.size and len(out) != limit and not self.closed:
            (n,) = _HEADER.unpack_from(self._buf)
            if n > MAX_FRAME:
                self._broken(f"a frame of {n} bytes, more than {MAX_FRAME}")
                break
            if len(self._buf) < _HEADER.size + n:
                break
            frame, self._buf = self._buf[_HEADER.size:_HEADER.size + n], self._buf[_HEADER.size + n:]
            if frame == _HEARTBEAT:  # (most of what a fleet's driver reads: no parser for it)
                out.append({"kind": "heartbeat"})
                continue
            item = decode(frame)
            if isinstance(item, str):
                self._broken(item)
                break
            out.append(item)
        return out

    def _broken(self, why: str) -> None:
        self.error = why
        self._buf = b""
        self.close()

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


def frame_of(message: dict[str, Any]) -> bytes:
    """``message`` framed, for ``Link.send_frame`` (one encoding for many links)."""
    data = json.dumps(message).encode()
    return _HEADER.pack(len(data)) + data


def challenge() -> tuple[bytes, bytes]:
    """The driver's first step without blocking: a fresh nonce and the frame that carries it."""
    nonce = secrets.token_bytes(_NONCE)
    return nonce, _HEADER.pack(len(nonce)) + nonce


ANSWER_BYTES = _HEADER.size + _DIGEST + _NONCE  # the agent's answer to a challenge, framed


def proof(secret: str, nonce: bytes, answer: bytes) -> bytes:
    """The driver's second step: ``answer`` (``ANSWER_BYTES``, framed) checked against ``nonce``; the
    frame proving the driver holds the secret, or ``AuthError``."""
    (n,) = _HEADER.unpack_from(answer)
    body = answer[_HEADER.size:]
    if n != _DIGEST + _NONCE or len(body) != n or not hmac.compare_digest(body[:_DIGEST],
                                                                          _mac(secret, b"agent", nonce)):
        raise AuthError("the peer does not hold the run's secret")
    mac = _mac(secret, b"driver", body[_DIGEST:])
    return _HEADER.pack(len(mac)) + mac


def decode(frame: bytes) -> dict[str, Any] | str:
    """One frame's message, or why it is not one (not JSON, nested too deep, not an object)."""
    try:
        item = json.loads(frame)
    except RecursionError:
        return f"a frame of {len(frame)} bytes nested deeper than the JSON parser takes"
    except ValueError as exc:  # (UnicodeDecodeError too)
        return f"a frame that is not JSON ({exc})"
    if not isinstance(item, dict):
        return f"a frame holding a JSON {type(item).__name__}, not an object"
    return item


def accept(sock: socket.socket, secret: str, timeout_s: float = AUTH_TIMEOUT_S) -> Link:
    """The driver's side of a new connection ``sock``: challenge it; a ``Link`` once the peer proved it
    holds ``secret``, else ``AuthError`` (the socket closed)."""
    try:
        sock.settimeout(timeout_s)
        nonce = secrets.token_bytes(_NONCE)
        _send_frame(sock, nonce)
        answer = _recv_frame(sock, _DIGEST + _NONCE)
        if len(answer) != _DIGEST + _NONCE or not hmac.compare_digest(answer[:_DIGEST], _mac(secret, b"agent", nonce)):
            raise AuthError("the peer does not hold the run's secret")
        _send_frame(sock, _mac(secret, b"driver", answer[_DIGEST:]))
    except (OSError, EOFError, struct.error) as exc:
        sock.close()
        raise exc if isinstance(exc, AuthError) else AuthError(f"the peer failed the challenge: {exc}") from exc
    return Link(sock)


def connect(host: str, port: int, secret: str, timeout_s: float = AUTH_TIMEOUT_S) -> Link:
    """An agent's connection to the driver at ``host:port``, both sides proved; ``AuthError`` if the
    driver did not prove it holds ``secret``, ``OSError`` if it cannot be reached."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        nonce = _recv_frame(sock, _NONCE)
        mine = secrets.token_bytes(_NONCE)
        _send_frame(sock, _mac(secret, b"agent", nonce) + mine)
        proof = _recv_frame(sock, _DIGEST)
        if not hmac.compare_digest(proof, _mac(secret, b"driver", mine)):
            raise AuthError(f"the driver at {host}:{port} does not hold the run's secret")
    except (OSError, EOFError, struct.error) as exc:
        sock.close()
        raise exc if isinstance(exc, AuthError) else AuthError(f"no answer to the challenge: {exc}") from exc
    return Link(sock)
