"""How a trial's rank 0 talks to its engine: reports out, pruning decisions back.

``PipeChannel`` is the local engine's (a duplex ``multiprocessing`` connection); other engines
provide their own (the compss engine uses files in the shared run directory).
"""

from __future__ import annotations

import abc
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["Channel", "NullChannel", "PipeChannel"]


class Channel(abc.ABC):
    @abc.abstractmethod
    def report(self, step: int, metrics: dict[str, float], wants_answer: bool) -> bool:
        """Send a report; with ``wants_answer`` block for and return the prune decision."""

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
        return bool(kind == "prune" and payload)

    def send(self, kind: str, payload: Any) -> None:
        self.conn.send((kind, payload))
