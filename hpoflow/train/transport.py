"""How a trial's ranks talk to their engine: the trial transport, pipes and files, in one place.

Rank 0 sends reports out and receives pruning decisions back over a ``Channel``:

- ``PipeChannel``: the local engine's (a duplex ``multiprocessing`` connection to the worker's parent).
- ``FileChannel``: for engines whose ranks run on other nodes (compss), through files in the shared
  run directory, laid out by ``TrialFiles``; the engine side reads them with ``ReportReader``.
- ``SocketChannel``: the slurm engine's steps mode. Reports go to the file as with ``FileChannel``
  (the durable record) and, as they are made, over a TCP connection rank 0 opens to the engine's
  ``ControlServer`` (one listening socket for the whole study, at the address and port the job file
  names, with a random token per attempt); decisions and stops come back over it. Neither side polls a
  file: rank 0 waits on the connection, and the engine reads no ``reports.jsonl`` and no address file
  while a step runs (at hundreds of ranks, a Lustre metadata server's load; NFS attribute caching
  delays a file by seconds). Where rank 0 cannot connect within ``CONNECT_S`` it trains on without
  decisions, and the engine reads its reports from the file once, when the step has ended.
- ``LineServer``: a token-checked JSON-lines server with a thread per connection, behind a command
  trial's channel to its program (``hpoflow.train.command``, ``hpoflow.client``: ``HPOFLOW_CONTROL``).

The file protocol: one directory per attempt of a trial (``TrialFiles``); every write atomic (temp
file, fsync, rename: ``hpoflow.fileio``) except the report log, which is append-only JSON lines:

- ``reports.jsonl``: rank 0 appends one line per report (``seq``, ``step``, ``metrics``,
  ``wants_answer``) and fsyncs it. A reader uses only complete lines (ending in ``\\n``), so a line
  being written is never half read.
- ``answer-<seq>.json``: the engine's decision for report ``seq`` (``{"prune": bool}``, for an
  elastic trial ``"world"``: the number of ranks to continue with, 0 for no change, and
  ``"pause": true`` when a scheduler pauses the trial at this step: checkpoint here and stop, to be
  resumed later with more budget; docs/schedulers.md).
- ``STOP``: written by the engine to cancel the attempt; rank processes watch it and kill their
  process group.
- ``PAUSE``: written by the engine to pause the attempt (stop at the next step with a checkpoint); each
  rank's watcher turns it into the SIGUSR1 the rank's training loop reacts to.
- ``result.json``: the task's ``TrialResult`` (written last; its presence means the task ended);
  ``status: resized`` when an elastic trial's ranks all left to be restarted on another size.
- ``outcome-<rank>.json``, ``job.json``, ``heartbeat``: between the task and its rank processes
  (``job.json`` of a step, mode 0600, holds the token of rank 0's connection to the engine).

Standard library only: the engine, the task body (inside a persistent COMPSs worker) and the node
launchers use it without importing torch.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import secrets
import selectors
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpoflow.fileio import append_jsonl, read_json

log = logging.getLogger(__name__)

__all__ = ["Channel", "ControlServer", "FileChannel", "LineServer", "NullChannel", "PipeChannel", "ReportReader",
           "SocketChannel", "TrialFiles", "drain"]

class Channel(abc.ABC):
    """Rank 0's line to its engine. An answer to a report carries the pruning decision and, for an
    elastic trial, ``world``: the number of ranks the engine wants the trial to continue with (0: as it
    is), kept in ``resize_to`` until the next answer; ``pause``: a scheduler wants the trial to stop
    here with a checkpoint (``pause_asked``, until the next answer)."""

    resize_to: int = 0
    pause_asked: bool = False

    @abc.abstractmethod
    def report(self, step: int, metrics: dict[str, float], wants_answer: bool) -> bool:
        """Send a report; with ``wants_answer`` block for and return the prune decision."""

    def _answered(self, answer: Any) -> bool:
        """Take an answer (a bool, or ``{"prune": bool, "world": int}``); the prune decision."""
        if isinstance(answer, dict):
            self.resize_to = max(0, int(answer.get("world") or 0))
            self.pause_asked = bool(answer.get("pause"))
            return bool(answer.get("prune"))
        self.resize_to = 0
        self.pause_asked = False
        return bool(answer)

    @abc.abstractmethod
    def send(self, kind: str, payload: Any) -> None:
        """Send a message of ``kind`` (``result``, ``error``, ``started``)."""


class NullChannel(Channel):
    """A channel that records reports and never prunes (for ranks other than 0 and for tests)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, Any]] = []

    def report(self, step: int, metrics: dict[str, float], wants_answer: bool) -> bool:
        self.messages.append(("report", (step, metrics)))
        return False

    def send(self, kind: str, payload: Any) -> None:
        self.messages.append((kind, payload))


