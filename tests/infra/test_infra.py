"""The real test infrastructure works: namespaces on a bridge, a SLURM cluster in them, a PostgreSQL server.

Timeouts here are generous bounds for a loaded 2-core machine, never measurements: a test waits for a
state and fails only if it does not come within minutes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.infra.netns import (
    NETNS_DIR,
    NetnsCluster,
    NetnsError,
    ip,
    sweep_lock,
    sweep_stale,
    unavailable_reason,
)
from tests.infra.postgres import PostgresServer
from tests.infra.slurm import SlurmCluster, mount_namespace, write_script


def _wait_for(ok: Callable[[], bool], timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not ok():
        if time.monotonic() > end:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


# -- network namespaces ----------------------------------------------------------------------------
@pytest.fixture
def netns_cluster() -> NetnsCluster:
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    return NetnsCluster(2)


def test_namespaces_reach_each_other_through_the_bridge_and_nothing_else(netns_cluster: NetnsCluster) -> None:
    net = netns_cluster
    try:
        net.create()
    except NetnsError as exc:
        pytest.skip(f"cannot create network namespaces: {exc}")
    try:
        a, b = net.nodes
        own = subprocess.run(net.nsenter(0, ["ip", "-4", "-o", "addr", "show", "dev", net.IFNAME]),
                             capture_output=True, text=True, check=True, timeout=30).stdout
        assert f"{a.address}/24" in own
        server = subprocess.Popen(net.nsenter(1, [sys.executable, "-c", (
            "import socket\n"
            "s = socket.socket(); s.bind(('0.0.0.0', 7999)); s.listen(); s.settimeout(60)\n"
            "c, peer = s.accept(); c.sendall(peer[0].encode()); c.close()\n")]), stdout=subprocess.PIPE, text=True)
        client = (
            "import socket, sys, time\n"
            "for _ in range(600):\n"
            "    try:\n"
            f"        c = socket.create_connection(('{b.address}', 7999), timeout=5); break\n"
            "    except OSError: time.sleep(0.1)\n"
            "print(c.recv(100).decode())\n")
        got = subprocess.run(net.nsenter(0, [sys.executable, "-c", client]), capture_output=True, text=True,
                             check=True, timeout=120).stdout.strip()
        server.wait(60)
        assert got == a.address  # node 1 saw node 0's own address: bridged, not routed or NATed
        host = subprocess.run(["ip", "-4", "-o", "addr", "show", "dev", net.bridge], capture_output=True,
                              text=True, check=True, timeout=30).stdout
        assert f"{net.bridge_address}/24" in host
        # no default route in a namespace: nothing outside the bridge's /24 is reachable (a lookup, no traffic)
        route = subprocess.run(net.nsenter(0, ["ip", "route", "get", "192.0.2.1"]), capture_output=True, text=True,
                               timeout=30)
        assert route.returncode != 0 and "unreachable" in route.stderr
        assert all(addr.startswith("198.18.") for addr in (net.bridge_address, a.address, b.address))
    finally:
        net.destroy()
    names = ip("netns", "list").stdout
    assert a.name not in names and b.name not in names
    assert ip("link", "show", net.bridge, check=False).returncode != 0
    net.destroy()  # idempotent


def test_a_creation_that_fails_half_way_leaves_nothing(netns_cluster: NetnsCluster) -> None:
    net = netns_cluster
    blocker = net.nodes[1].host_veth  # the second veth's name is taken: create() fails after node 0 is made
    if ip("link", "add", blocker, "type", "bridge", check=False).returncode != 0:
        pytest.skip("cannot create links here")
    try:
        with pytest.raises(NetnsError, match="exists"):
            net.create()
        names = ip("netns", "list").stdout
        assert net.nodes[0].name not in names and net.nodes[1].name not in names
        assert not (NETNS_DIR / net.nodes[0].name).exists()
        assert ip("link", "show", net.bridge, check=False).returncode != 0
        assert ip("link", "show", net.nodes[0].host_veth, check=False).returncode != 0
    finally:
        ip("link", "del", blocker, check=False)


def test_what_a_killed_session_left_is_swept(netns_cluster: NetnsCluster) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()  # its pid is now dead: stands for a test session killed with SIGKILL
    names = [f"hin{gone.pid}x0n0", f"hib{gone.pid}x0"]
    mine = f"hin{os.getpid()}x99n0"
    try:
        with sweep_lock():  # another worker's create() sweeps too: it must not take these first
            ip("netns", "add", names[0])
            ip("netns", "add", mine)
            if ip("link", "add", names[1], "type", "bridge", check=False).returncode != 0:
                pytest.skip("cannot create links here")
            swept = sweep_stale(locked=True)
        assert set(names) <= set(swept) and mine not in swept
        assert names[0] not in ip("netns", "list").stdout.split()
        assert ip("link", "show", names[1], check=False).returncode != 0
        assert mine in ip("netns", "list").stdout.split()  # a live process's namespace is kept
    finally:
        for name in (*names[:1], mine):
            ip("netns", "del", name, check=False)
        ip("link", "del", names[1], check=False)


# -- SLURM -----------------------------------------------------------------------------------------
def test_srun_runs_one_task_in_each_node_namespace(slurm_cluster: SlurmCluster, slurm_env: dict[str, str]) -> None:
    out = slurm_cluster.run(["srun", "-N2", "-n2", "--ntasks-per-node=1", "sh", "-c",
                             'echo "$SLURMD_NODENAME $SLURM_PROCID $(hostname -I)"']).stdout
    seen = {parts[0]: parts[2:] for parts in (line.split() for line in out.splitlines())}
    assert {name: slurm_cluster.host_addresses(name) for name in slurm_cluster.node_names} == seen
    assert all(addr.startswith("198.18.") for addr in slurm_cluster.node_addresses.values())


def test_sbatch_wait_writes_into_the_shared_dir(slurm_cluster: SlurmCluster, slurm_env: dict[str, str]) -> None:
    shared = slurm_cluster.shared_dir
    script = write_script(shared / "job.sh", 'echo "$SLURMD_NODENAME $(hostname -I)" > "$OUT_DIR/done-$SLURM_JOB_ID"\n'
                                             'srun -n1 true\n')
    proc = slurm_cluster.run(["sbatch", "--wait", "--parsable", "-N1", "-o", str(shared / "slurm-%j.out"),
                              "--export=ALL", str(script)], env={"OUT_DIR": str(shared)}, timeout=300)
    job_id = proc.stdout.strip().split(";")[0]
    node, *addrs = (shared / f"done-{job_id}").read_text().split()
    assert slurm_cluster.host_addresses(node) == addrs
    info = slurm_cluster.job_info(job_id)
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0")
    assert f"JobId={job_id} " in slurm_cluster.jobcomp_path.read_text()  # what sacct would show


def test_a_failing_batch_job_is_reported_failed(slurm_cluster: SlurmCluster, slurm_env: dict[str, str]) -> None:
    proc = slurm_cluster.run(["sbatch", "--wait", "--parsable", "-o", "/dev/null", "--wrap", "exit 3"],
                             check=False, timeout=300)
    assert proc.returncode == 3
    info = slurm_cluster.job_info(proc.stdout.strip().split(";")[0])
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "3:0")
    assert "accounting storage is disabled" in slurm_cluster.run(["sacct"], check=False).stderr


@pytest.mark.slow  # a job killed and a node taken down and resumed: ~10 s
def test_a_node_set_down_fails_its_job_and_comes_back_on_resume(slurm_cluster: SlurmCluster,
                                                                 slurm_env: dict[str, str]) -> None:
    c = slurm_cluster
    marker = c.shared_dir / "down-test-running"
    job_id = c.run(["sbatch", "--parsable", "-N1", "-w", "n2", "-o", "/dev/null", "--wrap",
                    f"srun sh -c 'touch {marker}; exec sleep 600'"]).stdout.strip()
    try:
        _wait_for(marker.exists, 120, "the job's step to start on n2")
        c.down_node("n2", reason="infra test")
        assert c.node_states()["n2"].startswith("down")
        _wait_for(lambda: c.job_info(job_id)["JobState"] == "NODE_FAIL", 120, "the job to end NODE_FAIL")
        slurmd = c.slurmd["n2"].pid
        _wait_for(lambda: c.net is not None and c.net.pids(c.namespace("n2")) == [slurmd], 120,
                  "the job's processes on n2 to be killed (slurmd alone left)")
        assert c.node_states()["n2"].startswith("down")  # an admin DOWN does not come back by itself
        pending = c.run(["srun", "-w", "n2", "--immediate=5", "true"], check=False)
        assert pending.returncode != 0
    finally:
        c.resume_node("n2")
    c.wait_idle()
    assert c.run(["srun", "-w", "n2", "hostname", "-I"]).stdout.split() == c.host_addresses("n2")


@pytest.mark.slow  # waits for slurmctld to notice a dead slurmd: SlurmdTimeout (10 s) + a ping period, ~30 s
def test_a_killed_slurmd_is_noticed_and_a_restarted_one_rejoins(slurm_cluster: SlurmCluster,
                                                                 slurm_env: dict[str, str]) -> None:
    c = slurm_cluster
    c.kill_slurmd("n1")
    try:
        # measured ~15 s to "not responding" and ~27 s to DOWN here; 180 s leaves room for a loaded machine
        c.wait_states({"n1": ("down*",)}, timeout=180)
    finally:
        c.start_slurmd("n1")
    c.wait_idle()  # ReturnToService=1: a node DOWN for not responding is back once its slurmd registers
    assert c.run(["srun", "-N2", "-n2", "true"]).returncode == 0


@pytest.mark.slow  # n2's slurmd restarted twice, a step on each node: ~10 s
def test_a_node_on_a_dev_shm_of_its_own_leaves_the_hosts_alone(slurm_cluster: SlurmCluster) -> None:
    """``private_shm``: n2's steps see a 1 MiB tmpfs on /dev/shm, filled from inside its namespace, while
    n1's and the host's stay the host's; afterwards n2's steps see the host's again, and nothing is left in
    the namespace."""
    c = slurm_cluster
    marker = f"hpoflow-marker-{os.getpid()}"

    def shm_of(node: str) -> tuple[str, bool]:
        """/dev/shm as a step on ``node`` sees it: its size in KiB, and whether the marker is there."""
        out = c.run(["srun", "-w", node, "sh", "-c", f"df -k /dev/shm | tail -1; ls /dev/shm | grep -c {marker}"],
                    check=False).stdout.split()
        return out[1], out[-1] != "0"

    host = os.statvfs("/dev/shm")
    with c.private_shm("n2", size="1m") as namespace:
        assert namespace != mount_namespace()
        assert c.fill_shm("n2").count("100%") == 2
        c.run(["srun", "-w", "n2", "sh", "-c", f"mv /dev/shm/hpoflow-fill-1 /dev/shm/{marker}"])
        assert shm_of("n2") == ("1024", True)
        assert shm_of("n1")[1] is False and not Path("/dev/shm", marker).exists()
    assert shm_of("n2")[1] is False
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and mount_namespace(p.name) == namespace]
    after = os.statvfs("/dev/shm")
    assert (after.f_blocks, after.f_files) == (host.f_blocks, host.f_files)  # the same file system, not resized
    assert c.node_states()["n2"] == "idle" and "n2" not in c.shm_options


@pytest.mark.slow  # a second whole cluster: a few seconds
def test_a_second_cluster_runs_beside_the_first_and_leaves_nothing(slurm_cluster: SlurmCluster) -> None:
    other = SlurmCluster(1)
    other.start()
    try:
        assert other.net is not None and slurm_cluster.net is not None
        assert other.net.subnet != slurm_cluster.net.subnet
        assert other.ctld_port != slurm_cluster.ctld_port
        out = other.run(["srun", "hostname", "-I"]).stdout.split()
        assert out == [other.node_addresses["n1"]]
        names = [node.name for node in other.net.nodes]
        pids = [p.pid for p in (other.munged, other.slurmctld, *other.slurmd.values()) if p is not None]
        root = other.root
    finally:
        other.stop()
    assert not [pid for pid in pids if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]
    assert not [p for p in psutil.process_iter(["cmdline"]) if str(root) in " ".join(p.info["cmdline"] or [])]
    assert not set(names) & set(ip("netns", "list").stdout.split())
    assert not root.exists()
    assert slurm_cluster.node_states() == {"n1": "idle", "n2": "idle"}  # the first one is untouched


# -- PostgreSQL ------------------------------------------------------------------------------------
def test_the_server_listens_on_loopback_only_and_wants_the_password(postgres_server: PostgresServer) -> None:
    import sqlalchemy

    assert postgres_server.proc is not None
    ports = [c.laddr for c in psutil.net_connections(kind="inet")
             if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == postgres_server.port]
    assert ports and all(addr.ip == "127.0.0.1" for addr in ports)
    engine = sqlalchemy.create_engine(postgres_server.url)
    try:
        with engine.connect() as conn:
            assert conn.execute(sqlalchemy.text("select current_user")).scalar() == postgres_server.user
    finally:
        engine.dispose()
    wrong = sqlalchemy.create_engine(postgres_server.url.replace(postgres_server.password, "wrong"))
    try:
        with pytest.raises(sqlalchemy.exc.OperationalError, match="password authentication failed"):
            wrong.connect()
    finally:
        wrong.dispose()


@pytest.mark.slow  # a database outage and a restart
def test_optuna_rdb_storage_survives_a_server_restart(postgres_server: PostgresServer, postgres_url: str) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # pool_pre_ping: a pooled connection the restart killed is replaced instead of failing the next call
    storage = optuna.storages.RDBStorage(postgres_url, engine_kwargs={"pool_pre_ping": True})
    study = optuna.create_study(storage=storage, study_name="infra-outage", direction="minimize")
    study.tell(study.ask(), 1.0)
    try:
        postgres_server.stop()
        assert not postgres_server.running
        with pytest.raises(optuna.exceptions.StorageInternalError):
            study.ask()
        time.sleep(1)  # the outage goes on past the failed call (its length changes nothing the pool does)
    finally:
        postgres_server.start()
    study.tell(study.ask(), 0.5)
    again = optuna.load_study(study_name="infra-outage", storage=optuna.storages.RDBStorage(postgres_url))
    values = [t.value for t in again.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert values == [1.0, 0.5]
    assert again.best_value == 0.5


def test_a_fresh_database_per_test(postgres_server: PostgresServer, tmp_path: Path) -> None:
    import optuna

    name = f"fresh_{tmp_path.name.lower().replace('-', '_')}"[:60]
    url = postgres_server.create_database(name)
    assert url.startswith("postgresql+psycopg2://") and url.endswith(f"@127.0.0.1:{postgres_server.port}/{name}")
    assert optuna.get_all_study_summaries(storage=url) == []
