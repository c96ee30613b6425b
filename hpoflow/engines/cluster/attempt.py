"""The body of a compss trial task: start the ranks as child processes, supervise, reap, report.

``run_trial(request_json, options_json)`` is what every COMPSs task variant calls (and what the
sequential fallback calls directly). It never raises: every failure becomes a ``TrialResult``
dict, also written atomically to ``<trial_dir>/attempt-<k>/result.json`` so the engine sees
results in completion order. It imports neither pycompss nor torch: training happens only in the
rank processes, fresh interpreters started from here, so no CUDA/NCCL state reaches the
persistent COMPSs worker that runs this function.

Single node: one node launcher (``hpoflow.engines.cluster.node``) as a child in its own process group, on the
cores/GPUs COMPSs bound to the task. Multi node: one node launcher per node through ``srun``
(default), ``mpirun`` or ``ssh``; rank 0 and the rendezvous are on the executing node. Whatever
happens, the launchers' process groups are killed and reaped in ``finally``, and a ``STOP`` file
makes every rank on every node kill itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpoflow.engines.cluster.layout import (
    bound_cpus,
    bound_gpus,
    default_pythonpath,
    launcher_argv,
    ordered_hosts,
    processes_per_node,
)
from hpoflow.engines.proc import describe_exit, tail
from hpoflow.fileio import read_json, write_atomic, write_json_atomic
from hpoflow.train.rendezvous import private_dir, store_path
from hpoflow.train.transport import ReportReader, TrialFiles
from hpoflow.trial import RankOutcome, TrialRequest, TrialResult, result_from_ranks

__all__ = ["HEARTBEAT_S", "run_trial", "stderr_tail"]

HEARTBEAT_S = 5.0
_SUPERVISE_S = 0.1


def stderr_tail(files: TrialFiles, n_ranks: int, n_nodes: int, max_bytes: int = 2000) -> str:
    """The end of every rank's (and node launcher's) log, labelled, for a failed trial's result."""
    parts = []
    for r in range(n_ranks):
        text = tail(files.rank_log(r), max_bytes)
        if text.strip():
            parts.append(f"--- rank {r} ---\n{text}")
    for n in range(n_nodes):
        text = tail(files.node_log(n), max_bytes // 2)
        if text.strip():
            parts.append(f"--- node {n} launcher ---\n{text}")
    text = tail(files.dir / "launcher.log", max_bytes // 2)
    if text.strip():
        parts.append(f"--- launcher ---\n{text}")
    return "\n".join(parts)


@contextlib.contextmanager
def _heartbeat(files: TrialFiles) -> Iterator[None]:
    """Touch ``heartbeat`` every few seconds while the task runs (the engine's sign of life)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            try:
                # atomic (a reader never sees half a line); not fsynced: its mtime is what the engine reads
                write_atomic(files.heartbeat, f"{time.time()} {socket.gethostname()} {os.getpid()}\n", durable=False)
            except OSError:
                pass
            stop.wait(HEARTBEAT_S)

    t = threading.Thread(target=beat, name="hpoflow-heartbeat", daemon=True)
    t.start()
    try:
        yield
    finally:
        stop.set()
        t.join(1.0)


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(sig)
        except OSError:
            pass


def _first_report_time(files: TrialFiles) -> float | None:
    for item in ReportReader(files.reports).read_new():
        if "step" in item and "time" in item:
            return float(item["time"])
    return None


def _outcomes(files: TrialFiles, world: int) -> dict[int, RankOutcome]:
    out = {}
    for r in range(world):
        data = read_json(files.outcome(r))
        if isinstance(data, dict):
            out[r] = RankOutcome.from_dict(data)
    return out


def _result_from(req: TrialRequest, files: TrialFiles, *, codes: list[int | None], failure: str | None,
                 retryable: bool, cancelled: str | None, t0: float, t0_wall: float) -> TrialResult:
    timings = {"duration_s": time.monotonic() - t0}
    first = _first_report_time(files)
    if first is not None:
        timings["to_first_report_s"] = max(0.0, first - t0_wall)
    outcomes = _outcomes(files, req.processes)
    if failure is None and cancelled is None and any(r not in outcomes for r in range(req.processes)):
        what = ", ".join(describe_exit(c) for c in codes) or "no launcher"
        failure, retryable = (f"rank(s) {[r for r in range(req.processes) if r not in outcomes]} ended without a "
                              f"result (launcher {what}): a rank was killed, ran out of memory or lost its node",
                              True)
        if any(o.status == "error" for o in outcomes.values()):
            failure = None  # a rank's own error is the root cause: let the outcomes speak
    return result_from_ranks(req, outcomes, timings=timings, failure=failure, retryable=retryable,
                             cancelled=cancelled, stderr_tail=lambda: stderr_tail(files, req.processes, req.nodes),
                             submitted_wall=t0_wall)


def _plan(req: TrialRequest, files: TrialFiles, opts: dict[str, Any], env: dict[str, str]
          ) -> tuple[list[list[str]], dict[str, Any]]:
    """The launcher commands and the job description the rank processes read."""
    ppn = processes_per_node(req)
    job: dict[str, Any] = {
        "request": json.loads(req.to_json()), "ppn": ppn, "world_size": req.processes,
        "pg_timeout_s": float(opts.get("pg_timeout_s", 120.0)),
        "answer_timeout_s": float(opts.get("answer_timeout_s", 600.0)),
        "env": dict(opts.get("env") or {}), "socket_ifname": opts.get("socket_ifname", "auto"),
        "deadline": time.time() + req.timeout + 30.0 if req.timeout else None,
    }
    python = str(opts.get("python") or sys.executable)
    cli = [python, "-m", "hpoflow.engines.cluster.node", "node", "--job", str(files.job)]
    if req.nodes == 1:
        cpus = bound_cpus(env)
        # one node: the ranks meet through a file store in a private directory (no rendezvous socket)
        store = store_path(private_dir(), req.number, req.attempt) if req.processes > 1 else ""
        job.update(master_addr="127.0.0.1", master_port=0, store=store, cpus=cpus, gpus=bound_gpus(env), hosts=[])
        return [[*cli, "--node-index", "0"]], job
    hosts = ordered_hosts(env, req.nodes)
    master = str(opts.get("master_addr") or hosts[0])
    # several nodes: the ranks meet through a TCP store rank 0 holds on a port the kernel picks and
    # announces in the attempt directory (train/dist.announced_store): no file lock on the shared file
    # system, which Lustre with localflock and many NFS mounts do not give across nodes, and no port to
    # race for; their gloo/NCCL pairs use the interface that routes to the master node (socket_ifname)
    job.update(master_addr=master, master_port=0, store="", announce=str(files.dir / "rendezvous.addr"),
               cpus=None, gpus=None, hosts=hosts)
    cmds = launcher_argv(
        str(opts.get("launcher", "srun")), hosts, ppn, req, str(files.job), python=python,
        srun_args=tuple(opts.get("srun_args", ("--overlap",))), mpirun_args=tuple(opts.get("mpirun_args", ())),
        ssh_args=tuple(opts.get("ssh_args", ("-o", "BatchMode=yes"))), pythonpath=default_pythonpath(),
    )
    return cmds, job


def run_trial(request_json: str, options_json: str = "{}") -> dict[str, Any]:
    """Run one attempt of one trial to its end; return (and write) its ``TrialResult`` as a dict."""
    t0, t0_wall = time.monotonic(), time.time()
    try:
        req = TrialRequest.from_json(request_json)
        opts = json.loads(options_json)
    except Exception as exc:  # a task never raises
        return {"number": -1, "status": "failed", "error": f"bad task arguments: {exc!r}"}
    files = TrialFiles(Path(req.trial_dir), req.attempt)
    try:
        files.dir.mkdir(parents=True, exist_ok=True)
        with _heartbeat(files):
            result = _run(req, files, opts, t0, t0_wall)
    except BaseException as exc:  # even SIGUSR2/KeyboardInterrupt: report, don't raise
        result = TrialResult(req.number, "failed", error=f"the trial task failed: {type(exc).__name__}: {exc}",
                             stderr_tail=stderr_tail(files, req.processes, req.nodes),
                             timings={"duration_s": time.monotonic() - t0}, retryable=True)
    data = result.to_dict()
    outcomes = _outcomes(files, req.processes)
    if result.status == "failed" and len(outcomes) == req.processes and \
            all(o.status == "resized" for o in outcomes.values()):
        # an elastic trial left at an epoch boundary, checkpointed: the engine submits its next segment
        data.update(status="resized", error=None, retryable=False)
    data["host"] = socket.gethostname()
    try:
        write_json_atomic(files.result, data)
    except OSError as exc:
        data["error"] = f"{data.get('error') or ''} (and writing {files.result} failed: {exc})".strip()
    return data


def _run(req: TrialRequest, files: TrialFiles, opts: dict[str, Any], t0: float, t0_wall: float
         ) -> TrialResult:
    for r in range(req.processes):
        with contextlib.suppress(FileNotFoundError):
            files.outcome(r).unlink()
    common = {"t0": t0, "t0_wall": t0_wall}
    if files.stop_requested():
        return _result_from(req, files, codes=[], failure=None, retryable=False,
                            cancelled="cancelled before it started", **common)
    try:
        cmds, job = _plan(req, files, opts, dict(os.environ))
    except ValueError as exc:
        return _result_from(req, files, codes=[], failure=str(exc), retryable=False, cancelled=None, **common)
    write_json_atomic(files.job, job)
    kill_grace = float(opts.get("kill_grace_s", 5.0))
    deadline = t0 + req.timeout if req.timeout else None
    procs: list[subprocess.Popen[bytes]] = []
    failure: str | None = None
    retryable = False
    cancelled: str | None = None
    try:
        with open(files.dir / "launcher.log", "ab") as log:
            for argv in cmds:
                procs.append(subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL,
                                              start_new_session=True))
        while any(p.poll() is None for p in procs):
            if files.stop_requested():
                cancelled = "cancelled (STOP file)"
                break
            if deadline is not None and time.monotonic() >= deadline:
                failure = f"timed out after {req.timeout:g} s (resources.timeout)"
                retryable = False  # the same configuration would run as long again
                break
            if any(p.returncode not in (None, 0) for p in procs):
                # one node's launcher failed: the others would wait in a collective until timeout
                time.sleep(kill_grace)
                break
            time.sleep(_SUPERVISE_S)
    finally:
        if any(p.poll() is None for p in procs):
            if req.nodes > 1:
                with contextlib.suppress(OSError):
                    files.stop.write_text("stop\n")  # remote nodes' watchers kill their ranks
                for p in procs:
                    _kill_group(p, signal.SIGTERM)
                end = time.monotonic() + kill_grace
                while time.monotonic() < end and any(p.poll() is None for p in procs):
                    time.sleep(0.05)
            for p in procs:
                _kill_group(p, signal.SIGKILL)
        for p in procs:
            if p.poll() is None:
                _kill_group(p, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(30)
        # anything left in a launcher's group (a rank that escaped its parent) dies too
        for p in procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        if job.get("store") and req.nodes == 1:
            shutil.rmtree(os.path.dirname(str(job["store"])), ignore_errors=True)  # the private directory
        elif job.get("store"):
            with contextlib.suppress(OSError):
                os.unlink(str(job["store"]))
    if cancelled is None and failure is None and files.stop_requested() \
            and any(p.returncode not in (0, None) for p in procs):
        # the ranks' own STOP watcher ended them before this loop saw the file
        cancelled = "cancelled (STOP file)"
    return _result_from(req, files, codes=[p.returncode for p in procs], failure=failure,
                        retryable=retryable, cancelled=cancelled, **common)


def main(argv: list[str] | None = None) -> int:
    """``python -m hpoflow.engines.cluster.attempt --request FILE --options FILE``: one attempt of a
    trial inside a batch job (the slurm engine's jobs mode); its result goes to the attempt directory."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m hpoflow.engines.cluster.attempt")
    p.add_argument("--request", required=True, help="the TrialRequest as JSON")
    p.add_argument("--options", required=True, help="the engine's options for the attempt, as JSON")
    args = p.parse_args(argv)
    try:
        request, options = Path(args.request).read_text(), Path(args.options).read_text()
    except OSError as exc:
        print(f"hpoflow: cannot read the attempt's files: {exc}", file=sys.stderr)
        return 2
    data = run_trial(request, options)
    return 0 if data.get("status") in ("complete", "pruned") else 1


if __name__ == "__main__":
    sys.exit(main())
