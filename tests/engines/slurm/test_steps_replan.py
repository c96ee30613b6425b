"""The slurm engine's steps mode after a multi-node step failed, and its control by socket, without a
cluster: a fake ``srun``, ``scontrol`` and ``squeue`` first on PATH (as Parsl tests its launchers). The
fakes read what SLURM "says" from files the test changes while the engine runs: the job's nodes and
the steps it lists. Bounds on time bound a hang on a loaded 2-core machine, not a speed."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from hpoflow.engines.base import TrialReport, TrialResult
from hpoflow.engines.slurm.engine import SlurmEngine
from hpoflow.engines.slurm.options import SlurmOptions
from hpoflow.train.faults import collective_lost
from hpoflow.trial import TrialRequest
from tests.conftest import ROOT

WAIT_S = 120.0  # a trial of real ranks starting python on a loaded 2-core machine: bounds a hang

# srun: records its argv, whether SLURM_OVERLAP reached it and when; then does what the next line of
# FAKE_DIR/plan says: "survivor-error" (rank 0 on n1 wrote a gloo error, rank 1's node crashed: no
# outcome; exit 1), "ok" (every rank's outcome ok), or "run" (each task runs the step command, as
# srun would on one node: SLURM_PROCID, SLURM_NTASKS, SLURM_STEP_ID, SLURM_LAUNCH_NODE_IPADDR set)
FAKE_SRUN = """\
import json, os, subprocess, sys, time
d = os.environ["FAKE_DIR"]
argv = sys.argv[1:]
with open(os.path.join(d, "srun.jsonl"), "a") as f:
    f.write(json.dumps({"argv": argv, "overlap_env": "SLURM_OVERLAP" in os.environ, "t": time.time()}) + "\\n")
with open(os.path.join(d, "plan")) as f:
    plan = f.read().split()
n = len(open(os.path.join(d, "srun.jsonl")).read().splitlines())
what = plan[min(n, len(plan)) - 1]
ntasks = int(next(a.split("=")[1] for a in argv if a.startswith("--ntasks=")))
cmd = argv[next(i for i, a in enumerate(argv) if not a.startswith("-")):]
job = cmd[cmd.index("--job") + 1]
adir = os.path.dirname(job)
def outcome(r, data):
    with open(os.path.join(adir, f"outcome-{r}.json"), "w") as f:
        json.dump(data, f)
if what == "survivor-error":
    outcome(0, {"status": "error", "error": "RuntimeError: [gloo] Connection closed by peer [198.18.0.3]:4242",
                "error_type": "RuntimeError", "retryable": True, "host": "n1"})
    sys.exit(1)
if what == "ok":
    for r in range(ntasks):
        outcome(r, {"status": "ok", "metrics": {"value": 1.0}, "host": "n1"})
    sys.exit(0)
procs = []
for r in range(ntasks):
    env = dict(os.environ, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), SLURM_NTASKS=str(ntasks),
               SLURM_STEP_ID=str(n - 1), SLURM_STEP_NODELIST="n1", SLURM_LAUNCH_NODE_IPADDR="127.0.0.1",
               SLURMD_NODENAME="n1", SLURM_NTASKS_PER_NODE=str(ntasks))
    procs.append(subprocess.Popen(cmd, env=env))
sys.exit(max(p.wait() for p in procs))
"""
# scontrol and squeue: the job's nodes (FAKE_DIR/nodes) and its steps (FAKE_DIR/steps), each call logged
FAKE_SCONTROL = """\
import os, sys, time
d = os.environ["FAKE_DIR"]
with open(os.path.join(d, "clients.log"), "a") as f:
    f.write(f"{time.time()} scontrol {' '.join(sys.argv[1:])}\\n")
args = sys.argv[1:]
if args[:2] == ["show", "config"]:
    print("SlurmdTimeout           = 5 sec")
elif "job" in args:
    print(f"JobId=42 JobState=RUNNING NodeList={open(os.path.join(d, 'nodes')).read().strip()}")
else:
    sys.exit(1)
