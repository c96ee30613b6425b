"""A study remembers its spec (``hpoflow.spec.study_fingerprint`` in the study system attr ``hpoflow_spec``):
a driver whose spec differs in what makes trials comparable is refused, in one line naming the keys, on
every storage; one that differs only in budgets, seeds or how defaults are spelled joins."""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml
from optuna.trial import TrialState

from hpoflow.errors import RunDirError
from hpoflow.run.open import ATTR_SPEC, check_study_spec
from hpoflow.spec import spec_from_mapping, study_fingerprint
from tests.conftest import ROOT, TINY
from tests.search.test_multi_driver import STORAGE_ENV, STORAGE_KINDS, load, storage_for

ENV = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}


def _nap_spec(name: str) -> dict[str, Any]:
    return {"study": {"name": name, "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 2, "seed": 1},
            "training": {"function": "trainfns_light:nap", "options": {"seconds": 0.05}},
            "storage_env": STORAGE_ENV}


def _run(tmp_path: Path, storage: str, data: dict[str, Any], name: str) -> subprocess.CompletedProcess[str]:
    """``hpoflow run`` of ``data`` in the run directory ``tmp_path/name``, on ``storage``."""
    spec = tmp_path / f"{name}.yaml"
    spec.write_text(yaml.safe_dump(data, sort_keys=False))
    return subprocess.run([sys.executable, "-m", "hpoflow", "run", str(spec), "--run-dir", str(tmp_path / name),
                           "--quiet"], env={**ENV, STORAGE_ENV: storage}, cwd=ROOT, capture_output=True, text=True,
                          timeout=240)


@pytest.mark.parametrize("kind", STORAGE_KINDS)
def test_a_driver_of_another_spec_is_refused_and_the_study_keeps_its_trials(tmp_path: Path,
                                                                           request: pytest.FixtureRequest,
                                                                           kind: str) -> None:
    """Spec B (minimize, a new parameter y; or x categorical) on spec A's study used to add its trials
    to A's (or die with Optuna's "Cannot set different distribution kind" traceback)."""
    storage = storage_for(kind, tmp_path, request)
    a = _nap_spec(f"spec-{uuid.uuid4().hex[:8]}")
    first = _run(tmp_path, storage, a, "a")
    assert first.returncode == 0, first.stderr
    b = copy.deepcopy(a)
    b["study"]["direction"] = "minimize"
    b["space"]["y"] = {"type": "int", "low": 0, "high": 3}
    c = copy.deepcopy(a)
    c["space"]["x"] = {"type": "categorical", "choices": [0.1, 0.9]}
    journal = Path(storage).read_bytes() if kind == "journal" else b""
    for data, name, keys in ((b, "b", ["study.direction", "space.y"]), (c, "c", ["space.x.type"])):
        r = _run(tmp_path, storage, data, name)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert "belongs to another spec" in line and all(k in line for k in keys), line
        assert "space.x.choices" not in line  # a parameter of another type differs at its type, said once
        assert not any((tmp_path / name / f).exists() for f in ("spec.yaml", "run.json", "trials"))
        if kind == "journal":  # refused before it writes anything: no record of its own (it appended a
            assert Path(storage).read_bytes() == journal  # create-study record that Optuna then refused)
    study = load(storage, a["study"]["name"], tmp_path)
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 2 and all(t.state == TrialState.COMPLETE and set(t.params) == {"x"} for t in trials)
    assert study.direction == optuna.study.StudyDirection.MAXIMIZE
    if kind != "journal":
        return  # (the comparison does not depend on the storage; drivers of one spec share every storage:
        # test_multi_driver.py)
    same = copy.deepcopy(a)  # what may differ between drivers: budgets, limits, the sampler's seed
    same["search"].update(n_trials=3, max_concurrent=2, seed=7, timeout=600, fail_fast=0, lease_s=30)
    joined = _run(tmp_path, storage, same, "same")
    assert joined.returncode == 0, joined.stderr
    assert len(load(storage, a["study"]["name"], tmp_path).get_trials(states=(TrialState.COMPLETE,))) == 3


def _spec(change: dict[str, Any] | None = None, *, training: dict[str, Any] | None = None) -> Any:
    """TINY (built-in trainer, model_options.hidden a searched categorical) with ``change`` merged into
    its sections, and ``training`` into its training section."""
    data = copy.deepcopy(TINY)
    for section, values in (change or {}).items():
        if isinstance(values, dict) and isinstance(data.get(section), dict):
            data[section].update(values)
        else:
            data[section] = values
    data["training"].update(training or {})
    return spec_from_mapping(data)


def _storage_with(spec: Any) -> tuple[optuna.storages.BaseStorage, int]:
    storage = optuna.storages.InMemoryStorage()
    study_id = storage.create_new_study([optuna.study.StudyDirection.MAXIMIZE], "tiny")
    check_study_spec(storage, study_id, spec, "memory", created=True)
    return storage, study_id


@pytest.mark.parametrize(("change", "training", "key"), [
    ({"study": {"direction": "minimize"}}, None, "study.direction"),
    ({"study": {"metric": "val_loss"}}, None, "study.metric"),
    ({"study": {"constraints": ["peak_memory_mb <= 8000"]}}, None, "study.constraints"),
    ({"space": {**TINY["space"], "lr": {"type": "float", "low": 0.003, "high": 0.1, "log": True}}}, None,
     "space.lr.high"),
    ({"space": {**TINY["space"], "hidden": {"type": "int", "low": 32, "high": 64}}}, None, "space.hidden.type"),
    ({"space": {**TINY["space"], "wd": {"type": "float", "low": 0.0, "high": 0.1}}}, None, "space.wd"),
    ({"search": {"scheduler": {"type": "asha", "reduction_factor": 2}}}, None, "search.scheduler.type"),
    (None, {"epochs": 3}, "training.epochs"),
    (None, {"model_options": {"hidden": "${hidden}", "dropout": 0.1}}, "training.model_options.dropout"),
    (None, {"checkpoint": {"every": 1, "format": "rank0"}}, "training.checkpoint"),
])
def test_a_difference_in_what_makes_trials_comparable_is_named_at_its_key(
        change: dict[str, Any] | None, training: dict[str, Any] | None, key: str) -> None:
    storage, study_id = _storage_with(_spec())
    with pytest.raises(RunDirError) as err:
        check_study_spec(storage, study_id, _spec(change, training=training), "memory", created=False)
    assert f"differ at {key}" in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_a_scheduler_option_is_named_flat_as_the_yaml_writes_it() -> None:
    asha = {"search": {"scheduler": {"type": "asha", "reduction_factor": 2}}}
    storage, study_id = _storage_with(_spec(asha))
    other = {"search": {"scheduler": {"type": "asha", "reduction_factor": 4}}}
    with pytest.raises(RunDirError, match=r"differ at search\.scheduler\.reduction_factor \(the study: 2, this "
                                          r"spec: 4\)"):
        check_study_spec(storage, study_id, _spec(other), "memory", created=False)


def test_budgets_seeds_and_defaults_written_out_are_not_differences() -> None:
    base = _spec()
    storage, study_id = _storage_with(base)
    others = [
        _spec({"search": {"algorithm": "tpe", "n_trials": 50, "max_concurrent": 4, "seed": 9, "timeout": 60.0,
                          "max_failures": 3, "fail_fast": 0, "lease_s": 10.0, "pruner": {"type": "median"}}}),
        _spec({"resources": {"processes": 1, "cpus_per_process": 2, "timeout": 30.0, "max_retries": 0},
               "storage_retry_s": 5.0, "oracle": {"enabled": False}}),
        # defaults spelled out, and a float written another way, are the same settings
        _spec(training={"optimizer": "adam", "val_fraction": 0.2, "strategy": "allreduce", "precision": "fp32",
                        "checkpoint": {"every": 0}}),
        _spec({"space": {"lr": {"type": "float", "low": 3e-3, "high": 0.03, "log": True, "step": None},
                         "hidden": {"type": "categorical", "choices": [32, 64]}}}),
    ]
    for spec in others:
        check_study_spec(storage, study_id, spec, "memory", created=False)
        assert study_fingerprint(spec) == study_fingerprint(base)
    assert storage.get_study_system_attrs(study_id)[ATTR_SPEC] == study_fingerprint(base)  # the first one's


def test_the_options_of_a_searched_strategy_are_compared_as_written() -> None:
    """With ``strategy: ${strategy}`` the validated strategy_options keep only the chosen strategy's: they
    are compared as written, so a difference in the options of a strategy the base values do not pick
    is seen too."""
    space = {**TINY["space"], "strategy": {"type": "categorical", "choices": ["allreduce", "easgd"]}}

    def spec(tau: int) -> Any:
        return _spec({"space": space}, training={"strategy": "${strategy}", "optimizer": "sgd",
                                                 "strategy_options": {"allreduce": {}, "easgd": {"tau": tau}}})

    assert study_fingerprint(spec(2))["training"]["strategy_options"] == {"allreduce": {}, "easgd": {"tau": 2}}
    storage, study_id = _storage_with(spec(2))
    with pytest.raises(RunDirError, match=r"differ at training\.strategy_options\.easgd\.tau \(the study: 2, "
                                          r"this spec: 8\)"):
        check_study_spec(storage, study_id, spec(8), "memory", created=False)


def test_a_study_from_before_fingerprints_is_joined_and_remembers_the_first_spec(tmp_path: Path) -> None:
    """A study with trials and no ``hpoflow_spec`` (created by an older hpoflow): the first driver joins
    and records its spec; a driver of another spec is refused after it."""
    storage = optuna.storages.InMemoryStorage()
    old = optuna.create_study(storage=storage, study_name="tiny", direction="maximize")
    old.tell(old.ask({"lr": optuna.distributions.FloatDistribution(0.003, 0.03, log=True)}), 0.5)
    check_study_spec(storage, old._study_id, _spec(), "memory", created=False)
    assert storage.get_study_system_attrs(old._study_id)[ATTR_SPEC] == study_fingerprint(_spec())
    with pytest.raises(RunDirError, match=r"differ at study\.direction"):
        check_study_spec(storage, old._study_id, _spec({"study": {"direction": "minimize"}}), "memory",
                         created=False)


def test_a_run_stopped_before_its_spec_yaml_resumes_and_its_study_still_refuses_another_spec(
        tmp_path: Path) -> None:
    """spec.yaml is written after the study is opened and checked: a run stopped in between leaves its
    journal alone in the run directory, and rerunning it resumes (the study's recorded spec guards it)."""
    from hpoflow.api import optimize
    from hpoflow.engines.threads import ThreadEngine

    data = _nap_spec("early")
    del data["storage_env"]
    data["search"]["n_trials"] = 3
    rd = tmp_path / "run"
    first = optimize(data, rd, n_trials=2, engine=ThreadEngine(lambda p, r: p["x"], 1))
    assert first.summary.n_complete == 2
    for p in rd.iterdir():  # as if stopped right after opening the journal: the journal and the lock left
        if p.name not in ("study.journal", ".hpoflow.lock"):
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    other = copy.deepcopy(data)
    other["study"]["direction"] = "minimize"
    with pytest.raises(RunDirError, match=r"belongs to another spec: they differ at study\.direction"):
        optimize(other, rd, engine=ThreadEngine(lambda p, r: p["x"], 1))
    assert not (rd / "spec.yaml").exists()
    again = optimize(data, rd, engine=ThreadEngine(lambda p, r: p["x"], 1))
    assert again.summary.n_complete == 3 and len(again.summary.results) == 1  # the first two count
