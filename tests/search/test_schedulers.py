"""Promotion-type ASHA and Hyperband (search.scheduler): pause at rungs, promote from checkpoints.

On the simulated engine (virtual clock, per-epoch curves): the rung bookkeeping in the storage, the
exact budget, and that a promoted trial resumes where it paused (no epoch trained twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import optuna
import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.engine import SimulatedEngine
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.errors import SpecError
from hpoflow.run.ledger import ATTR_PAUSED, ATTR_RUNGS, ATTR_SEGMENTS, count_finished
from hpoflow.search.options import AshaSchedulerOptions
from hpoflow.search.schedulers import PromotionScheduler, rungs_of
from hpoflow.spec import spec_from_mapping
from hpoflow.trial import TrialRequest

EPOCHS = 9
EPOCH_S = 10.0


def _cost(request: TrialRequest) -> TrialCost:
    """The final value is x; each epoch's is x * epoch / EPOCHS (the ranks never change)."""
    x = float(request.params["x"])
    curve = [{"val_accuracy": x * (e + 1) / EPOCHS} for e in range(EPOCHS)]
    return TrialCost(EPOCHS * EPOCH_S, {"val_accuracy": x}, curve)


def _spec(scheduler: dict[str, Any], n_trials: int = 12) -> dict[str, Any]:
    return {"study": {"name": "sched", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n_trials, "max_concurrent": 2, "seed": 3,
                       "scheduler": scheduler},
            "training": {"model": "mlp", "epochs": EPOCHS}, "oracle": {"enabled": False}}


def _engine() -> SimulatedEngine:
    return SimulatedEngine(SimulatedOptions.model_validate({"slots": 2, "lognormal": {}}), cost=_cost)


def test_rungs_of_a_bracket() -> None:
    assert rungs_of(1, 3, 9, 0) == [1, 3]
    assert rungs_of(1, 3, 27, 1) == [3, 9]
    assert rungs_of(2, 2, 16, 0) == [2, 4, 8]


def test_promotion_picks_the_top_of_the_highest_rung_first() -> None:
    """A paused trial is promoted once it is in the top 1/eta of its rung, the highest rung first."""
    study = optuna.create_study(direction="maximize")
    for n, (rungs, paused) in enumerate([({"1": 0.9}, 1), ({"1": 0.1}, 1), ({"1": 0.2}, 1),
                                         ({"1": 0.8, "3": 0.5}, 3), ({"1": 0.3, "3": 0.6}, 3),
                                         ({"1": 0.4, "3": 0.2}, 3)]):
        t = study.ask()
        t.set_user_attr(ATTR_RUNGS, rungs)
        t.set_user_attr(ATTR_PAUSED, paused)
        assert t.number == n
    sched = PromotionScheduler(AshaSchedulerOptions(), "maximize")
    trials = study.get_trials()
    best = sched.next_promotion(trials, busy=set())
    assert best is not None and best.number == 4  # rung 3 (3 values: the top 1 is 0.6) before rung 1
    second = sched.next_promotion(trials, busy={4})
    assert second is not None and second.number == 0  # rung 1 (6 values: top 2 are 0.9, 0.8)
    assert sched.next_promotion(trials, busy={4, 0}) is None  # trial 3 (0.8) is at rung 3, not paused at 1


def test_asha_pauses_promotes_and_resumes_without_training_an_epoch_twice(tmp_path: Path) -> None:
    eng = _engine()
    res = optimize(_spec({"type": "asha", "min_resource": 1, "reduction_factor": 3}, 27), tmp_path / "run",
                   engine=eng)
    study = res.study
    trials = study.get_trials()
    assert count_finished(study) == 27 and len(trials) == 27  # n_trials configurations, exactly
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in trials)
    promoted = [t for t in trials if t.user_attrs.get(ATTR_SEGMENTS) and t.state == TrialState.COMPLETE]
    assert promoted, "no trial paused and was later promoted to the end"
    # every trial's rung values are in the storage; a complete trial reached every rung
    for t in trials:
        rungs = t.user_attrs.get(ATTR_RUNGS) or {}
        assert rungs, t.number
        if t.state == TrialState.COMPLETE:
            assert sorted(map(int, rungs)) == [1, 3]
    # no epoch trained twice: the busy slot-seconds are the epochs each trial reached
    reached = sum(EPOCHS if t.state == TrialState.COMPLETE else max(map(int, t.user_attrs[ATTR_RUNGS]))
                  for t in trials)
    s = eng.stats()
    assert s["busy"] * 2 * s["makespan_s"] == pytest.approx(reached * EPOCH_S)
    # the best configurations go furthest: the best x completed
    best_x = max(trials, key=lambda t: t.params["x"])
    assert best_x.state == TrialState.COMPLETE
    # trials.csv says where each trial paused and which rungs it reached
    import csv

    rows = list(csv.DictReader((tmp_path / "run" / "trials.csv").open()))
    assert len(rows) == 27 and {"rungs", "pauses", "paused_at"} <= set(rows[0])
    for row in rows:
        t = trials[int(row["number"])]
        assert row["pauses"] == str(len(t.user_attrs.get(ATTR_SEGMENTS) or []))
        assert row["rungs"].split()[0].startswith("1:")


