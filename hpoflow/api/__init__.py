"""The Python API: ``optimize(spec_or_path)`` runs (or resumes) a study and returns its result.

Everything lives in the run directory (``hpoflow.run``); rerunning on it resumes the study and never
exceeds ``n_trials``. ``preflight.check_runnable`` is every check made before the first trial (what
``hpoflow validate`` reports).
"""

from __future__ import annotations

import contextlib
import os
import sys
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
from hpoflow.run.signals import StopSignals, stop_signals
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
    ``handle_signals``: SIGINT and SIGTERM stop the study cleanly, SIGUSR1 (a walltime warning) pauses
    its running trials first (``hpoflow.run.signals``: recorded, never raised, from the start to the
    end of the call; in the main thread only).
    """
    with stop_signals(handle_signals) as stop:
        return _optimize(spec, run_dir, n_trials, engine, listener, progress, stop)


def _optimize(spec: StudySpec | Mapping[str, Any] | str | os.PathLike[str], run_dir: str | os.PathLike[str] | None,
              n_trials: int | None, engine: Engine | None, listener: DriverListener | None, progress: bool,
              stop: StopSignals) -> StudyResult:
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
    with _prestarted(parsed, dirs, own_engine=engine is None), rundir.RunLock(rd) as lock:
        with rundir.disk_errors(rd):
            try:
                study, label = open_study(rd, parsed, text, url, pruner=make_pruner(
                    parsed.search.pruner, parsed.training.get("epochs")),
                                          sampler_for=lambda n: make_sampler(parsed.search, resumed_trials=n))
            except BaseException:
                if new_dir:  # (open_study took back what it wrote: a storage that cannot be opened leaves nothing)
                    lock.remove_dir()
                raise
            if parsed.search.warm_start and not study.get_trials(deepcopy=False):
                warm_start(study, parsed)
        eng = engine if engine is not None else make_engine(parsed.engine, parsed.engine_option_values(), rd)
        summary: DriverSummary | None = None
        try:
            summary = _run(study, rd, parsed, eng, dirs, n_trials, _listener(parsed, rd, listener, progress), stop)
        finally:
            if engine is None:
                eng.close()
            down = isinstance(sys.exc_info()[1], StorageUnavailable) or getattr(summary, "stopped_by", "") == "storage"
            if not down:  # (a storage that stopped answering has nothing to write them from)
                write_outputs(study, parsed, text, rd, label, journal=url is None)
        if stop.reason == "signal" and summary.stopped_by in ("budget", "timeout", "energy_budget", "grid_exhausted"):
            summary.stopped_by = "signal"  # after its last trial, but interrupted all the same (exit 130)
        return StudyResult(rd, study, summary, label)


@contextlib.contextmanager
def _prestarted(spec: StudySpec, dirs: tuple[str, ...], *, own_engine: bool) -> Iterator[None]:
    """The local engine's processes boot while the study opens (``hpoflow.engines.local.prestart_for``:
    light workers when the trials need no torch, no torch import then; else the forkserver); what no
    engine adopted (the study did not open, another driver holds the run) is stopped on the way out."""
    if not own_engine or spec.engine != "local":
        yield
        return
    from hpoflow.engines.local import discard_prestarted, prestart_for

    prestart_for(spec, dirs)
    try:
        yield
    finally:
        discard_prestarted()


def _listener(spec: StudySpec, rd: Path, listener: DriverListener | None, progress: bool) -> DriverListener | None:
    """The given listener (or the progress display), fanned out with the trackers ``tracking:`` asks for."""
    if listener is None and progress:
        from hpoflow.report.progress import ProgressListener

        listener = ProgressListener()
    from hpoflow.report.tracking import FanOut, make_trackers

    trackers = make_trackers(spec.tracking, spec.study.name, rd)  # none unless tracking: asks
    return FanOut([*([listener] if listener else []), *trackers]) if trackers else listener


def _run(study: optuna.Study, rd: Path, spec: StudySpec, engine: Engine, dirs: tuple[str, ...],
         n_trials: int | None, listener: DriverListener | None, stop: StopSignals) -> DriverSummary:
    precheck = None
    if spec.oracle.enabled and resolve_training(spec.training, {}).builtin:
        from hpoflow.oracle.precheck import OraclePrecheck

        precheck = OraclePrecheck(spec.oracle.cluster, plugins=tuple(spec.plugins), python_path=dirs)
    try:
        driver = Driver(spec, study, engine, rd, listener=listener, n_trials=n_trials, python_path=dirs,
                        precheck=precheck)
        stop.attach(driver.request_stop)  # a signal that came before (opening the study) stops it at once
        return driver.run()
    finally:
        if precheck is not None:
            precheck.close()
