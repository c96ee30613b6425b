"""The driver's listening port for node agents: one thread admits them, without blocking, in a stage of
bounded size.

A connection is accepted, challenged (``protocol.challenge``), checked (``protocol.proof``) and must then
send its ``hello``; all of it within ``auth_timeout_s``, on one thread with one selector, whatever the
number of connections. At most ``max_pending`` connections wait in that stage: a new one beyond it
evicts the oldest (an agent answers within a round trip, so the oldest is the likeliest to be a peer
that stalls; an agent evicted by mistake connects again, it retries with back-off). A connection that
fails any step is closed, having read nothing but a nonce, and counted in ``refused``. Running out of
descriptors (``EMFILE``) pauses accepting for a moment; it never ends the thread.

What passes is queued as ``(Link, hello)``: ``take`` returns it, and ``fileno`` is readable while the
queue holds something (for the driver's selector). Standard library only.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import queue
import selectors
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from hpoflow.engines.agent.protocol import ANSWER_BYTES, AUTH_TIMEOUT_S, AuthError, Link, challenge, decode, proof

__all__ = ["MAX_PENDING", "Listener"]

MAX_PENDING = 256  # connections in the challenge at once (a thousand agents connect in a few such rounds)
_HELLO_BYTES = 64 << 10  # an agent's hello is a few hundred bytes
_HEADER = struct.Struct(">I")
_PAUSE_S = 0.5  # accepting waits this long after the process ran out of descriptors
_LOG_EVERY_S = 5.0  # refusals are reported at most this often (a flood must not flood the log)


@dataclass
class _Pending:
    sock: socket.socket
    peer: str
    deadline: float
    nonce: bytes
    buf: bytearray = field(default_factory=bytearray)
    proved: bool = False


class Listener:
    """Admits node agents on ``(host, port 0)``; ``port``, ``take``, ``fileno``, ``refused``, ``close``."""

    def __init__(self, host: str, secret: str, *, max_pending: int = MAX_PENDING,
                 auth_timeout_s: float = AUTH_TIMEOUT_S, backlog: int = 4096) -> None:
        self._secret = secret
        self.max_pending = max_pending
        self.auth_timeout_s = auth_timeout_s
        self.server = socket.create_server((host, 0), backlog=backlog)
        self.server.setblocking(False)
        self.refused = 0  # connections closed before they proved the secret and said hello
        self.admitted = 0
        self._queue: queue.SimpleQueue[tuple[Link, dict[str, Any]]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop_r, self._stop_w = socket.socketpair()
        self._pending: collections.OrderedDict[int, _Pending] = collections.OrderedDict()  # oldest first
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.server, selectors.EVENT_READ, "server")
        self._sel.register(self._stop_r, selectors.EVENT_READ, "stop")
        self._accepting = True
        self._resume_at = 0.0
        self._unlogged: list[str] = []
        self._logged_at = 0.0
        self._emfile_logged_at = -_LOG_EVERY_S
        self._thread = threading.Thread(target=self._run, name="hpoflow-agents-listen", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server.getsockname()[1])

    @property
    def host(self) -> str:
        return str(self.server.getsockname()[0])

    def pending(self) -> int:
        return len(self._pending)

    def fileno(self) -> int:
        """Readable while admitted agents wait to be ``take``-n."""
        return self._wake_r.fileno()

    def take(self) -> list[tuple[Link, dict[str, Any]]]:
        """The agents admitted since the last call: each link and its hello."""
        with contextlib.suppress(OSError):
            while self._wake_r.recv(4096):
                pass
        out = []
        while True:
            try:
                out.append(self._queue.get_nowait())
            except queue.Empty:
                return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._stop_w.send(b"x")
        self._thread.join(5.0)
        for s in (self.server, self._wake_r, self._wake_w, self._stop_r, self._stop_w):
            with contextlib.suppress(OSError):
                s.close()

    # -- the thread ----------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                now = time.monotonic()
                if not self._accepting and now >= self._resume_at:
                    self._accepting = True
                    self._sel.register(self.server, selectors.EVENT_READ, "server")
                wait = 0.25 if self._pending else 1.0  # (expiry is checked at this rate)
                if not self._accepting:
                    wait = max(0.0, min(wait, self._resume_at - now))
                for key, _ in self._sel.select(wait):
                    if key.data == "stop":
                        return
                    if key.data == "server":
                        self._accept()
                    else:
                        self._step(key.data)
                self._expire(time.monotonic())
                self._flush_log(time.monotonic())
        finally:
            for p in list(self._pending.values()):
                self._drop(p, "")
            self._sel.close()

    def _accept(self) -> None:
        while self._accepting:
            try:
                sock, addr = self.server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    if self._pending:  # free a descriptor: the oldest pending peer
                        self._drop(next(iter(self._pending.values())), "evicted: the driver ran out of descriptors")
                    self._accepting = False
                    self._resume_at = time.monotonic() + _PAUSE_S
                    with contextlib.suppress(KeyError, ValueError):
                        self._sel.unregister(self.server)
                    if time.monotonic() - self._emfile_logged_at >= _LOG_EVERY_S:
                        self._emfile_logged_at = time.monotonic()
                        print(f"hpoflow: the driver ran out of file descriptors ({exc.strerror}) accepting node "
                              f"agents: accepting again in {_PAUSE_S:g} s. Fix: raise the open-files limit "
                              "(ulimit -n)", file=sys.stderr, flush=True)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                raise  # (the server socket was closed: the driver ends)
            if len(self._pending) >= self.max_pending:
                self._drop(next(iter(self._pending.values())),
                           f"evicted: {self.max_pending} connections were already in the challenge")
            self._start(sock, addr)

    def _start(self, sock: socket.socket, addr: Any) -> None:
        peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)
        nonce, frame = challenge()
        sock.setblocking(False)
        p = _Pending(sock, peer, time.monotonic() + self.auth_timeout_s, nonce)
        try:
            if sock.send(frame) != len(frame):  # (a fresh socket's buffer takes 36 bytes)
                raise OSError("the nonce did not fit the socket's buffer")
        except OSError as exc:
            self._pending[sock.fileno()] = p
            self._drop(p, f"the challenge failed: {exc}")
            return
        self._pending[sock.fileno()] = p
        self._sel.register(sock, selectors.EVENT_READ, p)

    def _step(self, p: _Pending) -> None:
        try:
            data = p.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(p, f"the peer failed the challenge: {exc}")
            return
        if not data:
            self._drop(p, "the peer closed the connection during the challenge")
            return
        p.buf += data
        try:
            if not p.proved:
                if len(p.buf) < ANSWER_BYTES:
                    return
                answer, rest = bytes(p.buf[:ANSWER_BYTES]), p.buf[ANSWER_BYTES:]
                reply = proof(self._secret, p.nonce, answer)
                p.sock.setblocking(True)  # (36 bytes: sent at once)
                p.sock.settimeout(1.0)
                p.sock.sendall(reply)
                p.sock.setblocking(False)
                p.proved, p.buf = True, bytearray(rest)
            if len(p.buf) < _HEADER.size:
                return
            (n,) = _HEADER.unpack_from(p.buf)
            if n > _HELLO_BYTES:
                raise AuthError(f"a first message of {n} bytes, more than a hello's {_HELLO_BYTES}")
            if len(p.buf) < _HEADER.size + n:
                return
            hello = decode(bytes(p.buf[_HEADER.size:_HEADER.size + n]))
            if isinstance(hello, str):
                raise AuthError(f"its first message: {hello}")
            if hello.get("kind") != "hello":
                raise AuthError(f"its first message is a {hello.get('kind')!r}, not a hello")
        except (AuthError, OSError, struct.error) as exc:
            self._drop(p, str(exc))
            return
        self._pending.pop(p.sock.fileno(), None)
        self._sel.unregister(p.sock)
        link = Link(p.sock, bytes(p.buf[_HEADER.size + n:]))
        link.peer = p.peer
        self.admitted += 1
        self._queue.put((link, hello))
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _expire(self, now: float) -> None:
        while self._pending:
            p = next(iter(self._pending.values()))  # oldest first: deadlines are in order
            if p.deadline > now:
                return
            self._drop(p, f"no proof of the run's secret and hello within {self.auth_timeout_s:g} s")

    def _drop(self, p: _Pending, why: str) -> None:
        self._pending.pop(p.sock.fileno(), None)
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(p.sock)
        with contextlib.suppress(OSError):
            p.sock.close()
        if why:
            self.refused += 1
            self._note(f"dropped a connection to the agents' port from {p.peer} before it was admitted ({why})")

    def _note(self, line: str) -> None:
        self._unlogged.append(line)
        self._flush_log(time.monotonic())

    def _flush_log(self, now: float) -> None:
        if not self._unlogged or now - self._logged_at < _LOG_EVERY_S:
            return
        self._logged_at = now
        more = len(self._unlogged) - 1
        print(f"hpoflow: {self._unlogged[0]}" + (f"; and {more} more such line(s) in the last {_LOG_EVERY_S:g} s"
                                                 if more else ""), file=sys.stderr, flush=True)
        self._unlogged.clear()
