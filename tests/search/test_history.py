"""What the model-based samplers read (``hpoflow.search.history``, ``hpoflow.search.models``) and TPE's
vectorized ``log_ndtr`` (``hpoflow.search.fast_tpe``)."""

from __future__ import annotations

import random
import statistics
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import optuna
import pytest
from optuna.distributions import BaseDistribution, FloatDistribution, IntDistribution
from optuna.trial import FrozenTrial, TrialState, create_trial

from hpoflow.run.ledger import ATTR_PAUSED
from hpoflow.run.storage import open_storage
from hpoflow.search import fast_tpe
from hpoflow.search.bohb import BOHBSampler
from hpoflow.search.history import History, ViewedSampler, search_space_view
from hpoflow.search.models import gp, tpe
from hpoflow.search.samplers import PausedAsPruned, make_sampler
from hpoflow.spec import StudySpec

SPACE = {"x": FloatDistribution(0.0, 1.0), "lr": FloatDistribution(1e-4, 1e-1, log=True),
         "units": IntDistribution(16, 512, log=True), "layers": IntDistribution(1, 5)}


def _params(rnd: random.Random) -> dict[str, float | int]:
    return {"x": rnd.random(), "lr": 10 ** rnd.uniform(-4, -1), "units": rnd.randint(16, 512),
            "layers": rnd.randint(1, 5)}


def _objective(p: dict[str, float | int]) -> float:
    return -(float(p["x"]) - 0.3) ** 2 - 0.01 * abs(int(p["layers"]) - 3)


def _study(n: int, seed: int = 0, storage: optuna.storages.BaseStorage | None = None) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    rnd = random.Random(seed)
    study = optuna.create_study(direction="maximize", storage=storage)
    for _ in range(n):
        p = _params(rnd)
        study.add_trial(create_trial(params=p, distributions=SPACE, value=_objective(p)))
    return study


def test_scipys_log_ndtr_gives_optunas_values() -> None:
    from optuna.samplers._tpe import _truncnorm

    assert fast_tpe.install() and fast_tpe.installed()
    a = np.concatenate([np.linspace(-60.0, 40.0, 4001), [-1e6, -40.5, -20.0, -19.99, 0.0, 6.0, 6.001, 1e6]])
    ours = _truncnorm._log_ndtr(a)
    theirs = fast_tpe._state["original"](a)
    assert ours.shape == a.shape
    np.testing.assert_allclose(ours, theirs, rtol=1e-7, atol=1e-300)


def _storage(kind: str, tmp_path: Path) -> optuna.storages.BaseStorage | None:
    """Optuna's in-memory storage (None), or hpoflow's journal (which tells a reader what changed since its last
    read: ``hpoflow.run.feed``)."""
    return open_storage(None, tmp_path) if kind == "journal" else None


@pytest.mark.parametrize("kind", ["memory", "journal"])
@pytest.mark.parametrize("liar", [False, True])
def test_below_the_cap_tpe_proposes_what_optunas_tpe_proposes(liar: bool, kind: str, tmp_path: Path) -> None:
    """The bounded history is the whole study until it holds more than ``max_history`` finished trials: same
    seed, same proposals as Optuna's own TPESampler, one at a time and with trials running (constant liar)."""
    ours = optuna.create_study(direction="maximize", sampler=tpe(seed=3, constant_liar=liar, max_history=100),
                               storage=_storage(kind, tmp_path))
    theirs = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(
        seed=3, constant_liar=liar, multivariate=True))
    running: list[tuple[optuna.trial.Trial, optuna.trial.Trial]] = []
    for i in range(40):
        a, b = ours.ask(SPACE), theirs.ask(SPACE)
        assert a.params == b.params, i
        running.append((a, b))
        if not liar or i % 3 == 2:  # with the liar: three in flight, the oldest finishes
            a, b = running.pop(0)
            ours.tell(a, _objective(a.params))
            theirs.tell(b, _objective(b.params))


