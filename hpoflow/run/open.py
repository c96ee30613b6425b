"""Opening a run directory's study: the resume checks, the files written once, and read-only access.

``open_study`` is what ``optimize`` does before its first trial: check that the directory holds this
study (or nothing), create or reopen the Optuna study, check that the study is one of this spec (the
study system attr ``hpoflow_spec``: ``hpoflow.spec.study_fingerprint``, recorded by the driver that
created the study), and only then write ``spec.yaml`` and ``run.json`` once.
``open_run_storage`` / ``load_run`` open a run for reading (``status``, ``report``, ``dashboard``,
a warm start) and create nothing; ``run_budget`` is the run's ``search.n_trials``. Nothing secret is
written: a storage password becomes ``***``.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import optuna
import yaml

from hpoflow._version import __version__
from hpoflow.credentials import password_of, take_env
from hpoflow.errors import HpoflowError, RunDirError, SpecError
from hpoflow.fileio import write_atomic
from hpoflow.registry import SCHEDULERS
from hpoflow.run import rundir
from hpoflow.run.lease import LEASE_PREFIX
from hpoflow.run.retry import RetryingStorage, StorageFull, StorageUnavailable, transient_cause
from hpoflow.run.rundir import redact
from hpoflow.run.storage import DEFAULT_JOURNAL, open_storage, storage_label
from hpoflow.spec import StudySpec, TrainConfig, in_memory_storage, spec_from_mapping, study_fingerprint

__all__ = ["ATTR_SPEC", "LAUNCH_DIR", "RESUMABLE_KEYS", "check_resume", "check_study_spec", "load_run",
           "open_run_storage", "open_study", "run_budget", "study_url"]

LAUNCH_DIR = "launch"  # hpoflow launch's batch script and the job's output, written before the run starts

# What may change between a run and its resume: budgets and limits, never what a trial is.
RESUMABLE_KEYS = {("search", "n_trials"), ("search", "timeout"), ("search", "max_concurrent"),
                  ("search", "max_failures"), ("search", "fail_fast"), ("resources", "timeout"),
                  ("resources", "max_retries"), ("storage_retry_s",), ("search", "lease_s")}


ATTR_SPEC = "hpoflow_spec"  # study system attr: what the study's trials have in common (study_fingerprint)
_SPEC_WAIT_S = 10.0  # how long a driver that finds a new study without it waits for its creator to record it


def _diff(a: Any, b: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The key paths where two mappings differ; of two mappings of different ``type`` only that key."""
    if isinstance(a, dict) and isinstance(b, dict):
        if "type" in a and "type" in b and a["type"] != b["type"]:
            return [(*path, "type")]
        out: list[tuple[str, ...]] = []
        for k in sorted(set(a) | set(b)):
            out += _diff(a.get(k), b.get(k), (*path, str(k)))
        return out
    return [] if a == b else [path]


def check_resume(run_dir: Path, spec: StudySpec) -> None:
    """``RunDirError`` unless ``run_dir`` is empty or holds a run of this same study (only the
    ``RESUMABLE_KEYS`` may differ)."""
    old_path = run_dir / "spec.yaml"
    if not old_path.exists():
        # (a run stopped between opening its journal and writing spec.yaml left the journal: its study,
        # if any, is checked against this spec by check_study_spec)
        started = (rundir.LOCK_FILE, LAUNCH_DIR, DEFAULT_JOURNAL, f"{DEFAULT_JOURNAL}.lock")
        if any(p.name not in started for p in run_dir.iterdir()):
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
    diffs = [d for d in _diff(old.model_dump(mode="json"), new) if d[:2] not in RESUMABLE_KEYS]
    if diffs:
        shown = ", ".join(".".join(d) for d in diffs[:5])
        raise RunDirError(
            f"{run_dir} holds a run of a different study (they differ at {shown}); resuming it with this "
            "spec would mix results. Fix: use a new --run-dir, or undo those changes (only search.n_trials, "
            "timeout, max_concurrent, max_failures, fail_fast, lease_s, resources.timeout/max_retries and "
            "storage_retry_s may change on "
            "resume)"
        )


_ABSENT = object()


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 40 else text[:37] + "..."


def _differences(theirs: dict[str, Any], mine: dict[str, Any]) -> list[str]:
    """Where this spec's fingerprint differs from the study's, as ``path (the study: X, this spec: Y)``."""
    out = []
    order = ("study", "space", "search", "training")  # the spec's order
    for path in sorted(_diff(theirs, mine), key=lambda p: order.index(p[0]) if p[0] in order else len(order)):
        sides = []
        for where in (theirs, mine):
            for key in path:
                where = where.get(key, _ABSENT) if isinstance(where, dict) else _ABSENT
            sides.append("not set" if where is _ABSENT else _shown(where))
        out.append(f"{'.'.join(path)} (the study: {sides[0]}, this spec: {sides[1]})")
    return out


