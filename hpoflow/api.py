"""The Python API: ``optimize(spec_or_path)`` runs (or resumes) a study and returns its result.

Everything lives in the run directory (``hpoflow.run``); rerunning on it resumes the study and never
exceeds ``n_trials``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from hpoflow.engines import Engine, check_fit, make_engine
from hpoflow.errors import Issue, RunDirError, SpecError
from hpoflow.report.outputs import write_outputs
from hpoflow.run import rundir
from hpoflow.run.open import load_run, open_run_storage, open_study, run_budget
from hpoflow.search.driver import Driver, DriverListener, DriverSummary
from hpoflow.search.preflight import check_search
from hpoflow.search.samplers import make_pruner, make_sampler
from hpoflow.search.warm_start import warm_start
from hpoflow.spec import StudySpec, env_int, key_lines, prepare_spec, resolve_training, search_dirs
from hpoflow.trial import TrialRequest

__all__ = ["StudyResult", "check_runnable", "load_run", "open_run_storage", "optimize", "prepare_spec",
           "run_budget"]


@dataclass(frozen=True)
class StudyResult:
    """What a study produced. ``study`` is the live Optuna study (open on its storage)."""

    run_dir: Path
    study: optuna.Study
    summary: DriverSummary
    storage: str

    @property
    def best_trial(self) -> optuna.trial.FrozenTrial | None:
        """The best complete trial (None before one completes, and with several objectives)."""
        from hpoflow.report.tables import best_trial

        return best_trial(self.study)

    @property
    def best_params(self) -> dict[str, Any] | None:
        best = self.best_trial
        return None if best is None else dict(best.params)

    @property
    def best_value(self) -> float | None:
        best = self.best_trial
        return None if best is None else best.value

    def trials_dataframe(self) -> Any:
        """Optuna's ``trials_dataframe()`` (needs pandas)."""
        return self.study.trials_dataframe()


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
    rd = rundir.resolve(run_dir if run_dir is not None else Path("runs") / parsed.study.name, create=True)
    url = parsed.storage_url()
    with rundir.RunLock(rd):
        try:
            study, label = open_study(rd, parsed, text, url, pruner=make_pruner(parsed.search.pruner),
                                      sampler_for=lambda n: make_sampler(parsed.search, resumed_trials=n))
        except OSError as exc:
            raise rundir.disk_error(exc, rd) from None
        if parsed.search.warm_start and not study.get_trials(deepcopy=False):
            warm_start(study, parsed)
        eng = engine if engine is not None else make_engine(parsed.engine, parsed.engine_option_values(), rd)
        try:
            summary = _run(study, rd, parsed, eng, dirs, n_trials, _listener(parsed, rd, listener, progress),
                           handle_signals)
        finally:
            if engine is None:
                eng.close()
            write_outputs(study, parsed, text, rd, label, journal=parsed.storage_url() is None)
        return StudyResult(rd, study, summary, label)


def check_runnable(spec: StudySpec, text: str = "", source: str = "<spec>", *, engine: bool = True) -> None:
    """Every check ``optimize`` makes before its first trial that needs no run directory, made at once
    and writing nothing (``hpoflow validate`` calls it too; ``engine=False``: an engine object is
    given, so the spec's engine is not asked): ``HPOFLOW_N_TRIALS``; the ``storage_env`` variable is
    set; a trial of the spec's shape fits the engine (``Engine.check_fit``); the oracle's cluster
    loads; the sampler and the pruner build and propose a trial of this study (``check_search``); the
    warm-start run fits. A ``SpecError`` names the key (and its line when ``text`` is the YAML)."""
    env_int("HPOFLOW_N_TRIALS", minimum=1)
    if spec.storage_env and spec.storage_url() is None:
        raise RunDirError(f"storage_env: the environment variable {spec.storage_env} is not set, so the study's "
                          f"storage is unknown. Fix: export {spec.storage_env}=<storage URL>")
    lines = key_lines(text) if text and source != "<spec>" else {}
    r = spec.resources
    if engine:
        check_fit(spec.engine, spec.engine_option_values(),
                  TrialRequest.shape(r.processes, r.cpus_per_process, r.gpus_per_process, r.nodes))
    if spec.oracle.enabled and spec.oracle.cluster and not resolve_training(spec.training, {}).function:
        from hpoflow.oracle.cluster import load_cluster
        from hpoflow.oracle.errors import OracleError

        try:
            load_cluster(spec.oracle.cluster)
        except OracleError as exc:
            raise SpecError([Issue("oracle.cluster", str(exc).replace("--cluster", "it"),
                                   lines.get(("oracle", "cluster")), source)]) from None
    check_search(spec, source, lines)


def _listener(spec: StudySpec, rd: Path, listener: DriverListener | None, progress: bool) -> DriverListener | None:
    """The given listener (or the progress display), fanned out with the trackers ``tracking:`` asks for."""
    if listener is None and progress:
        from hpoflow.report.progress import ProgressListener

        listener = ProgressListener()
    from hpoflow.report.tracking import FanOut, make_trackers

    trackers = make_trackers(spec.tracking, spec.study.name, rd)  # none unless tracking: asks
    return FanOut([*([listener] if listener else []), *trackers]) if trackers else listener


def _run(study: optuna.Study, rd: Path, spec: StudySpec, engine: Engine, dirs: tuple[str, ...],
         n_trials: int | None, listener: DriverListener | None, handle_signals: bool) -> DriverSummary:
    precheck = None
    if spec.oracle.enabled and not resolve_training(spec.training, {}).function:
        from hpoflow.oracle.precheck import OraclePrecheck

        precheck = OraclePrecheck(spec.oracle.cluster, plugins=tuple(spec.plugins), python_path=dirs)
    driver = Driver(spec, study, engine, rd, listener=listener, n_trials=n_trials, python_path=dirs,
                    precheck=precheck)
    try:
        with _stop_on_signals(driver, handle_signals):
            return driver.run()
    finally:
        if precheck is not None:
            precheck.close()


@contextlib.contextmanager
def _stop_on_signals(driver: Driver, enabled: bool) -> Iterator[None]:
    """SIGINT/SIGTERM ask the driver to stop cleanly (in the main thread only)."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.signal(s, lambda signum, frame: driver.request_stop("signal"))
           for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
