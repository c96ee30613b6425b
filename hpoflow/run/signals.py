"""Stop signals while a study may run: SIGINT, SIGTERM and SIGUSR1 (a batch system's walltime warning)
are recorded and passed on to what stops the study (the driver's ``request_stop``), never raised.

A ``KeyboardInterrupt`` raised wherever the main thread happens to be is not reliable: a C extension
may turn it into an error of its own (pydantic-core, building a model's schema, raises a
``SchemaError``: a traceback), and CPython ends the process with SIGINT at exit when one ended a
string ``exec`` (a dataclass or a named tuple being made), though the program caught it. So for as
long as a study may run (all of ``hpoflow run``, all of ``optimize``) the handler only records the
signal: the command looks at ``reason`` between its phases, and the driver stops at its next turn.

``stop_signals()`` gives the ``StopSignals`` installed in this process already (an outer block's: the
CLI's, which ``optimize`` then shares), else installs a new one for its block and restores the
previous handlers after it. Signal handlers are the main thread's: elsewhere nothing is installed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType

__all__ = ["StopSignals", "stop_signals"]

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)


class StopSignals:
    """The handler: ``reason`` is the first signal's (``"signal"`` for SIGINT and SIGTERM,
    ``"preempted"`` for SIGUSR1), each one is passed to the attached ``stop`` callable (if any yet)."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._stop: Callable[[str], None] | None = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.request("preempted" if signum == signal.SIGUSR1 else "signal")

    def request(self, reason: str) -> None:
        """Record a stop and pass it on; a signal handler: it never blocks and never raises."""
        if self.reason is None:
            self.reason = reason
        if self._stop is not None:
            self._stop(reason)

    def attach(self, stop: Callable[[str], None]) -> None:
        """From now on a signal calls ``stop(reason)``; one that came before is passed on at once."""
        self._stop = stop
        if self.reason is not None:
            stop(self.reason)


@contextlib.contextmanager
def stop_signals(enabled: bool = True) -> Iterator[StopSignals]:
    """The ``StopSignals`` in force for the block (see the module docstring). ``enabled=False``, or
    outside the main thread: a ``StopSignals`` that no signal reaches."""
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, StopSignals):
        yield current
        return
    stop = StopSignals()
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield stop
        return
    old = {s: signal.signal(s, stop) for s in _SIGNALS}
    try:
        yield stop
    finally:
        for s, h in old.items():
            signal.signal(s, h)
