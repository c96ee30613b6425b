"""How a trial's ranks talk to their engine: the trial transport, pipes and files, in one place.

Rank 0 sends reports out and receives pruning decisions back over a ``Channel``:

- ``PipeChannel``: the local engine's (a duplex ``multiprocessing`` connection to the worker's parent).
- ``FileChannel``: for engines whose ranks run on other nodes (compss), through files in the shared
  run directory, laid out by ``TrialFiles``; the engine side reads them with ``ReportReader``.
- ``SocketChannel``: the slurm engine's steps mode. Reports go to the file as with ``FileChannel``
  (the durable record) and, as they are made, over a TCP connection the engine opens to rank 0
  (``ControlLink``); decisions come back over it, so rank 0 waits on the connection, not by polling
  answer files on the shared file system (a Lustre metadata server's load at hundreds of ranks;
  NFS attribute caching delays a file by seconds). Rank 0 listens on a kernel-picked port and
  announces ``ADDRESS PORT TOKEN`` in ``control.addr`` (mode 0600); the engine's first line must be
  the token. Where no engine connects within ``FALLBACK_S``, rank 0 falls back to answer files.
- ``LineServer``: the token-checked JSON-lines server behind ``SocketChannel``, and behind a command
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
- ``outcome-<rank>.json``, ``job.json``, ``heartbeat``: between the task and its rank processes.

Standard library only: the engine, the task body (inside a persistent COMPSs worker) and the node
launchers use it without importing torch.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpoflow.fileio import append_jsonl, read_json, write_atomic

log = logging.getLogger(__name__)

__all__ = ["Channel", "ControlLink", "FileChannel", "LineServer", "NullChannel", "PipeChannel", "ReportReader",
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

    @property
    def control(self) -> Path:
        """Where rank 0 announces its control socket (``SocketChannel``): ``ADDRESS PORT TOKEN``."""
        return self.dir / "control.addr"

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
    """A TCP server of JSON lines for whoever holds its token: the one place a control socket is
    served (rank 0's ``SocketChannel``; a command trial's ``hpoflow.client`` channel). It listens on a
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
                for line in reader:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        continue
                    if not isinstance(msg, dict):
                        continue
                    reply = self._on_message(conn, msg)
                    if reply is not None:
                        conn.sendall(json.dumps(reply).encode() + b"\n")
            finally:
                if self._on_close is not None:
                    self._on_close(conn)


FALLBACK_S = 30.0  # SocketChannel: no engine connected by then: decisions are read from answer files


class SocketChannel(FileChannel):
    """Rank 0's channel in steps mode (see the module docstring): reports to the file and over the
    engine's connection, decisions from it. ``address``: where the engine reaches this node."""

    def __init__(self, files: TrialFiles, answer_timeout_s: float = 600.0, address: str = "127.0.0.1") -> None:
        super().__init__(files, answer_timeout_s)
        self._cv = threading.Condition()
        self._answers: dict[int, dict[str, Any]] = {}
        self._conn: socket.socket | None = None
        self._stopped = False
        self._opened = time.monotonic()
        self._server = LineServer(self._on_message, on_open=self._on_open, on_close=self._on_close)
        self.token = self._server.token
        write_atomic(files.control, self._server.announce(address) + "\n", mode=0o600)

    @property
    def connected(self) -> bool:
        return self._conn is not None

    def _on_open(self, conn: socket.socket) -> None:
        with self._cv:
            self._conn = conn  # the engine's latest connection: reports go there
            self._cv.notify_all()

    def _on_message(self, conn: socket.socket, msg: dict[str, Any]) -> None:
        with self._cv:
            if "seq" in msg:
                self._answers[int(msg["seq"])] = msg
            if msg.get("stop"):
                self._stopped = True
            self._cv.notify_all()

    def _on_close(self, conn: socket.socket) -> None:
        with self._cv:
            if self._conn is conn:
                self._conn = None

    def report(self, step: int, metrics: dict[str, float], wants_answer: bool) -> bool:
        seq = self.seq
        self.seq += 1
        record = {"seq": seq, "step": int(step), "metrics": metrics, "wants_answer": bool(wants_answer),
                  "time": time.time()}
        self._append(record)
        self._push(record)
        if not wants_answer:
            return False
        deadline = time.monotonic() + self.answer_timeout_s
        with self._cv:
            while seq not in self._answers and not self._stopped:
                now = time.monotonic()
                if now >= deadline:
                    break
                if self._conn is None and now - self._opened > FALLBACK_S:
                    self._cv.release()
                    try:  # no engine connected: answer files, as FileChannel reads them
                        return self._wait_for_file(seq, step, deadline, lambda: self._socket_answer(seq), 0.05, 1.0)
                    finally:
                        self._cv.acquire()
                self._cv.wait(min(1.0, deadline - now))
            if self._stopped:
                return True  # cancelled: stop training as if pruned; srun's SIGTERM ends us anyway
            data = self._answers.pop(seq, None)
        if data is None:
            self._no_answer(seq, step)
            return False
        return self._answered(data)

    def _socket_answer(self, seq: int) -> dict[str, Any] | None:
        with self._cv:
            return self._answers.pop(seq, None)  # the engine connected meanwhile

    def send(self, kind: str, payload: Any) -> None:
        record = {"kind": kind, "payload": payload, "time": time.time()}
        self._append(record)
        self._push(record)

    def _push(self, record: dict[str, Any]) -> None:
        with self._cv:
            conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(json.dumps(record).encode() + b"\n")


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


class ControlLink:
    """The engine's end of a ``SocketChannel``: connects to what ``control.addr`` announces, sends
    decisions, and reads the reports rank 0 pushes (``read_new``, without blocking)."""

    def __init__(self, announced: str, timeout_s: float = 5.0) -> None:
        host, port, token = announced.split()
        self.sock = socket.create_connection((host, int(port)), timeout=timeout_s)
        self.sock.sendall(token.encode() + b"\n")
        self.sock.setblocking(False)
        self._buf = b""
        self.closed = False

    def send(self, message: dict[str, Any]) -> bool:
        """Send one message; False when the connection is gone."""
        try:
            self.sock.setblocking(True)
            self.sock.sendall(json.dumps(message).encode() + b"\n")
            self.sock.setblocking(False)
            return True
        except OSError:
            self.close()
            return False

    def read_new(self) -> list[dict[str, Any]]:
        """The records rank 0 pushed since the last call (complete lines only)."""
        if not self.closed:
            data, alive = drain(self.sock)
            self._buf += data
            if not alive:
                self.close()
        *lines, self._buf = self._buf.split(b"\n")
        out = []
        for line in lines:
            with contextlib.suppress(ValueError):
                item = json.loads(line)
                if isinstance(item, dict):
                    out.append(item)
        return out

    def close(self) -> None:
        self.closed = True
        with contextlib.suppress(OSError):
            self.sock.close()
