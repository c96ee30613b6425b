"""Before a trial takes a slot: ask the parallelism oracle whether it can fit at all.

The oracle runs in a helper process (it needs torch; the driver does not import it), started on
first use from the ``forkserver`` context (the local engine's forkserver already holds torch) and
asked once per distinct trial shape: verdicts are cached. Only trials of the built-in trainer are
checked; a user's ``training.function`` is opaque to the oracle.
"""

from __future__ import annotations

import json
import multiprocessing as mp
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from hpoflow.trial import TrialRequest, Verdict

__all__ = ["OraclePrecheck"]

def _serve(conn: Connection, cluster: str | None) -> None:
    """Process entry (this module stays torch-free; the oracle and torch load in the child)."""
    from hpoflow.oracle.service import serve

    serve(conn, cluster)


class OraclePrecheck:
    """Callable ``(request) -> Verdict | None``; ``None`` for trials the oracle does not judge."""

    def __init__(self, cluster: str | None = None, timeout_s: float = 120.0) -> None:
        self.cluster = cluster
        self.timeout_s = timeout_s
        self._conn: Connection | None = None
        self._proc: BaseProcess | None = None
        self._cache: dict[str, Verdict] = {}
        self._broken: str | None = None

    def __call__(self, request: TrialRequest) -> Verdict | None:
        if request.train.get("function"):
            return None
        keys = ("model", "model_options", "dataset", "val_fraction", "batch_size", "optimizer", "momentum",
                "epochs", "strategy", "strategy_options")
        train = {k: request.train[k] for k in keys if request.train.get(k) is not None}
        key = json.dumps([train, request.processes, request.gpus_per_process], sort_keys=True, default=str)
        if key not in self._cache:
            self._cache[key] = self._ask(train, request.processes, request.gpus_per_process)
        return self._cache[key]

    def _ask(self, train: dict[str, Any], processes: int, gpus: int) -> Verdict:
        if self._broken is not None:
            return Verdict(True, f"not checked: {self._broken}", {})
        try:
            if self._conn is None:
                self._start()
            conn = self._conn
            if conn is None:  # _start either sets it or raises
                raise OSError("oracle service did not start")
            conn.send((train, processes, gpus))
            if not conn.poll(self.timeout_s):
                raise TimeoutError(f"no answer in {self.timeout_s:g} s")
            data = conn.recv()
        except (OSError, EOFError, TimeoutError) as exc:
            self._broken = f"the oracle service failed ({type(exc).__name__}: {exc}); trials run unchecked"
            self.close()
            return Verdict(True, f"not checked: {self._broken}", {})
        return Verdict(bool(data["feasible"]), str(data["reason"]), dict(data.get("predicted") or {}))

    def _start(self) -> None:
        ctx = mp.get_context("forkserver")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_serve, args=(child, self.cluster), name="hpoflow-oracle", daemon=True)
        proc.start()
        child.close()
        self._conn, self._proc = parent, proc

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._proc is not None:
            self._proc.join(2)
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join(2)
            self._proc = None
