"""Shared fixtures: small specs that train in about a second, and process-leak checks."""

from __future__ import annotations

import contextlib
import copy
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # so trial processes can import tests' training functions

pytest_plugins = ["tests.infra.fixtures"]  # slurm_cluster, postgres_server: real daemons, see tests/infra

TINY: dict[str, Any] = {
    "study": {"name": "tiny", "metric": "val_accuracy", "direction": "maximize"},
    "space": {
        "lr": {"type": "float", "low": 0.003, "high": 0.03, "log": True},
        "hidden": {"type": "categorical", "choices": [32, 64]},
    },
    "search": {"algorithm": "random", "n_trials": 3, "max_concurrent": 2, "seed": 1},
    "training": {"model": "mlp", "model_options": {"hidden": "${hidden}"}, "dataset": "digits",
                 "epochs": 2, "batch_size": 64, "optimizer": "adam", "lr": "${lr}"},
    "resources": {"processes": 1, "cpus_per_process": 1},
}


# The xdist_group of the oracle's in-process tests (tests/oracle) that use no shared fixture: one worker runs
# them, so a model's trace on the meta device (``model_facts``, ``trace_model``: up to seconds each, kept per
# process) is made once per run, not once per worker that meets the model.
ORACLE_GROUP = "oracle-models"