"""
FAKE_SQUEUE = """\
import os, sys, time
d = os.environ["FAKE_DIR"]
with open(os.path.join(d, "clients.log"), "a") as f:
    f.write(f"{time.time()} squeue {' '.join(sys.argv[1:])}\\n")
print(open(os.path.join(d, "steps")).read(), end="")
"""


def _fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: str, nodes: str = "n[1-3]") -> Path:
    fake = tmp_path / "fake"
    bin_dir = fake / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("squeue", FAKE_SQUEUE)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    (fake / "plan").write_text(plan)
    (fake / "nodes").write_text(nodes)
    (fake / "steps").write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_DIR", str(fake))
    monkeypatch.setenv("SLURM_OVERLAP", "1")  # a site's default: must not reach a step
    for name in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_OVERLAP"]:
        monkeypatch.delenv(name)
    return fake


def _engine(tmp_path: Path, nodes: str = "n[1-3]", cpus: str = "4(x3)") -> SlurmEngine:
    env = {**os.environ, "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": nodes, "SLURM_JOB_CPUS_PER_NODE": cpus}
    return SlurmEngine(SlurmOptions(mode="steps", agents="off", poll_interval_s=0.1), tmp_path / "run", env)


def _srun_calls(fake: Path) -> list[dict[str, Any]]:
    path = fake / "srun.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _poll_until(engine: SlurmEngine, ok: Any, what: str, limit: float = WAIT_S) -> list[Any]:
    events: list[Any] = []
    end = time.monotonic() + limit
    while not ok(events):
        if time.monotonic() > end:
            raise AssertionError(f"{what} did not happen within {limit:.0f} s; events {events}")
        events += engine.poll(0.2)
    return events


def _two_node_request(tmp_path: Path, attempt: int) -> TrialRequest:
    return TrialRequest(0, {}, {"function": "unused:fn"}, "value", "maximize", str(tmp_path / "run" / "trials" / "0"),
                        processes=2, nodes=2, cpus_per_process=2, attempt=attempt)


def test_after_a_crash_whose_survivor_errs_first_the_rerun_is_decided_on_slurms_word_and_never_overlaps(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A 2-node step fails: rank 0 (on n1) wrote a gloo error, rank 1's node n2 crashed and wrote
    nothing, and SLURM still lists n2 in the job and the step as running (it marks a crashed node down
    only ``SlurmdTimeout`` s later). The failed attempt's result waits for SLURM's word (the driver would
    decide the rerun on a plan that still counts n2); once SLURM has taken n2 out of the job it comes,
    the engine counts the failed step's CPUs on n1 as taken (SLURM 22.05 keeps them), and the rerun
    starts without ``--overlap`` (and without the site's ``SLURM_OVERLAP``)."""
    fake = _fake_slurm(tmp_path, monkeypatch, "survivor-error ok")
    engine = _engine(tmp_path)
    try:
        (fake / "steps").write_text("42.0 hpoflow.run.t0 n[1-2]\n")
        engine.submit(_two_node_request(tmp_path, 0))
        end = time.monotonic() + WAIT_S
        while not (fake / "srun.jsonl").exists() and time.monotonic() < end:
            assert engine.poll(0.2) == []
        time.sleep(1.0)  # the fake srun has ended the step
        events: list[Any] = []
        end = time.monotonic() + 3.0  # several looks at the job: SLURM still counts n2 and lists the step
        while time.monotonic() < end:
            events += engine.poll(0.2)
        assert not [e for e in events if isinstance(e, TrialResult)], events  # no result on a stale plan
        assert engine.running() == [0]
        (fake / "nodes").write_text("n[1,3]")  # SLURM marked n2 down and took it out of the --no-kill job
        (fake / "steps").write_text("")
        (first,) = [e for e in _poll_until(engine, lambda ev: any(isinstance(e, TrialResult) for e in ev),
                                           "the first attempt's result") if isinstance(e, TrialResult)]
        assert first.status == "failed" and first.retryable, first  # the survivor's gloo error: retryable
        # n1 keeps 2 of its 4 CPUs for the dead step: one 2-node trial of 2-CPU ranks fits (n1 and n3), not 3
        assert engine.capacity(_two_node_request(tmp_path, 1)) == 1
        engine.submit(_two_node_request(tmp_path, 1))  # the driver reruns it
        _poll_until(engine, lambda ev: any(isinstance(e, TrialResult) for e in ev), "the rerun's end")
    finally:
        engine.close()
    calls = _srun_calls(fake)
    assert len(calls) == 2, calls
    assert not any("--overlap" in c["argv"] for c in calls), calls  # no step ever overlaps the others
    assert not any(c["overlap_env"] for c in calls), calls  # nor through the site's SLURM_OVERLAP
    err = capsys.readouterr().err
    assert "node(s) n2 left the allocation" in err, err


