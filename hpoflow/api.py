"""The Python API: ``optimize(spec_or_path)`` runs (or resumes) a study and returns its result.

A run directory holds everything: the spec as given (``spec.yaml``), the Optuna storage
(``study.journal`` unless ``storage`` says otherwise), ``trials/<number>/`` (logs per rank,
``result.json``), ``trials.csv``, ``best.yaml`` and ``run.json``. Rerunning on the same directory
resumes the study and never exceeds ``n_trials``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import optuna
import yaml

from hpoflow import rundir
from hpoflow.engines import Engine, make_engine
from hpoflow.errors import HpoflowError, RunDirError, SpecError
from hpoflow.fileio import write_atomic
from hpoflow.rundir import redact
from hpoflow.search.driver import Driver, DriverListener, DriverSummary
from hpoflow.search.samplers import make_pruner, make_sampler
from hpoflow.search.storage import DEFAULT_JOURNAL, open_storage, storage_label
from hpoflow.spec import StudySpec, load_spec, outside, resolve_training, search_dirs, spec_from_mapping

log = logging.getLogger(__name__)

__all__ = ["StudyResult", "load_run", "open_run_storage", "optimize", "prepare_spec", "run_budget"]

_RESUMABLE_KEYS = {("search", "n_trials"), ("search", "timeout"), ("search", "max_concurrent"),
                   ("search", "max_failures"), ("search", "fail_fast"), ("resources", "timeout"),
                   ("resources", "max_retries")}


@dataclass(frozen=True)
class StudyResult:
    """What a study produced. ``study`` is the live Optuna study (open on its storage)."""

    run_dir: Path
    study: optuna.Study
    summary: DriverSummary
    storage: str

    @property
    def best_params(self) -> dict[str, Any] | None:
        from hpoflow.report import best_trial

        best = best_trial(self.study)
        return None if best is None else dict(best.params)

    @property
    def best_value(self) -> float | None:
        from hpoflow.report import best_trial

        best = best_trial(self.study)
        return None if best is None else best.value

    def trials_dataframe(self) -> Any:
        """Optuna's ``trials_dataframe()`` (needs pandas)."""
        return self.study.trials_dataframe()


def prepare_spec(spec: StudySpec | Mapping[str, Any] | str | os.PathLike[str]) -> tuple[StudySpec, str]:
    """Accept a spec object, a mapping, or a YAML path; return the spec and its YAML text."""
    if isinstance(spec, StudySpec):
        return spec, yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
    if isinstance(spec, Mapping):
        parsed = spec_from_mapping(dict(spec))
        return parsed, yaml.safe_dump(json.loads(json.dumps(dict(spec))), sort_keys=False)
    return load_spec(spec)


def _diff(a: Any, b: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[tuple[str, ...]] = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), (*path, str(k)))
        return out
    return [] if a == b else [path]


def _check_resume(run_dir: Path, spec: StudySpec) -> None:
    old_path = run_dir / "spec.yaml"
    if not old_path.exists():
        if any(p.name != rundir.LOCK_FILE for p in run_dir.iterdir()):
            raise RunDirError(
                f"{run_dir} exists, is not empty and holds no spec.yaml, so it is not an hpoflow run "
                "directory. Fix: choose another --run-dir"
            )
        return
    try:
        old = spec_from_mapping(yaml.safe_load(old_path.read_text()), source=str(old_path))
    except SpecError as exc:
        raise RunDirError(f"{old_path} is not a valid spec any more:\n{exc}") from None
    new = spec.model_dump(mode="json")
    new["storage"] = redact(new.get("storage"))  # spec.yaml holds the redacted URL
    diffs = [d for d in _diff(old.model_dump(mode="json"), new) if d[:2] not in _RESUMABLE_KEYS]
    if diffs:
        shown = ", ".join(".".join(d) for d in diffs[:5])
        raise RunDirError(
            f"{run_dir} holds a run of a different study (they differ at {shown}); resuming it with this "
            "spec would mix results. Fix: use a new --run-dir, or undo those changes (only search.n_trials, "
            "timeout, max_concurrent, max_failures and resources.timeout/max_retries may change on resume)"
        )


