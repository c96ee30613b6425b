"""A ``Channel`` over files in the shared run directory, for engines whose ranks run on other nodes.

Rank 0 appends each report to ``reports.jsonl`` in the attempt directory; when the report wants a
pruning decision it waits for ``answer-<seq>.json``, which the engine writes in ``answer()``. A
``STOP`` file ends the wait. The whole protocol (paths, atomic writes, the incremental reader) is
in ``hpoflow.tasks._compss_files``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

from hpoflow.tasks._compss_files import TrialFiles, read_json
from hpoflow.train.channel import Channel

__all__ = ["FileChannel"]


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
        line = json.dumps(record, sort_keys=True) + "\n"
        with open(self.files.reports, "a", encoding="utf-8") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())

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
                return bool(data.get("prune"))
            if self.files.stop_requested():
                return True  # cancelled: stop training as if pruned; the watcher kills us anyway
            time.sleep(delay)
            delay = min(delay * 1.5, 0.5)
        print(f"hpoflow: no pruning decision for report {seq} (step {step}) within "
              f"{self.answer_timeout_s:g} s; training on", file=sys.stderr, flush=True)
        return False

    def send(self, kind: str, payload: Any) -> None:
        self._append({"kind": kind, "payload": payload, "time": time.time()})
