"""The walltime of the SLURM job the driver runs in: a warning before it ends, and a requeue after.

``hpoflow launch --engine slurm`` asks SLURM for the warning itself (``--signal=B:USR1@SECONDS``). A
batch script written by hand may not: ``arm_walltime_warning`` reads the job's end time
(``SLURM_JOB_END_TIME`` where SLURM sets it, else ``squeue -o %e``) and sends this process SIGUSR1
``HPOFLOW_WALLTIME_WARNING_S`` seconds (default 300) before it, so the running trials pause with a
checkpoint either way (a second SIGUSR1 changes nothing).

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

__all__ = ["WARNING_ENV", "arm_walltime_warning", "job_end_time", "requeue_if_asked"]

WARNING_ENV = "HPOFLOW_WALLTIME_WARNING_S"
DEFAULT_WARNING_S = 300


def job_end_time(environ: Mapping[str, str], squeue: Callable[[str], str | None] | None = None) -> float | None:
    """The job's end as epoch seconds, or None (not in a job, no time limit, SLURM did not answer)."""
    raw = environ.get("SLURM_JOB_END_TIME", "").strip()
    if raw.isascii() and raw.isdigit():
        return float(raw)
    job = environ.get("SLURM_JOB_ID", "")
    if not job:
        return None
    text = (squeue or _squeue_end)(job)
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


def arm_walltime_warning(environ: Mapping[str, str] | None = None) -> float | None:
    """In a SLURM job with a time limit: SIGUSR1 to this process that long before the end (a daemon
    timer). The seconds until it fires (0: the end is that close already), or None."""
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return None
    raw = env.get(WARNING_ENV, "").strip()
    lead = float(raw) if raw.isascii() and raw.isdigit() else float(DEFAULT_WARNING_S)
    end = job_end_time(env)
    if end is None:
        return None
    delay = max(0.0, end - lead - time.time())
    timer = threading.Timer(delay, os.kill, args=(os.getpid(), signal.SIGUSR1))
    timer.daemon = True
    timer.start()
    return delay


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
