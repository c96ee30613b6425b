"""Requeueing the driver's own job after a walltime warning (``hpoflow launch --engine slurm --requeue``).

The batch script sets ``HPOFLOW_REQUEUE=1``; when the driver stopped on the warning (its trials paused
with a checkpoint), ``scontrol requeue $SLURM_JOB_ID`` puts the job back in the queue and the same
script resumes the study when it runs again. Where that is not asked for, or not in a job, nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys

__all__ = ["requeue_if_asked"]


def requeue_if_asked() -> bool:
    """Requeue this job if the batch script asked for it; True when SLURM took the request."""
    job = os.environ.get("SLURM_ARRAY_JOB_ID") and os.environ.get("SLURM_ARRAY_TASK_ID")
    job_id = (f"{os.environ['SLURM_ARRAY_JOB_ID']}_{os.environ['SLURM_ARRAY_TASK_ID']}" if job
              else os.environ.get("SLURM_JOB_ID", ""))
    if os.environ.get("HPOFLOW_REQUEUE") != "1" or not job_id:
        return False
    try:
        r = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        print(f"hpoflow: could not requeue job {job_id}: {exc}; resubmit it to resume", file=sys.stderr)
        return False
    if r.returncode != 0:
        print(f"hpoflow: scontrol requeue {job_id} refused: {(r.stderr or r.stdout).strip()}; resubmit the job "
              "to resume", file=sys.stderr)
        return False
    print(f"hpoflow: job {job_id} requeued; the study resumes when it runs again", file=sys.stderr)
    return True
