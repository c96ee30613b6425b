"""The file protocol between the compss engine, its task and the rank processes.

One directory per attempt of a trial (``TrialFiles``); every write atomic (temp file, fsync,
rename) except the report log, which is append-only JSON lines:

- ``reports.jsonl``: rank 0 appends one line per report (``seq``, ``step``, ``metrics``,
  ``wants_answer``) and fsyncs it. A reader uses only complete lines (ending in ``\\n``), so a line
  being written is never half read.
- ``answer-<seq>.json``: the engine's pruning decision for report ``seq`` (``{"prune": bool}``).
- ``STOP``: written by the engine to cancel the attempt; rank processes watch it and kill their
  process group.
- ``result.json``: the task's ``TrialResult`` (written last; its presence means the task ended).
- ``outcome-<rank>.json``, ``job.json``, ``heartbeat``: between the task and its rank processes.

Standard library only: the engine, the task body (inside a persistent COMPSs worker) and the node
launchers use it without importing torch. ``hpoflow.train.file_channel`` is the rank side.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ReportReader", "TrialFiles", "read_json", "write_atomic", "write_json_atomic"]


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old file or the whole new one, never a part.

    The data goes to a temporary file in the same directory, is fsynced, then renamed over ``path``
    (atomic on POSIX, also on NFS/GPFS for a rename within one directory); the directory is fsynced
    so the rename survives a crash of the node.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    try:
        dfd = os.open(path.parent, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    except OSError:
        pass
    finally:
        os.close(dfd)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, sort_keys=True, default=str))


def read_json(path: Path) -> Any | None:
    """The JSON in ``path``, or ``None`` if it does not exist (yet) or is not valid JSON."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


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