class PipeChannel(Channel):
    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def report(self, step: int, metrics: dict[str, float], wants_answer: bool) -> bool:
        self.conn.send(("report", (step, metrics, wants_answer)))
        if not wants_answer:
            return False
        kind, payload = self.conn.recv()
        return self._answered(payload) if kind == "prune" else False

    def send(self, kind: str, payload: Any) -> None:
        self.conn.send((kind, payload))


@dataclass(frozen=True)
class TrialFiles:
    """The protocol files of one attempt of one trial: ``<trial_dir>/attempt-<attempt>/``."""

    trial_dir: Path
    attempt: int = 0

    @property
    def dir(self) -> Path:
        return self.trial_dir / f"attempt-{self.attempt}"

    @property
    def result(self) -> Path:
        return self.dir / "result.json"

    @property
    def reports(self) -> Path:
        return self.dir / "reports.jsonl"

    @property
    def stop(self) -> Path:
        return self.dir / "STOP"

    @property
    def pause(self) -> Path:
        """Written by the engine to pause the attempt: every rank stops at one step with a checkpoint."""
        return self.dir / "PAUSE"

    @property
    def job(self) -> Path:
        return self.dir / "job.json"

    @property
    def heartbeat(self) -> Path:
        return self.dir / "heartbeat"

    def answer(self, seq: int) -> Path:
        return self.dir / f"answer-{seq}.json"

    def outcome(self, rank: int) -> Path:
        return self.dir / f"outcome-{rank}.json"

    def rank_log(self, rank: int) -> Path:
        return self.trial_dir / f"rank{rank}.log"

    def node_log(self, node: int) -> Path:
        return self.trial_dir / f"node{node}.log"

    def stop_requested(self) -> bool:
        return self.stop.exists()