def test_hyperband_brackets_and_validation(tmp_path: Path) -> None:
    res = optimize(_spec({"type": "hyperband", "min_resource": 1, "reduction_factor": 3}), tmp_path / "run",
                   engine=_engine())
    trials = res.study.get_trials()
    assert count_finished(res.study) == 12
    # 9 epochs, eta 3: brackets 0 (rungs 1, 3), 1 (rung 3) and 2 (no rung: it trains to the end)
    assert {t.user_attrs.get("hpoflow_bracket") for t in trials} == {0, 1, None}
    assert {t.state for t in trials if t.number % 3 == 2} == {TrialState.COMPLETE}
    with pytest.raises(SpecError, match="pruner"):
        spec_from_mapping({**_spec({"type": "asha"}), "search": {**_spec({"type": "asha"})["search"],
                                                                 "pruner": {"type": "median"}}})
    with pytest.raises(SpecError, match="reduction_factor"):
        spec_from_mapping(_spec({"type": "asha", "reduction_factor": 1}))


def test_a_pause_answer_through_the_file_channel_asks_the_trial_to_pause(tmp_path: Path) -> None:
    """compss and slurm write ``{"prune": false, "pause": true}`` as the answer file: rank 0's context
    turns it into a pause request, which ``should_stop()`` then tells every rank."""
    from hpoflow.fileio import write_json_atomic
    from hpoflow.spec import TrainConfig
    from hpoflow.train.context import TrialContext
    from hpoflow.train.transport import FileChannel, TrialFiles

    files = TrialFiles(tmp_path, attempt=1)
    channel = FileChannel(files, answer_timeout_s=5)
    write_json_atomic(files.answer(0), {"prune": False, "pause": True})
    write_json_atomic(files.answer(1), {"prune": False})
    ctx = TrialContext(params={}, config=TrainConfig(), trial_number=0, trial_dir=tmp_path, pruning=True,
                      channel=channel)
    ctx.report(1, val_accuracy=0.5)
    assert ctx.should_stop() and ctx.pausing and not ctx._prune
    ctx2 = TrialContext(params={}, config=TrainConfig(), trial_number=0, trial_dir=tmp_path, pruning=True,
                       channel=channel)
    ctx2.report(2, val_accuracy=0.6)
    assert not ctx2.should_stop() and not channel.pause_asked


def test_the_sampler_reads_paused_trials_as_pruned() -> None:
    """With a scheduler, TPE sees a paused trial (RUNNING in the storage) as PRUNED with its rung
    reports, as it sees a trial a pruner stopped; other trials as they are."""
    from hpoflow.search.samplers import PausedAsPruned, _PausedView, make_sampler

    spec = spec_from_mapping(_spec({"type": "asha"}))
    sampler = make_sampler(spec.search)
    assert isinstance(sampler, PausedAsPruned) and isinstance(sampler.inner, optuna.samplers.RandomSampler)
    study = optuna.create_study(direction="maximize")
    paused, running = study.ask(), study.ask()
    paused.report(0.4, 1)
    paused.set_user_attr(ATTR_PAUSED, 1)
    view = _PausedView(study)
    states = {t.number: t.state for t in view._get_trials(deepcopy=False)}
    assert states == {paused.number: TrialState.PRUNED, running.number: TrialState.RUNNING}
    assert [t.intermediate_values for t in view.get_trials(states=(TrialState.PRUNED,))] == [{1: 0.4}]
    assert study.trials[paused.number].state == TrialState.RUNNING  # the storage is untouched
    off = spec_from_mapping({**_spec({"type": "none"})})
    assert not isinstance(make_sampler(off.search), PausedAsPruned)
