"""Plug-ins: an engine registered from outside the package runs a whole study; every option bag is
validated through its registry when the spec loads; the oracle prices the trial's own strategy."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import Field

import hpoflow
from hpoflow.engines.base import Engine, Event
from hpoflow.errors import SpecError
from hpoflow.registry import ENGINES, SAMPLERS, Options
from hpoflow.spec import load_spec
from hpoflow.trial import TrialRequest, TrialResult

ROOT = Path(__file__).resolve().parents[1]


# -- a tiny engine, written and registered here, outside the package --------------------------------
class QuadraticOptions(Options):
    slots: int = Field(default=1, ge=1)
    offset: float = 0.0


class QuadraticEngine(Engine):
    """Scores a trial as -(lr - 0.01)^2 + offset at once, in the driver's thread."""

    name = "quadratic"

    def __init__(self, options: QuadraticOptions) -> None:
        self.options = options
        self._done: list[Event] = []
        self._running: set[int] = set()
        self.seen: list[TrialRequest] = []

    @classmethod
    def from_options(cls, options: QuadraticOptions, run_dir: Path | None = None) -> QuadraticEngine:
        return cls(options)

    def capacity(self, request: TrialRequest) -> int:
        return self.options.slots

    def submit(self, request: TrialRequest) -> None:
        self.seen.append(request)
        self._running.add(request.number)
        value = -((float(request.params["lr"]) - 0.01) ** 2) + self.options.offset
        self._done.append(TrialResult(request.number, "complete", value=value, metrics={request.metric: value}))

    def poll(self, timeout: float | None) -> list[Event]:
        out, self._done = self._done, []
        for ev in out:
            self._running.discard(ev.number)
        return out

    def answer(self, number: int, prune: bool, pause: bool = False) -> None:
        pass

    def cancel(self, number: int, reason: str) -> None:
        pass

    def running(self) -> list[int]:
        return sorted(self._running)

    def close(self) -> None:
        pass


@pytest.fixture
def quadratic() -> Iterator[None]:
    ENGINES.register("quadratic", QuadraticEngine, QuadraticOptions)
    try:
        yield
    finally:
        ENGINES.unregister("quadratic")


def _spec(tmp_path: Path, **extra: Any) -> Path:
    data = {
        "study": {"name": "plug", "metric": "score", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 1e-4, "high": 0.1, "log": True}},
        "search": {"algorithm": "tpe", "n_trials": 12, "max_concurrent": 2, "seed": 3},
        "training": {"function": "trainfns:behave"},
        **extra,
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_an_engine_registered_from_outside_runs_a_whole_study(tmp_path: Path, quadratic: None) -> None:
    spec = _spec(tmp_path, engine="quadratic", engine_options={"slots": 2, "offset": 1.0})
    result = hpoflow.optimize(spec, tmp_path / "run", progress=False)
    assert result.summary.n_complete == 12
    assert result.best_value is not None and 0.99 < result.best_value <= 1.0
    assert result.best_params is not None
    assert math.isclose(result.best_value, -((result.best_params["lr"] - 0.01) ** 2) + 1.0)


def test_an_outside_engines_options_are_checked_at_load_time(tmp_path: Path, quadratic: None) -> None:
    with pytest.raises(SpecError, match=r"engine_options.slots: must be >= 1, but got 0 \(engine 'quadratic'\)"):
        load_spec(_spec(tmp_path, engine="quadratic", engine_options={"slots": 0}))
    with pytest.raises(SpecError, match=r"engine_options.slot: unknown option of engine 'quadratic' "
                                        r"\(did you mean 'slots'\?\)"):
        load_spec(_spec(tmp_path, engine="quadratic", engine_options={"slot": 2}))


def test_an_unknown_engine_lists_the_registered_ones(tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="unknown engine 'locale' \\(did you mean 'local'\\?\\); valid engines: "
                                        "compss, local"):
        load_spec(_spec(tmp_path, engine="locale"))


@pytest.mark.parametrize(("extra", "where", "words"), [
    ({"search": {"algorithm": "tpe", "n_trials": 2, "sampler_options": {"n_startup": 3}}},
     "search.sampler_options.n_startup", "did you mean 'n_startup_trials'"),
    ({"search": {"algorithm": "cmaes", "n_trials": 2, "sampler_options": {"sigma0": -1}}},
     "search.sampler_options.sigma0", "must be > 0"),
    ({"search": {"algorithm": "tpe", "n_trials": 2, "pruner": {"type": "asha", "percentile": 10}}},
     "search.pruner.percentile", "unknown option of pruner 'asha'"),
    ({"search": {"algorithm": "tpe", "n_trials": 2, "pruner": {"type": "mediam"}}},
     "search.pruner.type", "did you mean 'median'"),
    ({"training": {"model": "cnn", "model_options": {"chanels": 8}}},
     "training.model_options.chanels", "did you mean 'channels'"),
    ({"training": {"strategy": "easgd", "strategy_options": {"tau": 0}}},
     "training.strategy_options.tau", "must be >= 1"),
    ({"compss": {"launcher": "pdsh"}}, "compss.launcher", "must be one of mpirun, srun, ssh"),
])
def test_every_option_bag_is_validated_when_the_spec_loads(tmp_path: Path, extra: dict[str, Any], where: str,
                                                          words: str) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(_spec(tmp_path, **extra))
    issue = info.value.issues[0]
    assert issue.path == where and words in issue.message, str(issue)
    assert issue.line is not None


