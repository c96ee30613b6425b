"""How a trial's ranks talk to their engine: the trial transport, pipes and files, in one place.

Rank 0 sends reports out and receives pruning decisions back over a ``Channel``:

- ``PipeChannel``: the local engine's (a duplex ``multiprocessing`` connection to the worker's parent).
- ``FileChannel``: for engines whose ranks run on other nodes (compss), through files in the shared
  run directory, laid out by ``TrialFiles``; the engine side reads them with ``ReportReader``.

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
import json
import logging
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from hpoflow.fileio import append_jsonl, read_json

log = logging.getLogger(__name__)

__all__ = ["Channel", "FileChannel", "NullChannel", "PipeChannel", "ReportReader", "TrialFiles"]

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
        path = self.files.answer(seq)
        deadline = time.monotonic() + self.answer_timeout_s
        delay = 0.02
        while time.monotonic() < deadline:
            data = read_json(path)
            if isinstance(data, dict):
                return self._answered(data)
            if self.files.stop_requested():
                return True  # cancelled: stop training as if pruned; the watcher kills us anyway
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        log.warning("no pruning decision for report %d (step %d) within %g s; training on", seq, step,
                    self.answer_timeout_s)
        return False

    def send(self, kind: str, payload: Any) -> None:
        self._append({"kind": kind, "payload": payload, "time": time.time()})