def check_study_spec(storage: optuna.storages.BaseStorage, study_id: int, spec: StudySpec, label: str, *,
                     created: bool) -> None:
    """Record this spec's fingerprint in a study this driver ``created``; otherwise ``RunDirError`` unless
    the study holds the same one. A study that holds none is one from before hpoflow recorded it (it has
    trials or driver leases) or one whose creator has not recorded it yet: after ``_SPEC_WAIT_S`` for it,
    or at once for an older study, this spec's is recorded and the study is joined."""
    mine = study_fingerprint(spec)
    if created:
        storage.set_study_system_attr(study_id, ATTR_SPEC, mine)
        return
    deadline = time.monotonic() + _SPEC_WAIT_S
    while True:
        attrs = storage.get_study_system_attrs(study_id)
        theirs = attrs.get(ATTR_SPEC)
        if theirs is not None:
            break
        older = any(k.startswith(LEASE_PREFIX) for k in attrs) or storage.get_n_trials(study_id) > 0
        if older or time.monotonic() >= deadline:
            storage.set_study_system_attr(study_id, ATTR_SPEC, mine)
            return
        time.sleep(0.05)
    differences = _differences(theirs, mine)
    if differences:
        more = f" and {len(differences) - 5} more" if len(differences) > 5 else ""
        raise RunDirError(
            f"the study {spec.study.name!r} in {label} belongs to another spec: they differ at "
            f"{', '.join(differences[:5])}{more}. Its drivers must agree on the objectives, space, search.scheduler "
            "and training, or their trials cannot be compared. Fix: give this spec the study's values, or another "
            "study.name (or storage)")


def _open_error(exc: Exception, url: str | None, label: str) -> HpoflowError:
    """The one-line error for a storage that cannot be opened (the password blanked out)."""
    if isinstance(exc, HpoflowError) and not isinstance(exc, StorageUnavailable):
        return exc
    why = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, StorageUnavailable):
        why = exc.cause or why
    elif isinstance(exc, optuna.exceptions.StorageInternalError):
        why = transient_cause(exc) or why  # the database's own words, not Optuna's guess about them
    if url:
        why = why.replace(url, label)
        pw = password_of(url)
        if pw:
            why = why.replace(pw, "***")  # wherever the driver quoted it
    kind = "" if isinstance(exc, StorageUnavailable) else f"{type(exc).__name__}: "
    return RunDirError(f"cannot open the study's storage {label}: {kind}{why[:300]}. Fix: check the URL, that the "
                       "database answers, and that its Python driver is installed")


def study_url(spec: StudySpec) -> str | None:
    """The storage URL a run opens (None: the run directory's journal). ``storage_env``'s variable is
    taken out of the environment here and kept in memory (``StudySpec.storage_url``); ``RunDirError``
    when it is not set."""
    url = spec.storage_url()
    if spec.storage_env and url is None:
        raise RunDirError(f"storage_env: the environment variable {spec.storage_env} is not set, so the study's "
                          f"storage is unknown. Fix: export {spec.storage_env}=<storage URL>")
    memory = in_memory_storage(url) if spec.storage_env and url is not None else None
    if memory:  # (the spec's own storage: is checked with the spec)
        raise RunDirError(f"storage_env: the environment variable {spec.storage_env} holds {redact(url)!r}, {memory}: "
                          "it lives only inside the driver's process, so nothing is kept when the run ends: `hpoflow "
                          "status` and a resume cannot find the study. Fix: export "
                          f"{spec.storage_env}=<URL of a database file or server>")
    return url


@contextlib.contextmanager
def _taken_back_on_error(rd: Path, url: str | None) -> Iterator[None]:
    """In a directory that holds no run yet (no spec.yaml), what the block creates there (spec.yaml,
    trials/, the run's own journal while still empty) is removed if it raises: a run whose storage
    cannot be opened leaves the directory as it found it, and the same command with the storage fixed
    starts afresh instead of finding "a run of a different study"."""
    if (rd / "spec.yaml").exists():
        yield
        return
    journal = Path(storage_label(url, rd)) if url is None or "://" not in url else None
    new = [p for p in (rd / "spec.yaml", rd / "trials", journal)
           if p is not None and p.parent == rd and not os.path.lexists(p)]
    try:
        yield
    except BaseException:
        for p in new:
            with contextlib.suppress(OSError):
                if p.is_dir():
                    p.rmdir()  # (empty: no trial ran)
                elif p != journal or p.stat().st_size == 0:
                    p.unlink()
        raise


def _study_exists(storage: optuna.storages.BaseStorage, name: str) -> bool:
    """Whether ``storage`` holds a study named ``name`` (read only)."""
    try:
        storage.get_study_id_from_name(name)
    except KeyError:
        return False
    return True