def test_above_the_cap_the_model_reads_the_best_and_a_uniform_sample_of_the_rest() -> None:
    study = _study(3000)
    history = History(cap=200, keep_top=25, seed=1)
    read = history.trials(study)
    assert 175 <= len(read) <= 200  # (a best trial may be in the sample too)
    best = sorted(study.trials, key=lambda t: -float(t.value or 0))[:25]
    assert {t.number for t in best} <= {t.number for t in read}
    rest = [t.number for t in read if t.number not in {b.number for b in best}]
    # a uniform sample of 0..2999: its mean is 1500 +/- 3 standard errors (866/sqrt(175) = 65)
    assert abs(statistics.mean(rest) - 1500) < 3 * 866 / len(rest) ** 0.5
    assert [t.number for t in read] == sorted(t.number for t in read)
    assert [t.number for t in History(cap=200, keep_top=25, seed=1).trials(study)] == [t.number for t in read]


def test_running_trials_are_read_in_the_proportion_of_the_finished_ones() -> None:
    study = _study(2000)
    study.sampler = optuna.samplers.RandomSampler(seed=0)
    for _ in range(2000):
        study.ask(SPACE)
    read = History(cap=400, keep_top=25, seed=0).trials(study)
    running = sum(t.state == TrialState.RUNNING for t in read)
    # 375 of 4,000 trials besides the best: half of them running, +/- 4 binomial standard deviations
    assert abs(len(read) - 400) <= 4 * (375 * 0.5) ** 0.5 + 1
    assert abs(running - 187.5) <= 4 * (375 * 0.25) ** 0.5


@pytest.mark.parametrize("kind", ["memory", "journal"])
def test_an_ask_reads_only_the_trials_that_are_new_or_changed(kind: str, tmp_path: Path) -> None:
    """A finished trial's form is computed once; a running one's again when it reported since, a paused one's
    when its record changed (promoted)."""
    seen: list[int] = []

    def shown(t: FrozenTrial) -> FrozenTrial:
        seen.append(t.number)
        return t

    study = _study(1000, storage=_storage(kind, tmp_path))
    paused = study.ask(SPACE)
    paused.report(0.5, 2)
    study._storage.set_trial_user_attr(paused._trial_id, ATTR_PAUSED, 2)
    running = study.ask(SPACE)
    history = History(shown, cap=300, seed=0)
    history.trials(study)
    assert len(seen) == 1002
    seen.clear()
    history.trials(study)
    assert seen == []  # nothing changed
    running.report(0.3, 1)
    history.trials(study)
    assert seen == [running.number]  # it reported
    study._storage.set_trial_user_attr(paused._trial_id, ATTR_PAUSED, None)  # promoted
    seen.clear()
    history.trials(study)
    assert seen == [paused.number]
    study.tell(running, 0.1)
    seen.clear()
    history.trials(study)
    assert seen == [running.number]  # finished now: read once more, then never
    seen.clear()
    history.trials(study)
    assert seen == []


def test_tpe_is_fitted_per_budget_where_trials_stop_early_unless_told_not_to() -> None:
    def search(extra: Mapping[str, object]) -> StudySpec:
        return StudySpec.model_validate({
            "study": {"name": "h", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "tpe", "n_trials": 4, "seed": 0, **extra},
            "training": {"model": "mlp", "epochs": 9}})

    plain = make_sampler(search({}).search)
    assert isinstance(plain, ViewedSampler) and isinstance(plain.inner, optuna.samplers.TPESampler)
    for extra in ({"pruner": {"type": "asha"}}, {"pruner": {"type": "median"}}, {"scheduler": {"type": "asha"}}):
        s = make_sampler(search(extra).search)
        assert isinstance(s, BOHBSampler) and s._random_fraction == 0.0 and s._min_evaluations == 10, extra
    off = make_sampler(search({"pruner": {"type": "asha"}, "sampler_options": {"per_budget": False}}).search)
    assert isinstance(off, ViewedSampler) and isinstance(off.inner, optuna.samplers.TPESampler)
    paused = make_sampler(search({"scheduler": {"type": "asha"}, "sampler_options": {"per_budget": False}}).search)
    assert isinstance(paused, PausedAsPruned) and paused.history.cap == 300
    unbounded = make_sampler(search({"sampler_options": {"max_history": None}}).search)
    assert isinstance(unbounded, ViewedSampler) and unbounded.history.cap is None