def test_every_example_spec_validates_with_its_options_normalised() -> None:
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        spec, _ = load_spec(path)
        model = SAMPLERS.options_model(spec.search.algorithm)
        assert set(spec.search.sampler_options) == set(model.model_fields), path


@pytest.mark.parametrize(("strategy", "options", "priced_as"), [
    ("allreduce", {}, ("allreduce", {"bucket_mb": 25.0, "grad_dtype": "fp32"})),
    ("allreduce", {"compression": "bf16", "bucket_cap_mb": 4}, ("allreduce", {"bucket_mb": 4.0, "grad_dtype": "bf16"})),
    ("parameter_server", {"servers": 2}, ("ps", {"servers": 2})),
    ("easgd", {"tau": 8}, ("easgd", {"period": 8})),
    ("local_sgd", {"period": 16}, ("easgd", {"period": 16})),
])
def test_the_oracle_prices_the_trials_own_strategy(strategy: str, options: dict[str, Any],
                                                   priced_as: tuple[str, dict[str, Any]]) -> None:
    from hpoflow.oracle.feasibility import check_trial, strategy_plan

    plan = strategy_plan(strategy, options)
    assert plan == {"strategy": priced_as[0], **priced_as[1]}
    train = {"model": "mlp", "dataset": "digits", "batch_size": 32, "epochs": 1, "strategy": strategy,
             "strategy_options": options}
    verdict = check_trial(train, processes=2, gpus_per_process=0, cluster=None)
    assert verdict.feasible and verdict.predicted["strategy"] == priced_as[0], verdict


def test_any_optuna_sampler_or_pruner_by_import_path(tmp_path: Path) -> None:
    from hpoflow.search.samplers import make_pruner, make_sampler

    spec, _ = load_spec(_spec(tmp_path, search={
        "algorithm": {"class": "optuna.samplers.QMCSampler", "options": {"qmc_type": "halton"}}, "n_trials": 4,
        "seed": 3, "pruner": {"class": "optuna.pruners.ThresholdPruner", "options": {"upper": 5.0}}}))
    sampler = make_sampler(spec.search)
    assert type(sampler).__name__ == "QMCSampler" and getattr(sampler, "_qmc_type", None) == "halton"
    assert type(make_pruner(spec.search.pruner)).__name__ == "ThresholdPruner"
    with pytest.raises(SpecError, match=r"search.sampler_options: got an unexpected keyword argument 'qmc'"):
        load_spec(_spec(tmp_path, search={"algorithm": {"class": "optuna.samplers.QMCSampler",
                                                        "options": {"qmc": "x"}}, "n_trials": 2}))
    with pytest.raises(SpecError, match=r"must be a subclass of optuna\.samplers\.BaseSampler"):
        load_spec(_spec(tmp_path, search={"algorithm": "collections.OrderedDict", "n_trials": 2}))
    with pytest.raises(SpecError, match=r"cannot import 'nopkg\.mod'"):
        load_spec(_spec(tmp_path, search={"algorithm": "nopkg.mod:Sampler", "n_trials": 2}))


# -- one throw-away plug-in of each kind (tests/plugin_kit.py), named by the spec's plugins: ----------
@pytest.fixture(autouse=True)
def _forget_the_kit(forget_plugin_kit: None) -> None:
    """The registries as they were before the test: the kit's registrations do not leak into others."""


def _kit_spec(tmp_path: Path, **extra: Any) -> Path:
    data: dict[str, Any] = {
        "study": {"name": "kit", "metric": "val_accuracy", "direction": "maximize"},
        "space": {"lr": {"type": "float", "low": 0.01, "high": 0.1, "log": True}},
        "search": {"algorithm": "kit_pinned", "n_trials": 2, "max_concurrent": 1, "seed": 0},
        "training": {"model": "kit_tiny", "dataset": "synthetic", "epochs": 1, "batch_size": 64, "lr": "${lr}",
                     "strategy": "kit_allreduce"},
        "plugins": ["tests.plugin_kit"],
        **extra,
    }
    path = tmp_path / "kit.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.slow
