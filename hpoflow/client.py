"""Talk to the hpoflow trial running your program (``training.command``): the standard library only.

A program that is a command trial's rank may, besides printing ``NAME=VALUE`` lines, report through
this module and ask whether to stop::

    from hpoflow import client

    for epoch in range(start, epochs + 1):
        ...
        client.report(epoch, val_loss=val_loss)   # rank 0's reports reach the study (others: ignored)
        if client.should_stop():                  # pruned, paused, or its last epoch (every rank)
            if client.pausing():                  # it will be resumed: save where it is
                save(client.checkpoint_dir())
            break

It talks to the process supervising its rank (``hpoflow.train.command``) over a local socket named in
``HPOFLOW_CONTROL``. Outside a trial (the same script under plain ``torchrun``) ``report`` does
nothing, ``should_stop`` and ``pausing`` are False and ``checkpoint_dir`` is None. Importing it imports
nothing beyond the standard library: a script's environment needs none of hpoflow's dependencies.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
from pathlib import Path
from typing import Any

__all__ = ["checkpoint_dir", "in_trial", "pausing", "report", "should_stop"]

CONTROL_ENV = "HPOFLOW_CONTROL"
_lock = threading.Lock()
_link: _Link | None = None
_lost = False  # the supervising process is gone: the trial is over


class _Link:
    """One connection to the supervising process: a token line, then a JSON line out and one back."""

    def __init__(self, announced: str) -> None:
        host, port, token = announced.split()
        self.pid = os.getpid()
        self.sock = socket.create_connection((host, int(port)), timeout=30.0)
        self.sock.settimeout(None)
        self.sock.sendall(token.encode() + b"\n")
        self.reader = self.sock.makefile("rb")

    def ask(self, message: dict[str, Any]) -> dict[str, Any]:
        self.sock.sendall(json.dumps(message).encode() + b"\n")
        line = self.reader.readline()
        if not line:
            raise ConnectionError("the trial's supervising process closed the channel")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise ConnectionError(f"unexpected reply {line!r}")
        return reply


def in_trial() -> bool:
    """Whether this process runs as a rank of an hpoflow command trial."""
    return bool(os.environ.get(CONTROL_ENV))


def _ask(message: dict[str, Any]) -> dict[str, Any] | None:
    """The supervisor's reply; None outside a trial, or once the supervisor is gone (said once on stderr)."""
    global _link, _lost
    announced = os.environ.get(CONTROL_ENV)
    if not announced or _lost:
        return None
    with _lock:
        try:
            if _link is None or _link.pid != os.getpid():  # a forked child (a data loader worker) connects anew
                _link = _Link(announced)
            return _link.ask(message)
        except (OSError, ValueError) as exc:
            _lost = True
            print(f"hpoflow.client: the trial's channel is gone ({exc}); should_stop() is True from now on",
                  file=sys.stderr, flush=True)
            return None


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise TypeError(f"hpoflow.client.report: metric {name!r} is {value!r}: a bool is not a metric "
                        "(report float(flag))")
    try:
        return float(value)  # int, float, a NumPy scalar, a one-element tensor
    except (TypeError, ValueError):
        raise TypeError(f"hpoflow.client.report: metric {name!r} is {value!r}: it must be a real number (int, "
                        "float, a NumPy scalar, a one-element tensor)") from None


def report(step: int, /, **metrics: Any) -> None:
    """Report ``metrics`` at ``step`` (an epoch, a global step). Rank 0's reports reach the study, where the
    pruner or scheduler decides on them; it returns once they have (``should_stop()`` then knows)."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"hpoflow.client.report: step must be a whole number, but got {step!r}")
    values = {str(k): _number(str(k), v) for k, v in metrics.items()}
    reply = _ask({"op": "report", "step": step, "metrics": values})
    if reply is not None and reply.get("error"):
        raise ValueError(f"hpoflow.client.report: {reply['error']}")


def should_stop() -> bool:
    """Whether the trial wants this program to stop now: pruned, paused, or past ``training.epochs``;
    the same on every rank. After ``training.stop_grace_s`` it is stopped (SIGTERM, then SIGKILL)."""
    if _lost:
        return True
    reply = _ask({"op": "state"})
    return bool(reply.get("stop")) if reply is not None else _lost


def pausing() -> bool:
    """Whether the stop is a pause (a scheduler's rung, the engine's walltime, a PBT interval's end): the
    trial resumes later from what the program saved in ``checkpoint_dir()``."""
    reply = _ask({"op": "state"})
    return bool(reply.get("pausing")) if reply is not None else False


def checkpoint_dir() -> Path | None:
    """The trial's checkpoint directory (``HPOFLOW_CHECKPOINT_DIR``): save there, resume from there. A
    paused trial's next run, and a PBT member's next interval, find there what was saved. None outside a
    trial."""
    path = os.environ.get("HPOFLOW_CHECKPOINT_DIR")
    return Path(path) if path else None