def open_study(rd: Path, spec: StudySpec, text: str, url: str | None, *,
               sampler_for: Callable[[int], optuna.samplers.BaseSampler],
               pruner: optuna.pruners.BasePruner) -> tuple[optuna.Study, str]:
    """Check the directory holds this study (or nothing), create or reopen the study and check it is
    this spec's (``check_study_spec``), then write spec.yaml and run.json once: (study, redacted storage
    label). A study refused leaves nothing new in the directory. ``sampler_for(n)`` is the sampler for
    a study that already holds ``n`` trials (a resumed stream must not repeat the first run's)."""
    check_resume(rd, spec)
    label = redact(storage_label(url, rd)) or ""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    with _taken_back_on_error(rd, url):
        storage = None
        try:  # no waiting at open: a URL that does not answer now is more often wrong than down
            storage = RetryingStorage(optuna.storages.get_storage(open_storage(url, rd)), label, 0.0,
                                      secret=password_of(url))
            # an existing study is looked up first: creating it again would append a record (the journal's
            # create-study, which Optuna then refuses as a duplicate) before its spec is checked
            created = not _study_exists(storage, spec.study.name)
            if created:
                try:
                    study = optuna.create_study(
                        storage=storage, study_name=spec.study.name,
                        directions=[optuna.study.StudyDirection[d.upper()] for _, d in spec.study.objectives],
                        sampler=sampler_for(0), pruner=pruner)
                except optuna.exceptions.DuplicatedStudyError:  # another driver created it meanwhile
                    created = False
            if not created:
                study = optuna.load_study(study_name=spec.study.name, storage=storage, sampler=sampler_for(0),
                                          pruner=pruner)
        except (OSError, StorageFull):
            raise
        except Exception as exc:  # a database URL that does not answer, a missing driver, bad credentials
            raise _open_error(exc, url, label) from None
        storage.retry_s = spec.storage_retry_s
        check_study_spec(storage, study._study_id, spec, label, created=created)  # (Optuna keeps the id private)
        (rd / "trials").mkdir(exist_ok=True)
        if not (rd / "spec.yaml").exists():
            if spec.storage is not None and redact(spec.storage) != spec.storage:
                data = yaml.safe_load(text) or {}
                data["storage"] = redact(spec.storage)
                text = yaml.safe_dump(data, sort_keys=False)
            write_atomic(rd / "spec.yaml", text)
    if spec.study.multi and study.metric_names is None:
        with warnings.catch_warnings():  # experimental in Optuna 5, and the one public way to name them
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            study.set_metric_names([n for n, _ in spec.study.objectives])
    existing = len(study.get_trials(deepcopy=False))
    if existing:
        study.sampler = sampler_for(existing)
    if not (rd / "run.json").exists():
        run_info = {"run_id": uuid.uuid4().hex, "study_name": spec.study.name, "storage": label,
                    "storage_env": spec.storage_env, "engine": spec.engine, "run_dir": str(rd),
                    "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "hpoflow_version": __version__}
        write_atomic(rd / "run.json", json.dumps(run_info, indent=1))
    return study, label


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
        storage = take_env(env) if isinstance(env, str) else data.get("storage")
        if isinstance(env, str) and storage is None:
            raise RunDirError(f"the run's storage URL is in the environment variable {env}, which is not set. "
                              f"Fix: export {env}=<storage URL>")
        if isinstance(storage, str) and "***" in storage:
            raise RunDirError("the run's storage URL has a password, which hpoflow does not write down. Fix: export "
                              "it in an environment variable and pass its name with --storage-env NAME (or "
                              "--storage URL, which other users of this machine can see in ps)")
    label = redact(storage_label(storage, rd)) or ""
    try:
        opened = open_storage(storage, rd, create=False)
    except FileNotFoundError as exc:
        raise RunDirError(f"{rd}: {exc}. Fix: pass the --run-dir of a run that has started") from None
    except Exception as exc:  # a database that does not answer, a missing driver, bad credentials
        raise _open_error(exc, storage, label) from None
    return opened, study_name, label


def load_run(run_dir: str | os.PathLike[str], storage: str | None = None) -> tuple[optuna.Study, str]:
    """Open a run directory's study for reading (status, tables): creates and changes nothing."""
    opened, study_name, label = open_run_storage(run_dir, storage)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name, storage=opened)
    except KeyError:
        raise RunDirError(f"{run_dir}: its storage holds no study {study_name!r}. Fix: pass the --run-dir of a "
                          "run that has started") from None
    except Exception as exc:  # the database stopped answering since
        raise _open_error(exc, storage, label) from None
    return study, label


def run_budget(run_dir: str | os.PathLike[str]) -> int | None:
    """The run's ``search.n_trials`` as its spec.yaml says (None for a grid without it, or unreadable);
    for PBT (``search.scheduler: {type: pbt}``) at most the intervals its population can have."""
    try:
        data = yaml.safe_load((rundir.resolve(run_dir, create=False) / "spec.yaml").read_text()) or {}
        search = data.get("search") or {}
        value = search.get("n_trials")
        scheduler = search.get("scheduler")
    except (OSError, yaml.YAMLError, AttributeError, RunDirError):
        return None
    if not isinstance(value, int):
        return None
    if isinstance(scheduler, dict) and scheduler.get("type") == "pbt":
        epochs = (data.get("training") or {}).get("epochs", TrainConfig.model_fields["epochs"].default)
        try:
            flat = {k: v for k, v in scheduler.items() if k != "type"}  # (written flat, or under options:)
            options = SCHEDULERS.options("pbt", scheduler["options"] if "options" in scheduler else flat)
        except HpoflowError:
            return value
        if isinstance(epochs, int):
            value = min(value, int(options.budget(epochs)))  # type: ignore[attr-defined]
    return value
