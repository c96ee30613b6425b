"""The slurm engine's jobs mode (``hpoflow.engines.slurm.engine``): ``JobsMode``, the engine's part that runs
each trial as its own ``sbatch`` job, which runs one attempt of the trial (``hpoflow.engines.cluster.attempt``):
the job's script and flags, one ``squeue`` for every trial job, when a job has ended (its state, its
heartbeat) and its result, and why SLURM ended a job that left none."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import time
from pathlib import Path
from typing import Any

from hpoflow.engines.base import TrialResult
from hpoflow.engines.cluster.attempt import HEARTBEAT_S
from hpoflow.engines.cluster.layout import default_pythonpath
from hpoflow.engines.proc import tail
from hpoflow.engines.slurm._core import Core, Trial
from hpoflow.engines.slurm.replan import run_client
from hpoflow.fileio import read_json, write_atomic, write_json_atomic

__all__ = ["JobsMode"]

_SQUEUE_EVERY_S = 2.0  # jobs mode: one squeue for every job at most this often
_GONE_GRACE_S = 10.0  # jobs mode: a job squeue no longer lists may still be writing its result


class JobsMode(Core):
    """The jobs mode's part of ``SlurmEngine``: each trial its own batch job, tracked with ``squeue`` and
    its heartbeat."""

    def _start_job(self, t: Trial) -> None:
        req, files = t.request, t.files
        write_json_atomic(files.dir / "request.json", json.loads(req.to_json()))
        write_json_atomic(files.dir / "options.json", self._task_options())
        script = files.dir / "job.sh"
        write_atomic(script, "#!/bin/sh\n"
                     f"# hpoflow: trial {req.number}, attempt {req.attempt}; written by the slurm engine\n"
                     f"exec {shlex.quote(self.python)} -m hpoflow.engines.cluster.attempt "
                     f"--request {shlex.quote(str(files.dir / 'request.json'))} "
                     f"--options {shlex.quote(str(files.dir / 'options.json'))}\n", mode=0o755)
        o = self.options
        argv = ["sbatch", "--parsable", f"--job-name={self._name(req)}", *self._resources(req, per_task=False),
                f"--output={files.dir / 'job.out'}", f"--chdir={files.dir}", "--export=ALL"]
        minutes = o.time_min or (math.ceil((req.timeout + 300) / 60) if req.timeout else None)
        if minutes:
            argv.append(f"--time={minutes}")
        for flag, value in (("partition", o.partition), ("account", o.account), ("qos", o.qos),
                            ("constraint", o.constraint)):
            if value:
                argv.append(f"--{flag}={value}")
        argv += [*o.sbatch_args, str(script)]
        env = {**os.environ, "PYTHONPATH": default_pythonpath()}
        r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
        job_id = r.stdout.strip().split(";")[0]
        if r.returncode != 0 or not job_id.isdigit():
            why = (r.stderr or r.stdout).strip().splitlines()
            t.failure = f"sbatch refused the trial's job: {why[-1] if why else f'exit {r.returncode}'}"
            t.retryable = False
            return
        t.job_id = job_id
        self._queued[job_id] = "PENDING"

    def _task_options(self) -> dict[str, Any]:
        """The options ``run_trial`` reads inside a trial job (as a COMPSs task's)."""
        o = self.options
        return {"launcher": "srun", "srun_args": ["--overlap", *o.srun_args], "python": self.python,
                "env": dict(o.env), "socket_ifname": o.socket_ifname, "kill_grace_s": o.kill_grace_s,
                "answer_timeout_s": o.answer_timeout_s, "pg_timeout_s": o.pg_timeout_s}

    # -- watching a trial ---------------------------------------------------------------------------
    def _refresh_queue(self, force: bool = False) -> None:
        """The states of every trial job (one squeue for all of them, at most every few seconds)."""
        now = time.monotonic()
        ids = [t.job_id for t in self._trials.values() if t.job_id]
        if not ids or (not force and now - self._last_squeue < _SQUEUE_EVERY_S):
            return
        self._last_squeue = now
        r = run_client(["squeue", "-h", "-j", ",".join(ids), "-o", "%i %T"])
        if r is None:
            return  # slurmctld did not answer: keep the last states
        self._queued = dict(line.split(None, 1) for line in r.splitlines() if len(line.split(None, 1)) == 2)

    def _job_done(self, t: Trial, now: float) -> bool:
        if t.job_id is None or t.files.result.exists():
            return True
        state = self._queued.get(t.job_id)
        if state in ("PENDING", "CONFIGURING"):
            t.gone_since = None
            return False
        if state is None or state not in ("RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING"):
            t.gone_since = t.gone_since or now
            return now - t.gone_since > _GONE_GRACE_S  # its result may be on its way through the file system
        hb = _mtime(t.files.heartbeat)
        limit = max(self.options.heartbeat_timeout_s, 3 * HEARTBEAT_S)
        if hb is not None and time.time() - hb > limit:
            t.extra["why"] = f"its heartbeat stopped {time.time() - hb:.0f} s ago (its node died or hangs)"
            run_client(["scancel", "--signal=KILL", t.job_id])
            return True
        return False

    def _job_result(self, t: Trial, timings: dict[str, float]) -> TrialResult:
        n = t.request.number
        data = read_json(t.files.result)
        if t.failure is not None and not isinstance(data, dict):
            return TrialResult(n, "failed", error=t.failure, timings=timings, retryable=t.retryable)
        if not isinstance(data, dict):
            if t.cancel_reason is not None:
                return TrialResult(n, "cancelled", error=t.cancel_reason, timings=timings)
            why = t.extra.get("why") or _job_reason(t.job_id)
            return TrialResult(n, "failed", error=f"the job of trial {n} ({t.job_id}) ended without a result: {why}",
                               stderr_tail=tail(t.files.dir / "job.out", 2000), timings=timings, retryable=True)
        res = TrialResult.from_dict({**data, "number": n})
        merged = {**res.timings, "engine_duration_s": timings["duration_s"]}
        if t.cancel_reason is not None and res.status == "failed":
            return TrialResult(n, "cancelled", error=t.cancel_reason, stderr_tail=res.stderr_tail, timings=merged)
        if t.failure is not None and res.status != "complete":
            return TrialResult(n, "failed", error=t.failure, stderr_tail=res.stderr_tail, timings=merged,
                               retryable=t.retryable)
        return TrialResult(n, res.status, res.value, res.metrics, res.error, res.stderr_tail, merged, res.retryable,
                           res.system)


def _job_reason(job_id: str | None) -> str:
    """Why a job ended, as ``scontrol show job`` says (while SLURM still remembers it)."""
    out = run_client(["scontrol", "show", "job", "-o", str(job_id)]) if job_id else None
    if not out:
        return "SLURM no longer knows the job (see its job.out)"
    fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
    return f"JobState={fields.get('JobState', '?')} Reason={fields.get('Reason', '?')}"


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None
