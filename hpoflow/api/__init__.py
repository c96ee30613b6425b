"""The Python API: ``optimize(spec_or_path)`` runs (or resumes) a study and returns its result.

Everything lives in the run directory (``hpoflow.run``); rerunning on it resumes the study and never
exceeds ``n_trials``. ``preflight.check_runnable`` is every check made before the first trial (what
``hpoflow validate`` reports).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import optuna

from hpoflow.api.preflight import check_runnable
from hpoflow.api.result import StudyResult
from hpoflow.engines import Engine, make_engine
from hpoflow.report.outputs import write_outputs
from hpoflow.run import rundir
from hpoflow.run.open import load_run, open_run_storage, open_study, run_budget, study_url
from hpoflow.run.retry import StorageUnavailable
from hpoflow.search.driver import Driver, DriverListener, DriverSummary
from hpoflow.search.samplers import make_pruner, make_sampler
from hpoflow.search.warm_start import warm_start
from hpoflow.spec import StudySpec, env_int, prepare_spec, resolve_training, search_dirs

__all__ = ["StudyResult", "check_runnable", "load_run", "open_run_storage", "optimize", "prepare_spec",
           "run_budget"]


def optimize(
    spec: StudySpec | Mapping[str, Any] | str | os.PathLike[str],
    run_dir: str | os.PathLike[str] | None = None,
    *,
    n_trials: int | None = None,
    engine: Engine | None = None,
    listener: DriverListener | None = None,
    progress: bool = False,
    handle_signals: bool = True,
) -> StudyResult:
    """Run or resume a study; return when its budget is spent or it is stopped.

    ``spec`` is a ``StudySpec``, a mapping in the YAML layout, or a YAML file path. ``run_dir``
    defaults to ``runs/<study name>``. ``engine`` overrides the spec's engine (e.g. a configured
    ``LocalEngine``). ``progress=True`` shows the live progress display on stderr.
    """
    parsed, text = prepare_spec(spec)
    source = os.fspath(spec) if isinstance(spec, str | os.PathLike) else "<spec>"
    check_runnable(parsed, text, source, engine=engine is None)  # before anything is written
    cap = env_int("HPOFLOW_N_TRIALS", minimum=1)
    if n_trials is None and cap is not None:
        n_trials = min(cap, parsed.search.n_trials or cap)  # a cap: never more than the spec
    dirs = search_dirs(spec) if isinstance(spec, str | os.PathLike) else search_dirs()  # for training.function
    where = run_dir if run_dir is not None else Path("runs") / parsed.study.name
    new_dir = not os.path.lexists(os.path.expanduser(where))
    rd = rundir.resolve(where, create=True)
    url = study_url(parsed)  # storage_env's variable leaves os.environ here: no process started later sees it
    with rundir.RunLock(rd) as lock:
        with rundir.disk_errors(rd):
            try:
                study, label = open_study(rd, parsed, text, url, pruner=make_pruner(parsed.search.pruner),
                                          sampler_for=lambda n: make_sampler(parsed.search, resumed_trials=n))
            except BaseException:
                if new_dir:  # (open_study took back what it wrote: a storage that cannot be opened leaves nothing)
                    lock.remove_dir()
                raise
            if parsed.search.warm_start and not study.get_trials(deepcopy=False):
                warm_start(study, parsed)
        stop = _Stop()
        # From the engine's start until it is closed and the outputs are written, a signal never raises
        # (a KeyboardInterrupt there could leave processes running): it stops the driver, or is kept for it.
        with _stop_on_signals(stop, handle_signals):
            eng = engine if engine is not None else make_engine(parsed.engine, parsed.engine_option_values(), rd)
            summary: DriverSummary | None = None
            try:
                summary = _run(study, rd, parsed, eng, dirs, n_trials, _listener(parsed, rd, listener, progress),
                               stop)
            finally:
                if engine is None:
                    eng.close()
                down = (isinstance(sys.exc_info()[1], StorageUnavailable)
                        or getattr(summary, "stopped_by", "") == "storage")
                if not down:  # (a storage that stopped answering has nothing to write them from)
                    write_outputs(study, parsed, text, rd, label, journal=url is None)
        if stop.reason == "signal" and summary.stopped_by in ("budget", "timeout", "grid_exhausted"):
            summary.stopped_by = "signal"  # after its last trial, but interrupted all the same (exit 130)
        return StudyResult(rd, study, summary, label)


def _listener(spec: StudySpec, rd: Path, listener: DriverListener | None, progress: bool) -> DriverListener | None:
    """The given listener (or the progress display), fanned out with the trackers ``tracking:`` asks for."""
    if listener is None and progress:
        from hpoflow.report.progress import ProgressListener

        listener = ProgressListener()
    from hpoflow.report.tracking import FanOut, make_trackers

    trackers = make_trackers(spec.tracking, spec.study.name, rd)  # none unless tracking: asks
    return FanOut([*([listener] if listener else []), *trackers]) if trackers else listener


def _run(study: optuna.Study, rd: Path, spec: StudySpec, engine: Engine, dirs: tuple[str, ...],
         n_trials: int | None, listener: DriverListener | None, stop: _Stop) -> DriverSummary:
    precheck = None
    if spec.oracle.enabled and resolve_training(spec.training, {}).builtin:
        from hpoflow.oracle.precheck import OraclePrecheck

        precheck = OraclePrecheck(spec.oracle.cluster, plugins=tuple(spec.plugins), python_path=dirs)
    try:
        driver = Driver(spec, study, engine, rd, listener=listener, n_trials=n_trials, python_path=dirs,
                        precheck=precheck)
        stop.attach(driver)
        return driver.run()
    finally:
        if precheck is not None:
            precheck.close()


class _Stop:
    """The stop signals of one ``optimize``: passed on to its driver (``Driver.request_stop``), or kept
    until the driver exists; ``reason`` is the first one's."""

    def __init__(self) -> None:
        self.reason: str | None = None
        self._driver: Driver | None = None

    def request(self, reason: str) -> None:
        """A signal handler: never blocks, never raises."""
        if self.reason is None:
            self.reason = reason
        if self._driver is not None:
            self._driver.request_stop(reason)

    def attach(self, driver: Driver) -> None:
        self._driver = driver
        if self.reason is not None:
            driver.request_stop(self.reason)


@contextlib.contextmanager
def _stop_on_signals(stop: _Stop, enabled: bool) -> Iterator[None]:
    """SIGINT/SIGTERM ask the driver to stop cleanly, SIGUSR1 (a walltime warning) to pause the running
    trials with a checkpoint first (in the main thread only)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda signum, frame: stop.request("signal")) for s in (signal.SIGINT, signal.SIGTERM)}
    old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, lambda signum, frame: stop.request("preempted"))
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