def test_gp_is_fitted_per_budget_where_trials_stop_early_unless_told_not_to() -> None:
    """``search.algorithm: gp`` with a pruner or a promotion scheduler is BOHB's rule with the GP as its model
    (Thompson sampling by default, Optuna's GPSampler with ``acquisition: ei``); alone, or with
    ``per_budget: false``, the GP read through the bounded history."""
    from hpoflow.search.gp_parallel import ThompsonGPSampler

    def search(extra: Mapping[str, object], at_once: int = 1) -> StudySpec:
        return StudySpec.model_validate({
            "study": {"name": "h", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "gp", "n_trials": 4, "seed": 0, "max_concurrent": at_once, **extra},
            "training": {"model": "mlp", "epochs": 9}})

    plain = make_sampler(search({}).search)
    assert isinstance(plain, ViewedSampler) and isinstance(plain.inner, optuna.samplers.GPSampler)
    for extra in ({"pruner": {"type": "hyperband"}}, {"scheduler": {"type": "asha"}}):
        s = make_sampler(search(extra).search)
        assert isinstance(s, BOHBSampler) and isinstance(s._model, ThompsonGPSampler), extra
        assert s._random_fraction == 0.0 and s._min_evaluations == 10 and s._keep_top == 125
    many = make_sampler(search({"pruner": {"type": "asha"}}, at_once=64).search)
    assert isinstance(many, BOHBSampler) and isinstance(many._model, ThompsonGPSampler)
    ei = make_sampler(search({"pruner": {"type": "asha"}, "sampler_options": {"acquisition": "ei"}}).search)
    assert isinstance(ei, BOHBSampler) and isinstance(ei._model, optuna.samplers.GPSampler)
    off = make_sampler(search({"pruner": {"type": "asha"}, "sampler_options": {"per_budget": False}}).search)
    assert isinstance(off, ViewedSampler) and isinstance(off.inner, optuna.samplers.GPSampler)


def test_a_gp_per_budget_proposes_from_the_reports_at_the_largest_budget_with_enough() -> None:
    """Trials stopped at step 3 with their best near x = 0.7, none run longer: the GP per budget, fitted on the
    step-3 reports, proposes near 0.7 (Optuna's GPSampler alone reads no completed trial and samples at random)."""
    study = optuna.create_study(direction="maximize", sampler=gp(seed=0, per_budget=True, n_startup_trials=10))
    dist: dict[str, BaseDistribution] = {"x": FloatDistribution(0.0, 1.0)}
    rnd = random.Random(0)
    for _ in range(30):
        x = rnd.random()
        study.add_trial(create_trial(params={"x": x}, distributions=dist, state=TrialState.PRUNED,
                                     intermediate_values={1: 0.0, 3: -(x - 0.7) ** 2}))
    xs = [study.ask(dist).params["x"] for _ in range(5)]
    assert all(abs(x - 0.7) < 0.15 for x in xs), xs


def test_a_study_far_above_the_cap_still_finds_the_good_region() -> None:
    """The model over 200 of 3,000 trials (the best 25 and a sample) proposes near the optimum (x = 0.3)."""
    study = _study(3000, seed=2)
    study.sampler = tpe(seed=0, max_history=200)
    xs = []
    for _ in range(20):
        t = study.ask(SPACE)
        xs.append(float(t.params["x"]))
        study.tell(t, _objective(t.params))
    assert statistics.median(abs(x - 0.3) for x in xs) < 0.1  # random: 0.25


def test_the_search_space_is_inferred_from_the_finished_trials_once_the_history_is_capped() -> None:
    """Optuna's intersection search space reads back to the first unfinished trial at every ask: above the cap
    its view holds the finished trials only (below it, the view itself)."""
    small = _study(50)
    small.sampler = optuna.samplers.RandomSampler(seed=0)
    for _ in range(20):
        small.ask(SPACE)
    view = History(cap=300, seed=0).view(small)
    assert [t.number for t in search_space_view(view).get_trials()] == [t.number for t in view.get_trials()]
    assert len(view.get_trials()) == 70
    big = _study(1000)
    big.sampler = optuna.samplers.RandomSampler(seed=0)
    for _ in range(300):
        big.ask(SPACE)
    view = History(cap=300, seed=0).view(big)
    shown = view.get_trials()
    assert any(t.state == TrialState.RUNNING for t in shown)
    assert [t.number for t in search_space_view(view).get_trials()] == [t.number for t in shown
                                                                         if t.state.is_finished()]
