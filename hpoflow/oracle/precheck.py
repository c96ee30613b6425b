"""Before a trial takes a slot: ask the parallelism oracle whether it can fit at all.

The oracle runs in a helper process (it needs torch; the driver does not import it), started on
first use from the ``forkserver`` context (the local engine's forkserver already holds torch) and
asked once per distinct trial shape: verdicts are cached. Only trials of the built-in trainer are
checked; a user's ``training.function`` is opaque to the oracle. A service that dies is restarted
(up to ``max_restarts`` times); one that hangs, or dies again and again, leaves the trials unchecked.
A stop (``interrupt``) restarts nothing: from then on trials are left unchecked, and a wait for the
service ends at once. The service ignores SIGINT (a terminal's Ctrl-C reaches the whole process
group); the driver ends it by closing its pipe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import signal
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

from hpoflow.trial import TrialRequest, Verdict

log = logging.getLogger(__name__)

__all__ = ["OraclePrecheck", "judged"]

def _serve(conn: Connection, cluster: str | None, plugins: tuple[str, ...], python_path: tuple[str, ...]) -> None:
    """Process entry (this module stays torch-free; the oracle and torch load in the child, after the
    spec's plug-in modules, so a registered model or strategy is priced like a built-in one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's to handle; it closes the pipe to stop this
    from hpoflow.oracle.service import serve
    from hpoflow.spec import import_plugins

    import_plugins(plugins, python_path)  # one that fails: its trials are "not checked", never blocked
    serve(conn, cluster)


_JUDGED = ("model", "model_options", "dataset", "val_fraction", "batch_size", "optimizer", "momentum", "epochs",
           "strategy", "strategy_options", "precision", "activation_checkpointing")


def judged(request: TrialRequest) -> tuple[dict[str, Any], str]:
    """The part of a built-in trial's training config the oracle judges, and a cache key for its
    verdict (that part, the processes and the GPUs per process)."""
    train = {k: request.train[k] for k in _JUDGED if request.train.get(k) is not None}
    return train, json.dumps([train, request.processes, request.gpus_per_process], sort_keys=True, default=str)


class OraclePrecheck:
    """Callable ``(request) -> Verdict | None``; ``None`` for trials the oracle does not judge."""

    def __init__(self, cluster: str | None = None, timeout_s: float = 120.0, max_restarts: int = 2, *,
                 plugins: tuple[str, ...] = (), python_path: tuple[str, ...] = ()) -> None:
        self.cluster = cluster
        self.plugins = plugins
        self.python_path = python_path
        self.timeout_s = timeout_s
        self._conn: Connection | None = None
        self._proc: BaseProcess | None = None
        self._cache: dict[str, Verdict] = {}
        self._broken: str | None = None
        self.restarts = 0
        self.max_restarts = max_restarts
        self._stopping = False  # interrupt(): a plain flag, set from a signal handler

    def __call__(self, request: TrialRequest) -> Verdict | None:
        if request.train.get("function") or request.train.get("command") is not None:  # opaque to the oracle
            return None
        train, key = judged(request)
        if key not in self._cache:
            self._cache[key] = self._ask(train, request.processes, request.gpus_per_process)
        return self._cache[key]

    def interrupt(self) -> None:
        """A stop has begun (maybe in a signal handler: a flag and a signal, no lock, no wait): the
        service is never started or restarted again, and a wait for its answer ends at once (it is
        killed); trials asked from now on are left unchecked."""
        self._stopping = True
        pid = getattr(self._proc, "pid", None)
        if pid:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    def _ask(self, train: dict[str, Any], processes: int, gpus: float) -> Verdict:
        while self._broken is None:
            if self._stopping:
                return Verdict(True, "not checked: the study is stopping", {})
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
            except (OSError, EOFError) as exc:  # the service died (a kill, an OOM): start a new one
                self.close()
                if self._stopping:  # killed by the stop: nothing is restarted
                    continue
                self.restarts += 1
                log.warning("the oracle service died (%s: %s); restart %d of %d", type(exc).__name__, exc,
                            self.restarts, self.max_restarts)
                if self.restarts > self.max_restarts:
                    self._broken = f"the oracle service died {self.restarts} times ({exc}); trials run unchecked"
            except TimeoutError as exc:  # a hung service is not restarted: it would hang again
                self._broken = f"the oracle service failed ({exc}); trials run unchecked"
                self.close()
            else:
                return Verdict(bool(data["feasible"]), str(data["reason"]), dict(data.get("predicted") or {}))
        return Verdict(True, f"not checked: {self._broken}", {})

    def _start(self) -> None:
        from hpoflow.engines.local import ensure_forkserver
        from hpoflow.engines.proc import start_without_main

        start_without_main()  # "hpoflow-oracle" never runs the caller's __main__ (a script on stdin)
        ensure_forkserver()  # with SIGINT blocked, as everything it forks: the service too
        ctx = mp.get_context("forkserver")
        parent, child = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_serve, args=(child, self.cluster, self.plugins, self.python_path),
                           name="hpoflow-oracle", daemon=True)
        try:
            proc.start()  # waits for the forkserver's preload (a stop kills a forkserver still preloading)
        except BaseException:
            parent.close()
            raise
        finally:
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
