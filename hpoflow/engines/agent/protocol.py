"""The wire between the slurm engine's driver and its node agents: framed JSON over TCP, after a mutual
HMAC-SHA256 challenge on the run's secret.

A frame is a 4-byte big-endian length and that many bytes; a message is one frame holding one JSON
object. Before any message, the side that accepted the connection (the driver) sends a random nonce;
the connecting side (an agent) answers ``HMAC(secret, "agent" + nonce)`` and a nonce of its own; the
driver checks it with ``hmac.compare_digest`` (a peer without the secret is dropped there, having read
nothing but a nonce) and proves itself the same way (``"driver" + nonce``). The secret never travels
and never appears in argv: agents read it from ``SECRET_ENV`` (the step's environment) and drop it from
their environment at once, so nothing a trial starts inherits it.

Standard library and ``hpoflow.train.transport.drain`` (no torch, no pydantic: the agent imports it before
its pool's forkserver starts).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import secrets
import select
import socket
import struct
import threading
import time
from typing import Any

from hpoflow.train.transport import drain

__all__ = ["AUTH_TIMEOUT_S", "SECRET_ENV", "AuthError", "Link", "accept", "connect", "new_secret"]

SECRET_ENV = "HPOFLOW_AGENT_SECRET"
AUTH_TIMEOUT_S = 10.0  # a peer that has not proved itself by then is dropped
_NONCE = 32
_DIGEST = hashlib.sha256().digest_size
_MAX_FRAME = 64 << 20  # a message is a request or an event: far below this
_HEADER = struct.Struct(">I")


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

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        sock.settimeout(None)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""
        self._send_lock = threading.Lock()
        self.closed = False
        self.peer = ""
        with contextlib.suppress(OSError):
            host, port = sock.getpeername()[:2]
            self.peer = f"{host}:{port}"

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the connection is gone."""
        data = json.dumps(message).encode()
        with self._send_lock:
            if self.closed:
                return False
            try:
                _send_frame(self.sock, data)
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
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                return None
            self._fill()
        return None

    def read(self) -> list[dict[str, Any]]:
        """The messages that have arrived (without blocking); sets ``closed`` at the peer's end."""
        self._fill()
        return self._frames()

    def _fill(self) -> None:
        if not self.closed:
            data, alive = drain(self.sock)
            self._buf += data
            if not alive:
                self.close()

    def _frames(self, limit: int = -1) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        while len(self._buf) >= _HEADER.size and len(out) != limit:
            (n,) = _HEADER.unpack_from(self._buf)
            if n > _MAX_FRAME:
                self.close()
                break
            if len(self._buf) < _HEADER.size + n:
                break
            frame, self._buf = self._buf[_HEADER.size:_HEADER.size + n], self._buf[_HEADER.size + n:]
            with contextlib.suppress(ValueError):
                item = json.loads(frame)
                if isinstance(item, dict):
                    out.append(item)
        return out

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self.sock.close()


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
