"""Process helpers shared by the engines (stdlib only: safe in any process)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["describe_exit", "tail"]


def tail(path: Path, max_bytes: int = 4000) -> str:
    """The last ``max_bytes`` of a text file ('' if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - max_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def describe_exit(code: int | None) -> str:
    """A process's exit code in words: ``killed by SIGKILL``, ``exited with code 1``."""
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"
