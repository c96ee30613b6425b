"""``search.algorithm: bohb`` (``hpoflow.search.bohb``): BOHB's model reads the evaluations at the largest
budget that has enough of them, as finished trials with that budget's value; the rest is random."""

from __future__ import annotations

import optuna
import pytest
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from hpoflow.run.ledger import ATTR_PAUSED
from hpoflow.search.bohb import BOHBSampler, _BudgetView
from hpoflow.spec import StudySpec

X = FloatDistribution(0.0, 1.0)


def _trial(x: float, curve: dict[int, float], state: TrialState = TrialState.PRUNED,
           paused: int | None = None) -> optuna.trial.FrozenTrial:
    return create_trial(params={"x": x}, distributions={"x": X}, intermediate_values=curve, state=state,
                        value=curve[max(curve)] if state == TrialState.COMPLETE else None,
                        user_attrs={ATTR_PAUSED: paused} if paused is not None else None)


def _study(trials: list[optuna.trial.FrozenTrial]) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(direction="maximize")
    study.add_trials(trials)
    return study


def test_the_model_reads_the_largest_budget_with_enough_evaluations_as_finished_trials() -> None:
    # 6 trials stopped at budget 2, 4 of them went on to budget 6, one finished at 9
    trials = [_trial(i / 10, {1: 0.1, 2: 0.2 + i / 100}) for i in range(2)]
    trials += [_trial(i / 10, {1: 0.1, 2: 0.2, 6: 0.5 + i / 100}) for i in range(2, 5)]
    trials += [_trial(0.9, {1: 0.1, 2: 0.2, 6: 0.6, 9: 0.8}, TrialState.COMPLETE)]
    study = _study(trials)
    sampler = BOHBSampler(seed=0, min_points_in_model=2, random_fraction=0.0)  # needs 2 + 2 at a budget
    fresh = study.ask()
    sampler.infer_relative_search_space(study, study._storage.get_trial(fresh._trial_id))
    assert sampler._budget[fresh.number] == 6  # 4 at budget 6, 6 at budget 2, 1 at budget 9
    view = _BudgetView(study, 6)
    seen = view.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    assert sorted(t.values[0] for t in seen) == [0.52, 0.53, 0.54, 0.6]  # the value at 6, not the last one
    # the trial being asked is RUNNING and stays visible (constant liar); a stopped one below 6 is not there
    assert [t.number for t in view.get_trials(states=(TrialState.RUNNING,))] == [fresh.number]
    assert len(view.get_trials()) == 5


def test_a_paused_trial_counts_at_the_budgets_it_reached_and_is_not_running() -> None:
    study = _study([_trial(0.1, {2: 0.3}, TrialState.RUNNING, paused=2),
                    _trial(0.2, {2: 0.4}, TrialState.RUNNING)])  # this one runs on past 2
    view = _BudgetView(study, 6)
    assert [t.number for t in view.get_trials()] == [1]  # running, no value at 6; the paused one is left out
    assert [t.values for t in _BudgetView(study, 2).get_trials()] == [[0.3], [0.4]]


def test_until_a_budget_has_enough_evaluations_configurations_are_random() -> None:
    study = _study([_trial(0.5, {2: 0.1}) for _ in range(3)])
    sampler = BOHBSampler(seed=1, random_fraction=0.0)  # 1 parameter: needs 1 + 1 + 2 = 4 at a budget
    fresh = study.ask()
    frozen = study._storage.get_trial(fresh._trial_id)
    assert sampler.infer_relative_search_space(study, frozen) == {}
    assert sampler._budget[fresh.number] is None


def test_the_model_proposes_near_the_good_region_at_its_budget_and_the_random_fraction_holds() -> None:
    # at budget 3, x near 0.8 is good; the final values (budget 9) of a few trials say nothing
    trials = [_trial(x, {3: -abs(x - 0.8)}) for x in [i / 40 for i in range(40)]]
    study = _study(trials)
    sampler = BOHBSampler(seed=3, random_fraction=0.0)
    study.sampler = sampler
    xs = []
    for _ in range(20):
        t = study.ask()
        xs.append(t.suggest_float("x", 0.0, 1.0))
        study.tell(t, state=TrialState.FAIL)
    assert sum(abs(x - 0.8) < 0.15 for x in xs) >= 15, xs  # random would put ~30 % there
    draws = sum(BOHBSampler(seed=s, random_fraction=0.5)._budget_for(study, _numbered(study, 100 + s)) is None
                for s in range(200))
    assert 70 <= draws <= 130, draws  # about half drawn at random (binomial(200, 0.5): 6 sigma is +/- 42)


def _numbered(study: optuna.Study, number: int) -> optuna.trial.FrozenTrial:
    t = create_trial(params={}, distributions={}, value=0.0)
    t.number = number
    return t


@pytest.mark.parametrize(("search", "pruner", "scheduler"), [
    ({"algorithm": "bohb"}, "asha", "none"),
    ({"algorithm": "bohb", "scheduler": {"type": "hyperband"}}, "none", "hyperband"),
    ({"algorithm": "bohb", "pruner": {"type": "asha"}}, "asha", "none"),
    ({"algorithm": "bohb", "pruner": {"type": "none"}}, "none", "none"),
])
def test_bohb_stops_with_asha_unless_the_study_names_its_pruner_or_scheduler(search: dict[str, object], pruner: str,
                                                                          scheduler: str) -> None:
    spec = StudySpec.model_validate({"study": {"name": "b", "metric": "acc", "direction": "maximize"},
                                     "space": {"x": {"type": "float", "low": 0, "high": 1}},
                                     "search": {**search, "n_trials": 4},
                                     "training": {"model": "mlp", "epochs": 9}})
    assert (spec.search.algorithm, spec.search.pruner.type, spec.search.scheduler.type) == ("bohb", pruner, scheduler)


def test_budget_counts_take_each_report_once_whatever_its_order() -> None:
    from hpoflow.search.bohb import _Budgets

    budgets = _Budgets()
    t = _trial(0.5, {6: 0.4}, TrialState.RUNNING)
    budgets.update([t])
    t.intermediate_values[2] = 0.3  # a lower step reported later (a resumed run's earlier rung, say)
    budgets.update([t])
    budgets.update([t])  # nothing new: nothing counted again
    assert dict(budgets.count) == {6.0: 1, 2.0: 1}
