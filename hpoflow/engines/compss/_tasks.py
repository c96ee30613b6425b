"""The PyCOMPSs task definitions of a compss study (imported only inside the runtime).

Per-trial resources come from the study spec, but decorators are evaluated when this module is
imported. So ``CompssEngine`` exports the trial shape as environment variables *before* it
imports this module (at the first ``submit``), and the decorators use ``"$VAR"`` strings, which
COMPSs expands from the master's environment when it registers the task:

- ``HPOFLOW_COMPSS_CUS``: CPU computing units per node (processes per node x cpus_per_process)
- ``HPOFLOW_COMPSS_GPUS``: GPUs per node (processes per node x gpus_per_process)
- ``HPOFLOW_COMPSS_NODES``: nodes of a multi-node trial
- ``HPOFLOW_COMPSS_TIME_OUT``: ``time_out`` in seconds (read here at import: resources.timeout
  plus a grace period; 0 = none). It is only a backstop: the task body enforces the trial's
  timeout itself and kills the ranks, which COMPSs's SIGALRM would not.

A study has one resource shape, so four variants cover every case (CPU/GPU x one/many nodes); the
engine picks one per study. Worker processes import this module too: there the variables may be
unset, which is harmless because workers do not register tasks.

Failures: ``@on_failure(management="IGNORE")`` only (``RETRY`` stops the whole application after
two retries, ``FAIL`` at once); the body catches everything anyway and returns a failed result.
"""

from __future__ import annotations

import os
from typing import Any

from pycompss.api.constraint import constraint
from pycompss.api.multinode import multinode
from pycompss.api.on_failure import on_failure
from pycompss.api.task import task

from hpoflow.engines.compss._body import run_trial

__all__ = ["FAILED_DEFAULT", "TASKS", "trial_cpu", "trial_gpu", "trial_multinode_cpu", "trial_multinode_gpu"]

FAILED_DEFAULT: dict[str, Any] = {
    "number": -1, "status": "failed", "retryable": True, "compss_default": True,
    "error": "the COMPSs task failed (worker crash, COMPSs time_out or cancellation); see the COMPSs "
             "job logs (.COMPSs/<app>/jobs) and the trial's rank logs",
}


def _time_out() -> int:
    try:
        return max(0, int(float(os.environ.get("HPOFLOW_COMPSS_TIME_OUT", "0"))))
    except ValueError:
        return 0


_TIME_OUT = _time_out()


@constraint(computing_units="$HPOFLOW_COMPSS_CUS")
@on_failure(management="IGNORE", returns=FAILED_DEFAULT)
@task(returns=1, time_out=_TIME_OUT)
def trial_cpu(request_json: str, options_json: str) -> dict[str, Any]:
    return run_trial(request_json, options_json)


@constraint(computing_units="$HPOFLOW_COMPSS_CUS",
            processors=[{"processorType": "GPU", "computingUnits": "$HPOFLOW_COMPSS_GPUS"}])
@on_failure(management="IGNORE", returns=FAILED_DEFAULT)
@task(returns=1, time_out=_TIME_OUT)
def trial_gpu(request_json: str, options_json: str) -> dict[str, Any]:
    return run_trial(request_json, options_json)


@constraint(computing_units="$HPOFLOW_COMPSS_CUS")
@multinode(computing_nodes="$HPOFLOW_COMPSS_NODES")
@on_failure(management="IGNORE", returns=FAILED_DEFAULT)
@task(returns=1, time_out=_TIME_OUT)
def trial_multinode_cpu(request_json: str, options_json: str) -> dict[str, Any]:
    return run_trial(request_json, options_json)


@constraint(computing_units="$HPOFLOW_COMPSS_CUS",
            processors=[{"processorType": "GPU", "computingUnits": "$HPOFLOW_COMPSS_GPUS"}])
@multinode(computing_nodes="$HPOFLOW_COMPSS_NODES")
@on_failure(management="IGNORE", returns=FAILED_DEFAULT)
@task(returns=1, time_out=_TIME_OUT)
def trial_multinode_gpu(request_json: str, options_json: str) -> dict[str, Any]:
    return run_trial(request_json, options_json)


TASKS = {
    (False, False): trial_cpu, (False, True): trial_gpu,
    (True, False): trial_multinode_cpu, (True, True): trial_multinode_gpu,
}
