"""Where a trial's ranks meet: the rendezvous address and port (standard library only).

The driver-side engines pick the address; the ranks (``hpoflow.train.dist``) wait here for rank 0's
store before joining, so no rank falls into the store client's retry back-off.
"""

from __future__ import annotations

import socket
import time

__all__ = ["free_port", "wait_for_master"]


def wait_for_master(addr: str, port: int, timeout_s: float, poll_s: float = 0.002) -> None:
    """Block until rank 0's store accepts connections (or ``timeout_s`` passes).

    A rank that reaches the store before rank 0 has opened it falls into the store client's retry
    back-off and joins up to ~0.75 s late; polling the port every 2 ms joins within milliseconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=0.5):
                return
        except OSError:
            time.sleep(poll_s)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
