"""The rendezvous of a single-host trial is reachable only by the trial's own ranks: no rendezvous
socket at all (a file store in a private directory), gloo pairs on loopback; a peer in another network
namespace (198.18.0.0/15, the benchmarking range) is refused on every port the ranks listen on."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from hpoflow.engines.local import LocalEngine
from hpoflow.spec import TrainConfig
from hpoflow.train.rendezvous import private_dir, store_path
from hpoflow.trial import TrialRequest, TrialResult
from tests.conftest import ROOT

HOST_IP, PEER_IP = "198.18.1.1", "198.18.1.2"

pytestmark = pytest.mark.slow  # a network namespace and a DDP trial


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@pytest.fixture
def peer_namespace() -> Iterator[str]:
    """A namespace joined to this host by a veth pair: host 198.18.1.1/30, peer 198.18.1.2/30."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("network namespaces need root and iproute2")
    tag = str(os.getpid() % 100000)
    ns, host_if, peer_if = f"hprz{tag}", f"hprh{tag}"[:15], f"hprp{tag}"[:15]
    try:
        ip("netns", "add", ns)
        ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        ip("link", "set", peer_if, "netns", ns)
        ip("addr", "add", f"{HOST_IP}/30", "dev", host_if)
        ip("link", "set", host_if, "up")
        ip("-n", ns, "addr", "add", f"{PEER_IP}/30", "dev", peer_if)
        ip("-n", ns, "link", "set", peer_if, "up")
        ip("-n", ns, "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as exc:
        ip("link", "del", host_if, check=False)
        ip("netns", "del", ns, check=False)
        pytest.skip(f"cannot create a network namespace here: {exc}")
    try:
        yield ns
    finally:
        ip("link", "del", host_if, check=False)
        ip("netns", "del", ns, check=False)


def _listening(pids: list[int]) -> list[tuple[str, int]]:
    out = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids and conn.laddr:
            out.append((conn.laddr.ip, conn.laddr.port))
    return out


def test_a_single_host_trial_listens_on_loopback_only_and_refuses_a_remote_peer(
        tmp_path: Path, peer_namespace: str) -> None:
    train = TrainConfig(function="trainfns:hold_group", epochs=1).model_dump(mode="json")
    req = TrialRequest(0, {"hold": 4.0}, train, "value", "maximize", str(tmp_path / "0"), processes=2,
                       python_path=(str(ROOT / "tests"),))
    engine = LocalEngine()
    try:
        engine.submit(req)
        pid_files = [tmp_path / "0" / f"pid{r}" for r in range(2)]
        end = time.monotonic() + 120
        while not all(p.exists() for p in pid_files) and time.monotonic() < end:
            engine.poll(0.1)
        time.sleep(0.5)  # both ranks are inside the group now (the first barrier)
        pids = [int(p.read_text()) for p in pid_files]
        listening = _listening(pids)
        assert listening, "gloo's pairs listen somewhere"
        assert all(addr in ("127.0.0.1", "::1") for addr, _ in listening), listening
        ports = sorted({port for _, port in listening})
        probe = ("import socket,sys\nrefused=0\nfor p in map(int,sys.argv[2:]):\n s=socket.socket()\n"
                 " s.settimeout(2)\n try:\n  s.connect((sys.argv[1],p)); print('OPEN',p)\n"
                 " except OSError: refused+=1\nprint('refused',refused)\n")
        r = subprocess.run(["ip", "netns", "exec", peer_namespace, sys.executable, "-c", probe, HOST_IP,
                            *map(str, ports)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert "OPEN" not in r.stdout and f"refused {len(ports)}" in r.stdout, r.stdout
        results: list[TrialResult] = []
        while not results:
            results = [e for e in engine.poll(1.0) if isinstance(e, TrialResult)]
        assert results[0].status == "complete", results[0]
    finally:
        engine.close()


def test_rendezvous_files_are_private_and_never_reused() -> None:
    d = private_dir()
    try:
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        a, b = store_path(d, 3, 0), store_path(d, 3, 0)
        assert a != b and os.path.dirname(a) == d and "trial3-attempt0" in a
    finally:
        shutil.rmtree(d)
