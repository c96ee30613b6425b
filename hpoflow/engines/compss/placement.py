"""What a compss trial task does first: give back a placement COMPSs got wrong, else run the attempt.

COMPSs schedules the ``N`` actions of a ``@multinode`` task one by one, each on whichever worker its
constraints fit (``ExecuteTasksRequest.submitMultiNodeTask``; its ``MultiNodeGroup`` has no rule that
the hosts differ). A per-node shape that fits twice on one worker can therefore get two "nodes" on one
host, and ``COMPSS_HOSTNAMES`` names that host twice. ``compss.cpus_per_node`` prevents it (each node
then asks for a whole worker: ``hpoflow.engines.compss.shape``); where it is unknown, ``run_task`` sees
the repeated name and ends the task at once, before any rank starts, so COMPSs frees the duplicate
share. Its result is an *infrastructure* failure: status ``failed``, retryable, and
``infrastructure: "repeated_host"``, written to the attempt's ``result.json`` like every result. The
engine submits the same attempt again, at most ``compss.placement_retries`` times in a row, without
counting it against ``resources.max_retries`` (``CompssEngine``).

Standard library and hpoflow only: no pycompss, no torch (the task module imports this).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hpoflow.engines.cluster.attempt import run_trial
from hpoflow.engines.cluster.layout import repeated_hosts
from hpoflow.fileio import write_json_atomic
from hpoflow.train.transport import TrialFiles
from hpoflow.trial import TrialRequest

__all__ = ["INFRASTRUCTURE", "REPEATED_HOST", "placement_problem", "run_task"]

INFRASTRUCTURE = "infrastructure"  # the key of a result dict that says the placement, not the trial, failed
REPEATED_HOST = "repeated_host"


def placement_problem(request: TrialRequest, env: Mapping[str, str]) -> str | None:
    """Why COMPSs's placement of this multi-node task cannot run the trial (None when it can)."""
    if request.nodes < 2:
        return None
    repeated = repeated_hosts(env)
    if not repeated:
        return None
    return (f"COMPSs placed several of trial {request.number}'s {request.nodes} nodes on one host "
            f"(COMPSS_HOSTNAMES={env.get('COMPSS_HOSTNAMES', '')!r} names {', '.join(repeated)} more than once); "
            "the task gave them back at once and is submitted again. Fix: give compss.cpus_per_node (hpoflow "
            "launch --cpus-per-node), so each node of a multi-node trial asks for a whole worker")


def run_task(request_json: str, options_json: str = "{}", env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The body of every compss trial task: an infrastructure result for a wrong placement (see the
    module docstring), else one attempt of the trial (``run_trial``). Never raises."""
    env = os.environ if env is None else env
    try:
        request = TrialRequest.from_json(request_json)
        problem = placement_problem(request, env)
    except Exception:  # a bad request: run_trial reports it as the trial's failure
        problem, request = None, None
    if problem is None or request is None:
        return run_trial(request_json, options_json)
    data: dict[str, Any] = {
        "number": request.number, "status": "failed", "error": problem, "retryable": True,
        INFRASTRUCTURE: REPEATED_HOST, "hosts": env.get("COMPSS_HOSTNAMES", ""), "host": socket.gethostname(),
    }
    files = TrialFiles(Path(request.trial_dir), request.attempt)
    try:
        files.dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(files.result, data)
    except OSError as exc:  # the engine still gets the value through compss_wait_on
        data["error"] = f"{problem} (and writing {files.result} failed: {exc})"
    return data
