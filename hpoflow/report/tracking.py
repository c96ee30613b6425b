"""Tracking: every trial logged to MLflow and/or TensorBoard with those tools' own clients.

``tracking: {mlflow: true | URI, experiment: NAME, tensorboard: true | DIR}`` in the spec (``mlflow: true``:
a local store, ``sqlite:///RUN_DIR/mlflow.db``; MLflow 3 refuses its old ``file:`` store by default). Each tracker is a
driver listener: a trial's parameters when it starts, its intermediate reports (per-epoch metrics) as
they come, and at its end the final metrics, timings (``timing/...``) and system usage
(``system/...``) with its state. MLflow: one run per trial (``MlflowClient``; tags ``hpoflow.study``,
``hpoflow.trial``, ``hpoflow.state``). TensorBoard: one event directory per trial (``trial-<n>``,
tensorboardX's ``SummaryWriter``; scalars by metric name, ``final/<metric>`` at the end, the parameters
as text). Tracking never fails a study: an error of a tracker is logged once and that tracker stops.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hpoflow.errors import HpoflowError
from hpoflow.search.driver import DriverListener, DriverSummary
from hpoflow.spec import TrackingSpec
from hpoflow.trial import TrialResult

log = logging.getLogger(__name__)

__all__ = ["FanOut", "MLflowTracker", "TensorBoardTracker", "make_trackers"]

_MLFLOW_STATUS = {"complete": "FINISHED", "pruned": "KILLED", "failed": "FAILED", "cancelled": "KILLED"}


class _Guarded(DriverListener):
    """Calls into a tracking client; the first error disables the tracker (logged), never raised."""

    name = "tracker"
    _broken = False

    def _safe(self, what: str, fn: Any, *args: Any) -> None:
        if self._broken:
            return
        try:
            fn(*args)
        except Exception as exc:  # a tracking server down, a full disk: the study goes on
            self._broken = True
            log.warning("%s tracking stopped (%s failed: %s: %s)", self.name, what, type(exc).__name__, exc)


def _final(result: TrialResult) -> dict[str, float]:
    out = {k: float(v) for k, v in result.metrics.items()}
    out.update({f"timing/{k}": float(v) for k, v in result.timings.items() if k != "started_at"})
    out.update({f"system/{k}": float(v) for k, v in result.system.items()})
    return out


class MLflowTracker(_Guarded):
    """One MLflow run per trial in ``experiment`` at ``uri``."""

    name = "MLflow"

    def __init__(self, uri: str, experiment: str, study: str) -> None:
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(experiment)
        self.experiment_id = found.experiment_id if found is not None else self.client.create_experiment(experiment)
        self.study = study
        self.runs: dict[int, str] = {}
        self.last_step: dict[int, int] = {}

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        def start() -> None:
            run = self.client.create_run(self.experiment_id, run_name=f"{self.study}-trial-{number}",
                                         tags={"hpoflow.study": self.study, "hpoflow.trial": str(number)})
            self.runs[number] = run.info.run_id
            from mlflow.entities import Param

            self.client.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in params.items()])

        self._safe("create_run", start)

    def _metrics(self, number: int, values: dict[str, float], step: int) -> None:
        run_id = self.runs.get(number)
        if run_id is None or not values:
            return
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._safe("log_batch", self.client.log_batch, run_id,
                   [Metric(k.replace("@", "_"), float(v), now, int(step)) for k, v in values.items()])

    def on_trial_report(self, number: int, step: int, metrics: dict[str, float]) -> None:
        self.last_step[number] = max(int(step), self.last_step.get(number, 0))
        self._metrics(number, metrics, step)

    def on_trial_end(self, result: TrialResult, params: dict[str, Any], best: float | None) -> None:
        run_id = self.runs.get(result.number)
        if run_id is None:
            return
        # the final values at the last reported step, logged last: MLflow's summary shows them
        self._metrics(result.number, _final(result), self.last_step.pop(result.number, 0))
        del self.runs[result.number]
        self._safe("set_tag", self.client.set_tag, run_id, "hpoflow.state", result.status)
        self._safe("set_terminated", self.client.set_terminated, run_id, _MLFLOW_STATUS.get(result.status, "FAILED"))

    def on_finish(self, summary: DriverSummary) -> None:
        for run_id in self.runs.values():  # stopped mid-trial: those runs end as killed
            self._safe("set_terminated", self.client.set_terminated, run_id, "KILLED")
        self.runs.clear()


class TensorBoardTracker(_Guarded):
    """One TensorBoard event directory per trial under ``logdir``."""

    name = "TensorBoard"

    def __init__(self, logdir: Path) -> None:
        from tensorboardX import SummaryWriter

        self._writer_cls = SummaryWriter
        self.logdir = logdir
        self.writers: dict[int, Any] = {}

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        def start() -> None:
            w = self._writer_cls(logdir=str(self.logdir / f"trial-{number}"))
            w.add_text("params", "\n".join(f"{k} = {v}" for k, v in params.items()), 0)
            self.writers[number] = w

        self._safe("SummaryWriter", start)

    def on_trial_report(self, number: int, step: int, metrics: dict[str, float]) -> None:
        w = self.writers.get(number)
        if w is not None:
            for k, v in metrics.items():
                self._safe("add_scalar", w.add_scalar, k, float(v), int(step))

    def on_trial_end(self, result: TrialResult, params: dict[str, Any], best: float | None) -> None:
        w = self.writers.pop(result.number, None)
        if w is None:
            return
        for k, v in _final(result).items():
            self._safe("add_scalar", w.add_scalar, f"final/{k}", v, 0)
        self._safe("add_text", w.add_text, "state", result.status, 0)
        self._safe("close", w.close)

    def on_finish(self, summary: DriverSummary) -> None:
        for w in self.writers.values():
            self._safe("close", w.close)
        self.writers.clear()


class FanOut(DriverListener):
    """Several listeners as one (the progress display and the trackers)."""

    def __init__(self, listeners: Sequence[DriverListener]) -> None:
        self.listeners = list(listeners)

    def on_start(self, n_total: int, n_done: int) -> None:
        for lst in self.listeners:
            lst.on_start(n_total, n_done)

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        for lst in self.listeners:
            lst.on_trial_start(number, params)

    def on_trial_report(self, number: int, step: int, metrics: dict[str, float]) -> None:
        for lst in self.listeners:
            lst.on_trial_report(number, step, metrics)

    def on_trial_end(self, result: TrialResult, params: dict[str, Any], best: float | None) -> None:
        for lst in self.listeners:
            lst.on_trial_end(result, params, best)

    def on_finish(self, summary: DriverSummary) -> None:
        for lst in self.listeners:
            lst.on_finish(summary)


def make_trackers(spec: TrackingSpec, study: str, run_dir: Path) -> list[DriverListener]:
    """The trackers ``tracking:`` asks for (none by default)."""
    out: list[DriverListener] = []
    if spec.mlflow not in (None, False, ""):
        uri = f"sqlite:///{run_dir / 'mlflow.db'}" if spec.mlflow is True else str(spec.mlflow)
        try:
            out.append(MLflowTracker(uri, spec.experiment or study, study))
        except Exception as exc:  # a bad URI, a server that does not answer
            why = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
            raise HpoflowError(f"tracking.mlflow: cannot open the MLflow tracking store {uri!r}: {why}. Fix: "
                               "check the URI (e.g. sqlite:///mlflow.db or http://host:5000) and that the server "
                               "answers") from None
    if spec.tensorboard not in (False, ""):
        logdir = run_dir / "tensorboard" if spec.tensorboard is True else Path(str(spec.tensorboard)).expanduser()
        out.append(TensorBoardTracker(logdir))
    return out
