"""Process-group set-up and tear-down for one trial (gloo on CPU, nccl on GPU)."""

from __future__ import annotations

import datetime as _dt
import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.distributed import FileStore, TCPStore  # type: ignore[attr-defined]  # not re-exported in the stubs

from hpoflow.train.rendezvous import LOOPBACK_ENV, wait_for_master

__all__ = ["announced_store", "destroy", "group_store", "init_process_group", "store_address"]


def init_process_group(rank: int, world_size: int, master_addr: str, master_port: int,
                       use_cuda: bool, timeout_s: float = 120.0, store_path: str = "",
                       announce_path: str = "") -> None:
    """Join the trial's fresh process group: through the file store at ``store_path`` when given (no
    rendezvous socket; with ``master_addr`` on loopback the gloo/NCCL pairs are bound to loopback
    too); through a TCP store rank 0 holds and announces in the file ``announce_path``
    (``announced_store``: no file lock, so no shared file system needs to give one); else over TCP at
    ``master_addr:master_port``."""
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(0)
    timeout = _dt.timedelta(seconds=timeout_s)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
    if announce_path:
        tcp = announced_store(rank, world_size, announce_path, timeout_s)
        dist.init_process_group(backend, store=tcp, rank=rank, world_size=world_size, timeout=timeout)
        return
    if store_path:
        if master_addr in ("127.0.0.1", "::1", "localhost"):  # a single-host trial
            for key, value in LOOPBACK_ENV.items():
                os.environ.setdefault(key, value)
        store = FileStore(store_path, world_size)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        return
    if rank != 0:
        wait_for_master(master_addr, master_port, timeout_s)
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timeout)


def group_store() -> Store:
    """The key-value store the ranks of this process's group met through (file store or TCP store):
    for what ranks tell each other outside collectives (a command trial's ``hpoflow.train.command``)."""
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def store_address(environ: dict[str, str] | None = None) -> str:
    """The IPv4 address rank 0's store is reached at: that of ``GLOO_SOCKET_IFNAME`` (else
    ``NCCL_SOCKET_IFNAME``) when it names an interface here, so the rendezvous travels the network the
    collectives use; else the address this host's name resolves to."""
    import psutil

    env = os.environ if environ is None else environ
    addrs = psutil.net_if_addrs()
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        name = env.get(var, "").split(",")[0].strip()
        for a in addrs.get(name, []):
            if a.family == socket.AF_INET:
                return str(a.address)
    return socket.gethostbyname(socket.gethostname())


def announced_store(rank: int, world_size: int, announce_path: str, timeout_s: float) -> TCPStore:
    """A TCP store held by rank 0 on a port the kernel picks (no port to race for), announced as
    ``ADDRESS PORT`` in ``announce_path`` (written beside it and renamed into place, so a reader never
    sees half of it); the other ranks wait for the file, then connect. Rank 0 says where in its log."""
    timeout = _dt.timedelta(seconds=timeout_s)
    if rank == 0:
        host = store_address()
        store = TCPStore(host, 0, world_size, True, timeout=timeout, wait_for_workers=False)
        tmp = f"{announce_path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(f"{host} {store.port}\n")
        os.replace(tmp, announce_path)
        print(f"hpoflow: rendezvous: rank 0 holds the trial's TCP store at {host}:{store.port}", file=sys.stderr,
              flush=True)
        return store
    deadline = time.monotonic() + timeout_s
    delay = 0.02
    while True:
        try:
            with open(announce_path) as f:
                host, port = f.read().split()
            break
        except (OSError, ValueError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not announce its store in {announce_path} within {timeout_s:g} s "
                                   "(pg_timeout_s)") from None
            time.sleep(delay)
            delay = min(0.5, delay * 1.5)
    return TCPStore(host, int(port), world_size, False, timeout=timeout)


def destroy(leave_together: bool = True, leave_timeout_s: float = 5.0) -> None:
    """Destroy the process group if one exists (safe to call always, e.g. in ``finally``).

    First the garbage of the trial (DDP reducers in reference cycles still holding the group) is
    collected. With ``leave_together`` on gloo the ranks then meet in a monitored barrier (at
    most ``leave_timeout_s``; a failure is ignored): a rank tearing its gloo pairs down while a
    peer still uses them aborts the process now and then ("terminate called without an active
    exception", about 1 in 60 two-rank DDP runs here, 0 in 100 with the barrier). Pass False on
    an error path: a dead peer never arrives, and the barrier would only add its timeout.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    gc.collect()
    if leave_together and dist.get_backend() == "gloo" and dist.get_world_size() > 1:
        try:
            dist.monitored_barrier(timeout=_dt.timedelta(seconds=leave_timeout_s))
        except Exception:  # a peer that is gone is not this rank's error
            pass
    dist.destroy_process_group()