class ReportReader:
    """Reads new complete lines of a ``reports.jsonl`` (incrementally, by byte offset)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        end = data.rfind(b"\n")
        if end < 0:
            return []  # nothing, or only a line still being written
        self.offset += end + 1
        out = []
        for line in data[: end + 1].splitlines():
            try:
                item = json.loads(line)
            except ValueError:
                continue  # a torn line (a crash mid-append): skip it, the next ones are whole
            if isinstance(item, dict):
                out.append(item)
        return out


class FileChannel(Channel):
    """Rank 0's channel: reports appended to ``reports.jsonl``; decisions read from answer files.

    ``answer_timeout_s``: how long to wait for a decision before training on (not pruned), so a
    lost driver never hangs a trial forever. A ``STOP`` file ends the wait at once.
    """

    def __init__(self, files: TrialFiles, answer_timeout_s: float = 600.0) -> None:
        self.files = files
        self.answer_timeout_s = answer_timeout_s
        self.seq = 0
        files.dir.mkdir(parents=True, exist_ok=True)

    def _append(self, record: dict[str, Any]) -> None:
        append_jsonl(self.files.reports, record)

    def report(self, step: int, metrics: dict[str, float], wants_answer: bool) -> bool:
        seq = self.seq
        self.seq += 1
        self._append({"seq": seq, "step": int(step), "metrics": metrics, "wants_answer": bool(wants_answer),
                      "time": time.time()})
        if not wants_answer:
            return False
        stop = lambda: True if self.files.stop_requested() else None  # noqa: E731  # cancelled: as if pruned
        return self._wait_for_file(seq, step, time.monotonic() + self.answer_timeout_s, stop)

    def _wait_for_file(self, seq: int, step: int, deadline: float, other: Callable[[], bool | dict[str, Any] | None],
                       first_delay: float = 0.02, max_delay: float = 0.5) -> bool:
        """Wait for ``answer-<seq>.json`` until ``deadline``, polling with a growing delay; ``other()``
        may decide first (True: stop as if pruned; a dict: the decision). No decision: train on."""
        path = self.files.answer(seq)
        delay = first_delay
        while time.monotonic() < deadline:
            data = read_json(path)
            if isinstance(data, dict):
                return self._answered(data)
            got = other()
            if got is True:
                return True
            if isinstance(got, dict):
                return self._answered(got)
            time.sleep(delay)
            delay = min(delay * 1.5, max_delay)
        self._no_answer(seq, step)
        return False

    def _no_answer(self, seq: int, step: int) -> None:
        log.warning("no pruning decision for report %d (step %d) within %g s; training on", seq, step,
                    self.answer_timeout_s)

    def send(self, kind: str, payload: Any) -> None:
        self._append({"kind": kind, "payload": payload, "time": time.time()})


class LineServer:
    """A TCP server of JSON lines for whoever holds its token, a thread per connection (a command trial's
    ``hpoflow.client`` channel, one client on this host). It listens on a
    port the kernel picks (on ``host``: ``""`` every interface, ``127.0.0.1`` this host only); a
    connection's first line must be the token (else it is closed), then each line is one JSON object,
    handed to ``on_message(conn, message)``, whose reply (a dict) goes back as one line. ``announce``
    says where it is: ``ADDRESS PORT TOKEN``."""

    def __init__(self, on_message: Callable[[socket.socket, dict[str, Any]], dict[str, Any] | None], *,
                 host: str = "", on_open: Callable[[socket.socket], None] | None = None,
                 on_close: Callable[[socket.socket], None] | None = None, name: str = "hpoflow-control") -> None:
        self._server = socket.create_server((host, 0))
        self.token = secrets.token_hex(16)
        self._on_message, self._on_open, self._on_close = on_message, on_open, on_close
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def announce(self, address: str) -> str:
        return f"{address} {self.port} {self.token}"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.close()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn:
            conn.settimeout(10.0)
            reader = conn.makefile("rb")
            if reader.readline().strip() != self.token.encode():
                return
            conn.settimeout(None)
            if self._on_open is not None:
                self._on_open(conn)
            try:
                for msg in _json_objects(reader):
                    reply = self._on_message(conn, msg)
                    if reply is not None:
                        conn.sendall(json.dumps(reply).encode() + b"\n")
            finally:
                if self._on_close is not None:
                    self._on_close(conn)


def _json_objects(lines: Iterable[bytes]) -> Iterator[dict[str, Any]]:
    """The JSON objects of a stream of lines, in order; a line that is not one is skipped."""
    for line in lines:
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if isinstance(msg, dict):
            yield msg


CONNECT_S = 30.0  # SocketChannel: rank 0 tries to reach the engine this long (with back-off), then trains on
MAX_LINE = 1 << 20  # ControlServer: a line longer than this closes its connection


class SocketChannel(FileChannel):
    """Rank 0's channel in steps mode (see the module docstring): reports to the file and over a
    connection to the engine's ``ControlServer``, decisions back over it. ``engine``: what the engine
    put in the job file, ``HOST PORT TOKEN`` (the host may be overridden by the caller: a step's rank
    reaches the driver at ``SLURM_LAUNCH_NODE_IPADDR``); ``hello``: sent after the token (where the
    step runs: its id and nodes). Rank 0 connects in the background with back-off for ``CONNECT_S``;
    where it cannot, it trains on without decisions (said once in its log) and the engine reads its
    reports from ``reports.jsonl`` when the step ends."""

    def __init__(self, files: TrialFiles, answer_timeout_s: float = 600.0, *, engine: str,
                 hello: dict[str, Any] | None = None) -> None:
        super().__init__(files, answer_timeout_s)
        host, port, token = engine.split()
        self._target = (host, int(port))
        self._cv = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}
        self._conn: socket.socket | None = None
        self._gave_up = False
        self._stopped = False
        self._first = (token + "\n" + json.dumps({"hello": hello or {}}) + "\n").encode()
        threading.Thread(target=self._connect, name="hpoflow-control", daemon=True).start()

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def _connect(self) -> None:
        end, delay, last = time.monotonic() + CONNECT_S, 0.05, ""
        while True:
            try:
                conn = socket.create_connection(self._target, timeout=max(0.1, min(5.0, end - time.monotonic())))
                conn.settimeout(None)
                conn.sendall(self._first)
                break
            except OSError as exc:
                last = str(exc)
            if time.monotonic() + delay >= end:
                log.warning("rank 0 could not reach the engine at %s:%d within %g s (%s): reports go to %s only, "
                            "and this trial gets no pruning decisions", *self._target, CONNECT_S, last,
                            self.files.reports)
                with self._cv:
                    self._gave_up = True
                    self._cv.notify_all()
                return
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
        with self._cv:
            self._conn = conn
            self._cv.notify_all()
        self._read(conn)

    def _read(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError), conn.makefile("rb") as reader:
            for msg in _json_objects(reader):
                with self._cv:
                    if "seq" in msg:
                        self._answers[int(msg["seq"])] = msg
                    if msg.get("stop"):
                        self._stopped = True
                    self._cv.notify_all()
        with self._cv:  # the engine went away: no more decisions
            self._conn = None
            self._gave_up = True
            self._cv.notify_all()

    def report(self, step: int, metrics: dict[str, float], wants_answer: bool) -> bool:
        seq = self.seq
        self.seq += 1
        record = {"seq": seq, "step": int(step), "metrics": metrics, "wants_answer": bool(wants_answer),
                  "time": time.time()}
        self._append(record)
        self._push(record, wait=True)
        if not wants_answer:
            return False
        deadline = time.monotonic() + self.answer_timeout_s
        with self._cv:
            while seq not in self._answers and not self._stopped and not self._gave_up:
                now = time.monotonic()
                if now >= deadline:
                    break
                self._cv.wait(min(1.0, deadline - now))
            if self._stopped:
                return True  # cancelled: stop training as if pruned; srun's SIGTERM ends us anyway
            data = self._answers.pop(seq, None)
        if data is None:
            self._no_answer(seq, step)
            return False
        return self._answered(data)

    def send(self, kind: str, payload: Any) -> None:
        record = {"kind": kind, "payload": payload, "time": time.time()}
        self._append(record)
        self._push(record)

    def _push(self, record: dict[str, Any], wait: bool = False) -> None:
        """Send ``record`` to the engine; with ``wait``, first wait while rank 0 is still connecting (a
        report made in the first moments is not left to the file alone)."""
        with self._cv:
            while wait and self._conn is None and not self._gave_up:
                self._cv.wait(1.0)
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(record).encode() + b"\n")

    def close(self) -> None:
        with self._cv:
            conn, self._conn, self._gave_up = self._conn, None, True
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def drain(sock: socket.socket) -> tuple[bytes, bool]:
    """What ``sock`` has ready, read without blocking, and whether its peer is still there (False: the
    peer closed the connection, or the socket failed; what came before is returned all the same)."""
    chunks: list[bytes] = []
    while True:
        try:
            chunk = sock.recv(1 << 20, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return b"".join(chunks), True
        except OSError:
            return b"".join(chunks), False
        if not chunk:
            return b"".join(chunks), False
        chunks.append(chunk)


@dataclass
class _Peer:
    """One connection to a ``ControlServer``: its token once it sent one, what it sent since, unread."""

    sock: socket.socket
    opened: float
    token: str | None = None
    buf: bytes = b""
    inbox: list[dict[str, Any]] = field(default_factory=list)
    closed: bool = False


class ControlServer:
    """The engine's end of the steps-mode control connections: one listening socket for every trial.
    Rank 0 of an attempt connects (``SocketChannel``), sends the attempt's token (``expect``) as its
    first line, then its hello and its reports as JSON lines; the engine sends decisions and stops
    (``send``). Nothing here blocks and no thread serves it: the engine's poll waits in ``wait`` on the
    listener and every connection at once, so work per wake-up follows the sockets that are ready. A
    connection that has not sent a known token within ``preauth_s`` is closed, and at most
    ``max_pending`` wait to send one (the oldest goes first)."""

    def __init__(self, host: str = "", *, preauth_s: float = 10.0, max_pending: int = 64) -> None:
        self._server = socket.create_server((host, 0), backlog=128)
        self._server.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(self._server, selectors.EVENT_READ, None)
        self._preauth_s, self._max_pending = preauth_s, max_pending
        self._expected: set[str] = set()
        self._peers: dict[str, _Peer] = {}  # token -> its latest connection
        self._pending: list[_Peer] = []

    @property
    def port(self) -> int:
        return int(self._server.getsockname()[1])

    def new_token(self) -> str:
        """A token for one attempt of a trial: its rank 0's connection is known by it."""
        token = secrets.token_hex(16)
        self._expected.add(token)
        return token

    def forget(self, token: str) -> None:
        """The attempt ended: its connection is closed and its token no longer admitted."""
        self._expected.discard(token)
        peer = self._peers.pop(token, None)
        if peer is not None:
            self._drop(peer)

    def connected(self, token: str) -> bool:
        peer = self._peers.get(token)
        return peer is not None and not peer.closed

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for any socket to be ready, then accept and read what is."""
        now = time.monotonic()
        for peer in [p for p in self._pending if now - p.opened > self._preauth_s]:
            self._drop(peer)
        if self._pending:
            timeout = min(timeout, max(0.0, min(p.opened for p in self._pending) + self._preauth_s - now))
        for key, _ in self._sel.select(max(0.0, timeout)):
            if key.data is None:
                self._accept()
            else:
                self._read(key.data)

    def messages(self, token: str) -> list[dict[str, Any]]:
        """What the attempt's rank 0 sent since the last call (its hello, reports...)."""
        peer = self._peers.get(token)
        if peer is None or not peer.inbox:
            return []
        out, peer.inbox = peer.inbox, []
        return out

    def send(self, token: str, message: dict[str, Any]) -> bool:
        """Send one message to the attempt's rank 0; False when it is not connected."""
        peer = self._peers.get(token)
        if peer is None or peer.closed:
            return False
        try:
            peer.sock.setblocking(True)
            peer.sock.settimeout(5.0)
            peer.sock.sendall(json.dumps(message).encode() + b"\n")
            peer.sock.setblocking(False)
            return True
        except OSError:
            self._drop(peer)
            return False

    def close(self) -> None:
        for peer in [*self._pending, *self._peers.values()]:
            self._drop(peer)
        self._pending.clear()
        self._peers.clear()
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(self._server)
        with contextlib.suppress(OSError):
            self._server.close()
        self._sel.close()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # EMFILE and the like: the connection waits in the backlog
                log.warning("the engine's control socket cannot accept a connection now: %s", exc)
                return
            sock.setblocking(False)
            peer = _Peer(sock, time.monotonic())
            self._sel.register(sock, selectors.EVENT_READ, peer)
            self._pending.append(peer)
            while len(self._pending) > self._max_pending:
                self._drop(self._pending[0])

    def _read(self, peer: _Peer) -> None:
        data, alive = drain(peer.sock)
        peer.buf += data
        *lines, peer.buf = peer.buf.split(b"\n")
        if len(peer.buf) > MAX_LINE:
            alive = False
        for line in lines:
            if peer.token is None:
                token = line.strip().decode(errors="replace")
                if token not in self._expected:
                    alive = False
                    break
                self._pending.remove(peer)
                old = self._peers.get(token)
                if old is not None:
                    self._drop(old)
                peer.token = token
                self._peers[token] = peer
                continue
            with contextlib.suppress(ValueError, RecursionError):
                item = json.loads(line)
                if isinstance(item, dict):
                    peer.inbox.append(item)
        if not alive:
            self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        if peer in self._pending:
            self._pending.remove(peer)
        if peer.closed:
            return
        peer.closed = True
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()