def test_a_registered_model_strategy_sampler_and_checkpoint_format_run_in_the_trials_processes(
        tmp_path: Path) -> None:
    """The trial processes import the plug-in module themselves: each of the two ranks of each trial
    builds the plug-in model and strategy and checkpoints in the plug-in format, and the plug-in sampler
    chose every configuration."""
    marker = tmp_path / "marks.txt"
    spec = _kit_spec(tmp_path, resources={"processes": 2})
    data = yaml.safe_load(spec.read_text())
    data["training"]["model_options"] = {"marker": str(marker)}
    data["training"]["strategy_options"] = {"marker": str(marker)}
    data["training"]["checkpoint"] = {"every": 1, "format": "kit_format", "options": {"marker": str(marker)}}
    spec.write_text(yaml.safe_dump(data))
    result = hpoflow.optimize(spec, tmp_path / "run")
    assert result.summary.n_complete == 2, result.summary.errors
    assert [t.params["lr"] for t in result.study.trials] == [0.01, 0.01]  # the pinned sampler's choice
    lines = marker.read_text().splitlines()
    for kind in ("model", "strategy", "checkpoint"):
        # rank=? is a model the oracle's service builds to trace it (the feasibility check before a trial)
        ranks = sorted(r for line in lines if line.startswith(kind) and (r := line.split("rank=")[1]) != "?")
        assert ranks == ["0", "0", "1", "1"], lines  # 2 trials x 2 ranks
    for trial in ("0", "1"):
        names = sorted(p.name for p in (tmp_path / "run" / "trials" / trial / "checkpoints").iterdir())
        assert names == ["kit-00000001-r0.pt", "kit-00000001-r1.pt"], names
    assert os.getpid() not in {int(line.split("pid=")[1].split()[0]) for line in lines}  # not the driver


def test_a_registered_cost_model_drives_the_simulated_engine(tmp_path: Path) -> None:
    spec = _kit_spec(tmp_path, engine="simulated", search={"algorithm": "random", "n_trials": 6, "seed": 1},
                     engine_options={"slots": 2, "cost": {"type": "kit_constant", "seconds": 7}})
    result = hpoflow.optimize(spec, tmp_path / "run")
    assert result.summary.n_complete == 6
    for t in result.study.trials:
        assert t.value == pytest.approx(t.params["lr"] * 100 + t.number)
        assert t.user_attrs["timings"]["duration_s"] == pytest.approx(7.0)


def test_a_registered_engine_runs_a_study_and_validate_asks_it_what_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from hpoflow.cli.main import main

    spec = _kit_spec(tmp_path, engine="kit_engine", engine_options={"slots": 2}, search={
        "algorithm": "kit_pinned", "n_trials": 3, "max_concurrent": 2})
    assert main(["validate", str(spec)]) == 0
    result = hpoflow.optimize(spec, tmp_path / "run")
    assert result.summary.n_complete == 3 and result.best_value == pytest.approx(0.01)
    too_big = _kit_spec(tmp_path, engine="kit_engine", resources={"processes": 2})
    assert main(["validate", str(too_big)]) == 2
    assert "the kit engine runs one process per trial, not 2. Fix: resources.processes: 1" in capsys.readouterr().err


def test_a_plugin_module_that_does_not_import_is_one_line_at_its_key(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_spec(_kit_spec(tmp_path, plugins=["tests.plugin_kit", "tests.no_such_kit"]))
    issue = info.value.issues[0]
    assert issue.path == "plugins.1" and issue.line is not None
    assert "cannot import plug-in module 'tests.no_such_kit': ModuleNotFoundError" in issue.message


def test_without_its_plugin_module_a_registered_name_is_unknown_with_the_choices(tmp_path: Path) -> None:
    from hpoflow.registry import MODELS

    spec = _kit_spec(tmp_path, plugins=[], search={"algorithm": "random", "n_trials": 2},
                     training={"model": "kit_tinyy", "dataset": "synthetic"})
    with pytest.raises(SpecError, match=r"unknown model 'kit_tinyy'.*valid models: .*cnn.*mlp"):
        load_spec(spec)
    assert "cnn" in MODELS and "mlp" in MODELS


@pytest.mark.parametrize("sampler", ["kit_pinned", "kit_single"])
def test_validate_knows_whether_a_registered_sampler_takes_several_objectives(
        tmp_path: Path, sampler: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The sampler is asked for a trial of this study at validate time: a user's sampler that raises for
    several objectives (as Optuna's CmaEsSampler does) is refused there, with the fix, and run refuses it
    before anything is written; one that takes them runs."""
    from hpoflow.cli.main import main
    from hpoflow.errors import HpoflowError

    spec = _kit_spec(tmp_path, study={"name": "kit", "metrics": [{"name": "val_accuracy", "direction": "maximize"},
                                                                 {"name": "steps", "direction": "minimize"}]},
                     search={"algorithm": sampler, "n_trials": 2}, engine="simulated",
                     training={"function": "tests.trainfns_light:costly"},
                     space={"x": {"type": "float", "low": 0.0, "high": 1.0}},
                     engine_options={"slots": 1, "function": "tests.trainfns_light:sim_cost_real_types"})
    code = main(["validate", str(spec)])
    if sampler == "kit_pinned":
        assert code == 0, capsys.readouterr().err
        assert hpoflow.optimize(spec, tmp_path / "run").summary.n_complete == 2
        return
    assert code == 2
    assert "search.algorithm: the sampler kit_single optimises one objective, but study.metrics has 2" in \
        capsys.readouterr().err
    with pytest.raises(HpoflowError, match="optimises one objective"):
        hpoflow.optimize(spec, tmp_path / "run")
    assert not (tmp_path / "run").exists()