def test_a_multi_node_failure_rereads_the_job_and_with_every_node_left_the_rerun_starts_when_slurm_ends_the_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not a crash (a rank was killed, its node is fine), its survivor's error first all the same: the
    engine asks SLURM about the job before the rerun starts; the step is gone from ``squeue`` at the first
    look, so the rerun starts then (not ``SlurmdTimeout`` and a minute later), with every node planned."""
    fake = _fake_slurm(tmp_path, monkeypatch, "survivor-error ok")
    engine = _engine(tmp_path)
    try:
        engine.submit(_two_node_request(tmp_path, 0))
        _poll_until(engine, lambda ev: any(isinstance(e, TrialResult) for e in ev), "the first attempt's end")
        t0 = time.monotonic()
        engine.submit(_two_node_request(tmp_path, 1))
        _poll_until(engine, lambda ev: any(isinstance(e, TrialResult) for e in ev), "the rerun's end")
        assert time.monotonic() - t0 < 5.0 + 60.0  # not the SlurmdTimeout-and-a-minute bound
        assert engine.capacity(_two_node_request(tmp_path, 2)) == 3  # 3 nodes of 4 CPUs: nothing held
    finally:
        engine.close()
    calls = _srun_calls(fake)
    assert len(calls) == 2
    looks = [float(line.split()[0]) for line in (fake / "clients.log").read_text().splitlines()
             if " show job -o 42" in line or " squeue -s " in line]
    assert any(calls[0]["t"] < t < calls[1]["t"] for t in looks), looks  # SLURM asked between the two


@pytest.mark.parametrize(("error_type", "text"), [
    ("RuntimeError", "NCCL communicator was aborted on rank 1. Original reason for failure was: "
                     "[Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                     "OpType=ALLREDUCE, NumelIn=1) ran for 600000 milliseconds before timing out."),
    ("DistBackendError", "NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled "
                         "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.19.3"),
    ("RuntimeError", "NCCL error in: ProcessGroupNCCL.cpp:1275, remote process exited or there was a network "
                     "error, NCCL version 2.18.1\nncclRemoteError: A call failed possibly due to a network error"),
    ("DistNetworkError", "failed to recv, got 0 bytes"),
])
def test_nccl_and_gloo_errors_of_a_lost_peer_are_retryable(error_type: str, text: str) -> None:
    assert collective_lost(error_type, text)


@pytest.mark.parametrize(("error_type", "text"), [
    ("KeyError", "'skip_connection'"),
    ("ValueError", "training.options.connection must be 'full' or 'sparse', got 'dense'"),
])
def test_a_users_own_error_that_names_a_connection_is_not_classed_as_a_lost_peer(error_type: str, text: str) -> None:
    """(Any text with "connection" in it was retried before: a user's error ran ``max_retries`` times.)"""
    assert not collective_lost(error_type, text)


STAT_CALLS = ("stat", "lstat", "newfstatat", "statx", "access", "faccessat", "faccessat2", "open", "openat",
              "readlink")


def test_the_steps_driver_reads_reports_and_answers_by_socket_and_touches_no_file_while_trials_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-rank step (real rank process, started by the fake srun) reports every ~0.1 s and waits for
    a pruning decision each time; ``strace -e trace=%file`` on every thread of the driver (this process)
    for 4 s of that: every report arrives and is answered, and not one stat, access or open of a path
    under the run directory (no ``reports.jsonl``, no address file read per poll)."""
    if shutil.which("strace") is None:
        pytest.skip("strace is not installed (Debian: apt-get install strace)")
    _fake_slurm(tmp_path, monkeypatch, "run")
    monkeypatch.setenv("PYTHONPATH", f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    engine = _engine(tmp_path, nodes="n1", cpus="4")
    run_dir = tmp_path / "run"
    request = TrialRequest(0, {"x": 1.0}, {"function": "trainfns_light:slow", "epochs": 1,
                                           "options": {"steps": 200, "sleep": 20.0}},
                           "value", "maximize", str(run_dir / "trials" / "0"), pruning=True,
                           python_path=(str(ROOT / "tests"),))
    reports: list[TrialReport] = []
    trace = tmp_path / "strace.txt"
    try:
        engine.submit(request)

        def reported(ev: list[Any]) -> bool:
            for e in ev:
                if isinstance(e, TrialResult):
                    raise AssertionError(f"the trial ended: {e}")
                if isinstance(e, TrialReport):
                    reports.append(e)
                    engine.answer(e.number, False)
            ev.clear()
            return len(reports) >= 5

        _poll_until(engine, reported, "the trial's fifth report")
        before = len(reports)
        tids = sorted(os.listdir(f"/proc/{os.getpid()}/task"))
        tracer = subprocess.Popen(["strace", "-qq", "-e", "trace=%file", "-o", str(trace),
                                   *[x for tid in tids for x in ("-p", tid)]],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stop = threading.Event()
        threading.Timer(4.0, stop.set).start()
        time.sleep(0.5)  # strace attached
        os.stat(run_dir)  # a stat under the run directory that the trace must show (it traced us)
        _poll_until(engine, lambda ev: reported(ev) and stop.is_set(), "4 s of reports")
        tracer.terminate()
        tracer.wait(60)
        during = len(reports) - before
    finally:
        engine.close()
    lines = trace.read_text(errors="replace").splitlines() if trace.exists() else []
    if not lines:
        pytest.skip("strace could not attach to this process (kernel.yama.ptrace_scope?)")
    assert during >= 10, during  # it reported (and was answered) all along, over the socket
    touched = [line for line in lines if str(run_dir) in line
               and re.search(rf"\b({'|'.join(STAT_CALLS)})\(", line)]
    assert [line for line in touched if f'"{run_dir}"' in line], lines[:20]  # our own stat: it traced the driver
    touched = [line for line in touched if f'"{run_dir}"' not in line]
    assert not touched, touched[:20]
    assert not list((run_dir / "trials" / "0" / "attempt-0").glob("answer-*.json"))  # decisions by socket only


def test_the_steps_control_listener_is_bound_to_the_address_the_nodes_reach_and_ranks_are_told_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """As the agents' listener: a job of this node alone listens on loopback only, and a job whose nodes
    have no known route listens on every address (``*``: rank 0 then uses ``SLURM_LAUNCH_NODE_IPADDR``);
    either way only a running attempt's token is kept."""
    import socket

    from hpoflow.engines.slurm.allocation import Allocation
    from hpoflow.engines.slurm.engine import _control_server

    here = socket.gethostname().split(".")[0]
    server, host = _control_server(Allocation("1", (here,), (4,), 0))
    try:
        assert host == "127.0.0.1" and server._server.getsockname()[0] == "127.0.0.1"
    finally:
        server.close()
    monkeypatch.setattr("hpoflow.engines.slurm._fleet.route_address", lambda target: target)  # no route: a name
    monkeypatch.setattr("hpoflow.engines.slurm._fleet._node_address", lambda host: host)
    server, host = _control_server(Allocation("1", ("n-nowhere",), (4,), 0))
    try:
        assert host == "" and server._server.getsockname()[0] in ("0.0.0.0", "::")
    finally:
        server.close()