@contextlib.contextmanager
def _stop_on_signals(driver: Driver) -> Iterator[list[int]]:
    """SIGINT/SIGTERM ask the driver to stop cleanly (in the main thread only)."""
    received: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        driver.request_stop("signal")

    if sys.platform == "win32" or not _in_main_thread():
        yield received
        return
    old = {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


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
    cap = os.environ.get("HPOFLOW_N_TRIALS", "").strip()
    if n_trials is None and cap:
        if not cap.isdigit() or int(cap) < 1:
            raise HpoflowError(f"HPOFLOW_N_TRIALS must be a whole number >= 1, but got {cap!r}. Fix: unset it or "
                               "set it to e.g. 2")
        n_trials = min(int(cap), parsed.search.n_trials or int(cap))  # a cap: never more than the spec
    # Trials import training.function from the spec's directory, then the current one.
    dirs = search_dirs(spec) if isinstance(spec, str | os.PathLike) else search_dirs()
    rd = rundir.resolve(run_dir if run_dir is not None else Path("runs") / parsed.study.name, create=True)
    url = parsed.storage_url()
    if parsed.storage_env and url is None:
        raise RunDirError(f"storage_env: the environment variable {parsed.storage_env} is not set, so the study's "
                          f"storage is unknown. Fix: export {parsed.storage_env}=<storage URL>")
    with rundir.RunLock(rd):
        try:
            study, label = _open_run(rd, parsed, text, url)
        except OSError as exc:
            raise rundir.disk_error(exc, rd) from None
        return _run(study, label, rd, parsed, text, dirs, n_trials=n_trials, engine=engine, listener=listener,
                    progress=progress, handle_signals=handle_signals)


def _open_run(rd: Path, parsed: StudySpec, text: str, url: str | None) -> tuple[optuna.Study, str]:
    """Check the directory holds this study (or nothing), write spec.yaml and run.json once, and open
    the study. Nothing secret is written: a storage password becomes ``***``."""
    _check_resume(rd, parsed)
    (rd / "trials").mkdir(exist_ok=True)
    if not (rd / "spec.yaml").exists():
        if parsed.storage is not None and redact(parsed.storage) != parsed.storage:
            data = yaml.safe_load(text) or {}
            data["storage"] = redact(parsed.storage)
            text = yaml.safe_dump(data, sort_keys=False)
        write_atomic(rd / "spec.yaml", text)
    label = redact(storage_label(url, rd)) or ""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.create_study(
            storage=open_storage(url, rd), study_name=parsed.study.name,
            directions=[optuna.study.StudyDirection[d.upper()] for _, d in parsed.study.objectives],
            sampler=make_sampler(parsed.search),
            pruner=make_pruner(parsed.search.pruner), load_if_exists=True,
        )
    except (OSError, HpoflowError):
        raise
    except Exception as exc:  # a database URL that does not answer, a missing driver, bad credentials
        why = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if url:
            why = why.replace(url, label)
            parts = url.split("@")[0].rsplit(":", 1)
            if len(parts) == 2 and parts[1]:
                why = why.replace(parts[1], "***")  # the password, wherever the driver quoted it
        raise RunDirError(f"cannot open the study's storage {label}: {type(exc).__name__}: {why[:300]}. Fix: check "
                          "the URL, that the database answers, and that its Python driver is installed") from None
    if parsed.study.multi and study.metric_names is None:
        import warnings

        with warnings.catch_warnings():  # experimental in Optuna 5, and the one public way to name them
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([n for n, _ in parsed.study.objectives])
    existing = len(study.get_trials(deepcopy=False))
    if not existing and parsed.search.warm_start:
        _warm_start(study, parsed, rd)
    elif existing:
        study.sampler = make_sampler(parsed.search, resumed_trials=existing)
    if not (rd / "run.json").exists():
        from hpoflow import __version__

        run_info = {"run_id": uuid.uuid4().hex, "study_name": parsed.study.name, "storage": label,
                    "storage_env": parsed.storage_env, "engine": parsed.engine, "run_dir": str(rd),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hpoflow_version": __version__}
        write_atomic(rd / "run.json", json.dumps(run_info, indent=1))
    return study, label


def _run(study: optuna.Study, label: str, rd: Path, parsed: StudySpec, text: str, dirs: tuple[str, ...], *,
         n_trials: int | None, engine: Engine | None, listener: DriverListener | None, progress: bool,
         handle_signals: bool) -> StudyResult:
    own_engine = engine is None
    eng = engine if engine is not None else make_engine(parsed.engine, parsed.engine_option_values(), rd)
    if listener is None and progress:
        from hpoflow.report import ProgressListener

        listener = ProgressListener()
    if parsed.tracking.mlflow not in (None, False, "") or parsed.tracking.tensorboard not in (False, ""):
        from hpoflow.tracking import FanOut, make_trackers

        trackers = make_trackers(parsed.tracking, parsed.study.name, rd)
        listener = FanOut([*([listener] if listener is not None else []), *trackers])
    precheck = None
    if parsed.oracle.enabled and not resolve_training(parsed.training, {}).function:
        from hpoflow.oracle.precheck import OraclePrecheck

        precheck = OraclePrecheck(parsed.oracle.cluster)
    driver = Driver(parsed, study, eng, rd, listener=listener, n_trials=n_trials, python_path=dirs,
                    precheck=precheck)
    try:
        if handle_signals:
            with _stop_on_signals(driver):
                summary = driver.run()
        else:
            summary = driver.run()
    finally:
        if precheck is not None:
            precheck.close()
        if own_engine:
            eng.close()
        _write_outputs(study, parsed, text, rd, label, journal=parsed.storage_url() is None)
    return StudyResult(rd, study, summary, label)


def _write_outputs(study: optuna.Study, spec: StudySpec, text: str, run_dir: Path, label: str, *,
                   journal: bool) -> None:
    """trials.csv, best.yaml and, for the run's own journal, the status snapshot (``rundir``)."""
    from hpoflow.report import best_rows, status_dict, write_best_yaml, write_trials_csv

    write_trials_csv(study, run_dir / "trials.csv")
    if journal:
        rundir.write_status_snapshot(run_dir, run_dir / DEFAULT_JOURNAL,
                                     status_dict(study, label, budget=run_budget(run_dir)), best_rows(study))
    data = yaml.safe_load(text) if text.strip() else spec.model_dump(mode="json")
    if isinstance(data, dict) and data.get("storage"):
        data["storage"] = redact(data["storage"])
    write_best_yaml(study, data, run_dir / "best.yaml")


def _warm_start(study: optuna.Study, spec: StudySpec, rd: Path) -> None:
    """Import the completed trials of the run in ``search.warm_start`` as prior knowledge: same metric
    and direction required; values outside this space are dropped (said once); imported trials never
    count against ``n_trials`` and are never the best trial."""
    from optuna.trial import TrialState, create_trial

    from hpoflow.search.driver import ATTR_IMPORTED
    from hpoflow.search.space import distribution

    source = str(spec.search.warm_start)
    other, label = load_run(source)
    try:
        other_spec = yaml.safe_load((rundir.resolve(source, create=False) / "spec.yaml").read_text()) or {}
        other_metric = (other_spec.get("study") or {}).get("metric")
    except (OSError, yaml.YAMLError, AttributeError):
        other_metric = None
    if other_metric != spec.study.metric or spec.study.multi or other.directions != study.directions:
        raise RunDirError(f"search.warm_start: {source} optimised {other_metric!r} "
                          f"({', '.join(d.name.lower() for d in other.directions)}), "
                          f"this study {spec.study.metric!r} ({spec.study.direction}); only a study of the same "
                          "metric and direction can warm-start it. Fix: point warm_start at such a run, or remove it")
    dists = {name: distribution(p) for name, p in spec.space.items()}
    imported, dropped = [], 0
    for t in other.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        params = {k: v for k, v in t.params.items() if k in dists and not outside(spec.space[k], v)}
        dropped += len(t.params) - len(params)
        if params and t.value is not None:
            imported.append(create_trial(params=params, distributions={k: dists[k] for k in params}, value=t.value,
                                         user_attrs={ATTR_IMPORTED: f"{label}#{t.number}"}))
    study.add_trials(imported)
    log.warning("warm start: imported %d completed trial(s) of %s%s", len(imported), source,
                f"; dropped {dropped} parameter value(s) outside this space" if dropped else "")


def open_run_storage(run_dir: str | os.PathLike[str], storage: str | None = None
                     ) -> tuple[optuna.storages.BaseStorage, str, str]:
    """A run directory's storage, opened for reading: (storage, study name, redacted label). Creates
    and changes nothing. ``storage`` overrides the stored one (needed when the run's storage URL has
    a password, which hpoflow never writes down, and the spec names no ``storage_env``)."""
    rd = rundir.resolve(run_dir, create=False)
    info_path = rd / "run.json"
    try:
        info = json.loads(info_path.read_text())
        study_name = str(info["study_name"])
    except (OSError, ValueError, KeyError, TypeError):
        raise RunDirError(f"{rd} is not an hpoflow run directory (no readable run.json). Fix: pass the --run-dir "
                          "of a run") from None
    if storage is None:
        try:
            data = yaml.safe_load((rd / "spec.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            data = {}
        env = data.get("storage_env")
        storage = os.environ.get(env) if isinstance(env, str) else data.get("storage")
        if isinstance(env, str) and storage is None:
            raise RunDirError(f"the run's storage URL is in the environment variable {env}, which is not set. "
                              f"Fix: export {env}=<storage URL>")
        if isinstance(storage, str) and "***" in storage:
            raise RunDirError("the run's storage URL has a password, which hpoflow does not write down. Fix: pass "
                              "--storage URL, or name an environment variable with storage_env in the spec")
    try:
        opened = open_storage(storage, rd, create=False)
    except FileNotFoundError as exc:
        raise RunDirError(f"{rd}: {exc}. Fix: pass the --run-dir of a run that has started") from None
    return opened, study_name, redact(storage_label(storage, rd)) or ""


def load_run(run_dir: str | os.PathLike[str], storage: str | None = None) -> tuple[optuna.Study, str]:
    """Open a run directory's study for reading (status, tables): creates and changes nothing."""
    opened, study_name, label = open_run_storage(run_dir, storage)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name, storage=opened)
    except KeyError:
        raise RunDirError(f"{run_dir}: its storage holds no study {study_name!r}. Fix: pass the --run-dir of a "
                          "run that has started") from None
    return study, label


def run_budget(run_dir: str | os.PathLike[str]) -> int | None:
    """The run's ``search.n_trials`` as its spec.yaml says (None for a grid without it, or unreadable)."""
    try:
        data = yaml.safe_load((rundir.resolve(run_dir, create=False) / "spec.yaml").read_text()) or {}
        value = (data.get("search") or {}).get("n_trials")
    except (OSError, yaml.YAMLError, AttributeError, RunDirError):
        return None
    return value if isinstance(value, int) else None
