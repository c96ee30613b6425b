"""Where a trial's ranks meet (standard library only).

- A single-host trial meets through a file store (``store_path``) in a directory only this user can
  read (``private_dir``): no socket listens for the rendezvous at all, so nothing on another address
  can reach it and there is no port to race for; its gloo/NCCL pairs are bound to loopback
  (``LOOPBACK_ENV``).
- A multi-node trial meets over TCP at ``master_addr:master_port``; ranks other than 0 wait here for
  rank 0's store before joining, so none falls into the store client's retry back-off.
"""

from __future__ import annotations

import os
import socket
import time

__all__ = ["LOOPBACK_ENV", "free_port", "private_dir", "store_path", "wait_for_master"]

# Single-host trials: gloo and NCCL open their pair/bootstrap sockets on loopback only.
LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def private_dir(prefix: str = "hpoflow-rdzv-") -> str:
    """A fresh directory for rendezvous files, readable by this user only (mode 0700)."""
    import tempfile

    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def store_path(directory: str, number: int, attempt: int) -> str:
    """A file store path for one attempt of one trial, never used before (a retry gets its own)."""
    path = os.path.join(directory, f"trial{number}-attempt{attempt}-{os.urandom(4).hex()}.store")
    return path


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
