"""The oracle as a service process: the driver sends trial shapes, gets verdicts back.

The oracle needs torch (FLOPs are counted on the meta device) and the driver must not import it,
so the driver's precheck talks to this loop in a helper process over a pipe.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

from hpoflow.oracle.cluster import ClusterSpec, load_cluster
from hpoflow.oracle.errors import OracleError
from hpoflow.oracle.feasibility import check_trial

__all__ = ["serve"]


def serve(conn: Connection, cluster_source: str | None) -> None:
    """Answer ``(train, processes, gpus_per_process)`` requests with ``Verdict.to_dict()``."""
    cluster: ClusterSpec | None = None
    error: str | None = None
    if cluster_source:
        try:
            cluster = load_cluster(cluster_source)
        except OracleError as exc:
            error = str(exc)
    try:
        while True:
            try:
                train, processes, gpus = conn.recv()
            except (EOFError, OSError):
                return
            if error is not None:
                conn.send({"feasible": True, "reason": f"not checked: {error}", "predicted": {}})
                continue
            try:
                verdict = check_trial(train, processes, gpus, cluster).to_dict()
            except Exception as exc:  # the oracle never blocks what it cannot judge
                verdict = {"feasible": True, "reason": f"not checked: {type(exc).__name__}: {exc}",
                           "predicted": {}}
            conn.send(verdict)
    finally:
        conn.close()
