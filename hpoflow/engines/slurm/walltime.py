"""The walltime of the SLURM job the driver runs in: a warning before it ends, and a requeue after.

``hpoflow launch --engine slurm`` asks SLURM for the warning itself (``--signal=B:USR1@SECONDS``). A
batch script written by hand may not: ``arm_walltime_warning`` reads the job's end time
(``SLURM_JOB_END_TIME`` where SLURM sets it, else ``squeue -o %e``) and sends this process SIGUSR1
``HPOFLOW_WALLTIME_WARNING_S`` seconds (default 300) before it, so the running trials pause with a
checkpoint either way (a second SIGUSR1 changes nothing). A time limit changed while the job runs
(``scontrol update JobId=... TimeLimit=...``, by the user or an administrator) moves the warning: the end
is read again from ``squeue`` every ``HPOFLOW_WALLTIME_POLL_S`` seconds (default 60; one request to
slurmctld each time) until the warning is nearer than that; a limit lifted (``UNLIMITED``) drops it.

``requeue_if_asked``: the batch script sets ``HPOFLOW_REQUEUE=1`` (``launch --requeue``); when the
driver stopped on the warning, ``scontrol requeue`` puts the job back in the queue and the same script
resumes the study when it runs again. Where that is not asked for, or not in a job, nothing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import datetime

__all__ = ["POLL_ENV", "WARNING_ENV", "arm_walltime_warning", "job_end_time", "requeue_if_asked"]

WARNING_ENV = "HPOFLOW_WALLTIME_WARNING_S"
DEFAULT_WARNING_S = 300
POLL_ENV = "HPOFLOW_WALLTIME_POLL_S"
DEFAULT_POLL_S = 60.0


def job_end_time(environ: Mapping[str, str], squeue: Callable[[str], str | None] | None = None) -> float | None:
    """The job's end as epoch seconds, or None (not in a job, no time limit, SLURM did not answer)."""
    raw = environ.get("SLURM_JOB_END_TIME", "").strip()
    if raw.isascii() and raw.isdigit():
        return float(raw)
    job = environ.get("SLURM_JOB_ID", "")
    if not job:
        return None
    return _parse_end((squeue or _squeue_end)(job))


def _parse_end(text: str | None) -> float | None:
    """``squeue -o %e``'s answer as epoch seconds; None for no answer and for no limit."""
    try:
        return datetime.fromisoformat(text.strip()).timestamp() if text else None  # local time, as squeue
    except ValueError:  # UNLIMITED, N/A, NONE
        return None


def _squeue_end(job: str) -> str | None:
    try:
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%e"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def _seconds(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    try:
        value = float(raw) if raw.isascii() and raw else default
    except ValueError:
        return default
    return value if value > 0 else default


def arm_walltime_warning(environ: Mapping[str, str] | None = None, *,
                         squeue: Callable[[str], str | None] | None = None,
                         fire: Callable[[], None] | None = None) -> float | None:
    """In a SLURM job with a time limit: SIGUSR1 to this process (or ``fire()``) that long before the
    end, from a daemon thread that reads the end again every ``HPOFLOW_WALLTIME_POLL_S`` seconds until
    the warning is less than that away, so a limit changed meanwhile moves it. The seconds until it
    fires as known now (0: the end is that close already), or None (not in a job, no limit)."""
    env = dict(os.environ if environ is None else environ)
    job = env.get("SLURM_JOB_ID", "")
    if not job:
        return None
    raw = env.get(WARNING_ENV, "").strip()
    lead = float(raw) if raw.isascii() and raw.isdigit() else float(DEFAULT_WARNING_S)
    poll = _seconds(env, POLL_ENV, DEFAULT_POLL_S)
    end = job_end_time(env, squeue)
    if end is None:
        return None
    signal_self = fire or (lambda: os.kill(os.getpid(), signal.SIGUSR1))

    def watch(end: float) -> None:
        wake = threading.Event()
        while True:
            due = end - lead - time.time()
            if due <= 0:
                signal_self()
                return
            if due <= poll:  # due before the next look: wait it out (never late by a slow squeue)
                wake.wait(due)
                continue
            wake.wait(poll)
            # SLURM_JOB_END_TIME is the end at the job's start: only squeue knows a changed limit
            text = (squeue or _squeue_end)(job)
            if not (text or "").strip():
                continue  # slurmctld did not answer: keep the end last known
            now_end = _parse_end(text)
            if now_end is None:
                return  # the limit was lifted (UNLIMITED): no warning
            end = now_end

    threading.Thread(target=watch, args=(end,), name="hpoflow-walltime", daemon=True).start()
    return max(0.0, end - lead - time.time())


def requeue_if_asked() -> bool:
    """Requeue this job if the batch script asked for it; True when SLURM took the request."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job
              else os.environ.get("SLURM_JOB_ID", ""))
    if os.environ.get("HPOFLOW_REQUEUE") != "1" or not job_id:
        return False
    # said before the call: SLURM ends this run of the job as it takes the request, often before a
    # line printed after ``scontrol`` returns reaches the job's output
    print(f"hpoflow: requeueing job {job_id}; the study resumes when it runs again", file=sys.stderr, flush=True)
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"hpoflow: could not requeue job {job_id}: {exc}; resubmit it to resume", file=sys.stderr)
        return False
    if r.returncode != 0:
        print(f"hpoflow: scontrol requeue {job_id} refused: {(r.stderr or r.stdout).strip()}; resubmit the job "
              "to resume", file=sys.stderr)
        return False
    print(f"hpoflow: job {job_id} requeued", file=sys.stderr, flush=True)
    return True