def pythonpath(*dirs: str | Path) -> str:
    """PYTHONPATH for a process a test starts: ``dirs``, then this process's own PYTHONPATH, where packages
    reached from outside the interpreter's prefix come from (a cluster's ``module load``; the nested run of
    tests/engines/test_workers_venv.py): without it the child lacks what this process imports."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]  # ("": the cwd: left out)
    return os.pathsep.join([*(str(d) for d in dirs), *inherited])


RUN_ENV = {**os.environ, "PYTHONPATH": pythonpath(ROOT, ROOT / "tests")}  # trial functions importable


def start_run(tmp_path: Path, data: dict[str, Any]) -> tuple[subprocess.Popen[bytes], Path, list[str]]:
    """``hpoflow run SPEC --run-dir RUN --json`` of ``data`` (written to ``tmp_path/spec.yaml``) in a session
    of its own, so a test can SIGKILL the driver and its workers at once: (process, run directory, argv
    to run it again)."""
    import yaml

    f = tmp_path / "spec.yaml"
    f.write_text(yaml.safe_dump(data))
    run_dir = tmp_path / "run"
    args = [sys.executable, "-m", "hpoflow", "run", str(f), "--run-dir", str(run_dir), "--json"]
    proc = subprocess.Popen(args, env=RUN_ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    return proc, run_dir, args


def study_so_far(run_dir: Path, name: str) -> Any:
    """The study of a run in progress (an ``optuna.Study``), or None while its journal does not hold it yet."""
    import optuna

    from hpoflow.run.storage import open_storage

    if not (run_dir / "study.journal").exists():
        return None
    try:
        return optuna.load_study(study_name=name, storage=open_storage(None, run_dir))
    except (KeyError, ValueError):
        return None


def kill_run_when(proc: subprocess.Popen[bytes], run_dir: Path, name: str, ready: Callable[[Any], bool],
                  bound_s: float = 240.0) -> None:
    """Read the run's study every 0.2 s until ``ready(study)`` (``bound_s`` bounds a hang), then SIGKILL the
    driver and its workers at once (its session's group)."""
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < bound_s:
            time.sleep(0.2)
            study = study_so_far(run_dir, name)
            if study is not None and ready(study):
                return
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


@pytest.fixture
def tiny_spec() -> dict[str, Any]:
    return copy.deepcopy(TINY)


@contextlib.contextmanager
def mounted_tmpfs(mnt: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at ``mnt`` (made here) with ``options``, unmounted afterwards whatever happened;
    skips the test where mounting is refused (not root, no CAP_SYS_ADMIN)."""
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(mnt)], capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)


def descendants() -> set[int]:
    """Pids of live descendants of this process, except the multiprocessing forkserver and resource
    tracker themselves (long-lived helpers of this process; trial ranks are *their* children)."""
    me = os.getpid()
    out = set()
    for p in psutil.Process(me).children(recursive=True):
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            cmd = " ".join(p.cmdline())
            ppid = p.ppid()
        except psutil.Error:
            continue
        if ppid == me and ("forkserver" in cmd or "resource_tracker" in cmd):
            continue
        out.add(p.pid)
    return out


@pytest.fixture
def forget_plugin_kit() -> Any:
    """Every registry as it was before the test, and tests.plugin_kit unimported after it: a test that
    imports the kit (its registrations) does not leak kit_* names into the lists other tests check."""
    from hpoflow import registry

    kinds = [r for r in vars(registry).values() if isinstance(r, registry.Registry)]
    saved = [dict(r._entries) for r in kinds]
    try:
        yield
    finally:
        for r, entries in zip(kinds, saved, strict=True):
            r._entries = entries
        sys.modules.pop("tests.plugin_kit", None)


@pytest.fixture(scope="session")
def calibration_2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    """One real 2-process gloo calibration of this machine per test run (it takes ~10 s), shared
    by every test that needs one: the ClusterSpec and the YAML file it was written to."""
    from hpoflow.oracle import calibrate, write_cluster

    spec = calibrate(2, scale=0.2)
    return spec, write_cluster(spec, tmp_path_factory.mktemp("calibration") / "cal.yaml")


def _preload_the_forkserver() -> None:
    """Ranks a test starts itself (``mp.get_context("forkserver").Process``) fork from a forkserver that
    preloaded what the local engine's does (torch, the trainer, their warm-up), as the engine's workers do:
    otherwise each imports torch again (~1.5 CPU-s), or not, depending on whether an engine of the same
    process started the forkserver first. Nothing starts here: the first fork does."""
    if os.environ.get("HPOFLOW_TEST_COLD_FORKSERVER") == "1":
        return
    from hpoflow.engines.local import use_engine_preload

    use_engine_preload()


def pytest_configure(config: pytest.Config) -> None:
    """Compile hpoflow's and the tests' modules once (``__pycache__``, as Python's imports would) before
    any test: where ``PYTHONDONTWRITEBYTECODE`` is set, every process a test starts (drivers, workers,
    ranks: hundreds) would otherwise compile them from source again. For the same reason pytest may
    keep the test modules it rewrote for its assertions (``__pycache__/*-pytest-*.pyc``): otherwise every
    pytest-xdist worker rewrites all of them again on every run (~7 CPU-s each here)."""
    sys.dont_write_bytecode = False  # this process only; read by pytest's rewriting hook at each import
    _preload_the_forkserver()
    if hasattr(config, "workerinput"):
        # torch run in a worker's own process (the tests' in-process models, checkpoints, oracle
        # measurements) on one thread: the workers outnumber the cores, and a second OpenMP thread only
        # spins waiting for work (a small training loop: 2.4 CPU-s on two threads, 1.1 on one, the same
        # wall). The processes a test starts keep their own counts (a trial's: its placement's).
        import torch

        torch.set_num_threads(1)
        return  # the controller (or a serial run) has done it
    import compileall

    for tree in ("hpoflow", "tests"):
        compileall.compile_dir(ROOT / tree, quiet=2, workers=1)


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto`` (the default in pyproject.toml): two workers per core this process may use, at least
    two and at most eight, or ``HPOFLOW_TEST_WORKERS``. Most of the suite's time is spent waiting on
    the processes a test starts (trials, daemons, SLURM; one busy core on average on a 2-core machine
    when run serially), so one worker per core would leave a core idle half the time."""
    raw = os.environ.get("HPOFLOW_TEST_WORKERS", "").strip()
    if raw:
        if not (raw.isascii() and raw.isdigit() and int(raw) >= 1):
            raise pytest.UsageError(f"HPOFLOW_TEST_WORKERS must be a whole number >= 1, not {raw!r}")
        return int(raw)
    return max(2, min(8, 2 * len(os.sched_getaffinity(0))))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups to name the work units
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test that uses a shared server (the SLURM cluster, PostgreSQL) joins that server's
    ``xdist_group``: under pytest-xdist one worker runs the group, on one server. Order: run serially, the
    fast tier first, so a broken change fails within the first minutes (``-m "not slow"`` runs only
    those); under pytest-xdist, where xdist hands out the groups first (the largest first), the slow
    tests come before the fast ones, so no long test starts last and holds up the end."""
    for item in items:
        group = _group(item)
        if group is not None and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(group))
    parallel = hasattr(config, "workerinput")  # a pytest-xdist worker (they collect; the controller does not)
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None) == parallel)


def _group(item: pytest.Item) -> str | None:
    """The xdist_group a test joins: a shared server's (``tests.infra.fixtures.GROUPS``), else that of
    the tests sharing a module- or session-scoped fixture with it (a study run once for a module, a
    calibration, a warm engine), so that fixture runs once and not once per worker."""
    from tests.infra.fixtures import GROUPS

    names = list(getattr(item, "fixturenames", ()))
    for name in names:
        if name in GROUPS:
            return GROUPS[name]
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    for name in names:
        fixture = defs.get(name, ())[-1:] or None
        if fixture is None or not fixture[0].baseid.startswith("tests"):
            continue  # pytest's own (tmp_path_factory...), or none
        if fixture[0].scope == "module":
            return f"module:{fixture[0].baseid}"
        if fixture[0].scope == "session":
            return f"session:{name}"
    if item.path.is_relative_to(ROOT / "tests" / "oracle") and item.path.name != "test_cli_calibrate.py":
        return ORACLE_GROUP  # (the oracle's commands, test_cli_calibrate.py, trace in processes of their own)
    return None
