"""A rung of promotion ASHA and Hyperband is reached at the first report at or past it (``step >= rung``,
as Ray Tune's and Optuna's ASHA): ``PromotionScheduler.at_rung``, and a study of a program that reports
every second step, whose steps never equal a rung."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.run.ledger import ATTR_PAUSED, ATTR_RUNGS, ATTR_SEGMENTS
from hpoflow.search.options import AshaSchedulerOptions
from hpoflow.search.schedulers import PromotionScheduler


def _asha(**options: Any) -> PromotionScheduler:
    return PromotionScheduler(AshaSchedulerOptions(**options), "minimize")


def test_a_report_reaches_the_highest_rung_at_or_below_its_step_once() -> None:
    sched = _asha(min_resource=1, reduction_factor=3)  # 9 steps: rungs 1 and 3
    assert sched.rungs(0, 9) == [1, 3]
    assert sched.at_rung(0, {}, 0, 9) is None  # below every rung
    assert sched.at_rung(0, {}, 1, 9) == (0, 1)  # at a rung, as before
    assert sched.at_rung(0, {}, 2, 9) == (0, 1)  # past it: steps 2, 4, 6 reach rung 1 at 2...
    assert sched.at_rung(0, {ATTR_RUNGS: {"1": 0.5}}, 2, 9) is None  # ...once
    assert sched.at_rung(0, {ATTR_RUNGS: {"1": 0.5}}, 4, 9) == (0, 3)  # ...and rung 3 at 4
    assert sched.at_rung(0, {ATTR_RUNGS: {"1": 0.5, "3": 0.4}}, 8, 9) is None  # no rung at or past 9
    # a report past two rungs not reached reaches the highest only; the lower one is skipped for good
    assert sched.at_rung(0, {}, 5, 9) == (0, 3)
    assert sched.at_rung(0, {ATTR_RUNGS: {"3": 0.4}}, 6, 9) is None
    # a step counted in another unit than the rungs (HF's global_step, 500 a report) still meets them
    assert sched.at_rung(0, {}, 500, 9) == (0, 3)


def test_hyperband_brackets_reach_their_rungs_the_same_way() -> None:
    sched = PromotionScheduler(AshaSchedulerOptions(min_resource=1, reduction_factor=3), "minimize", hyperband=True)
    assert sched.n_brackets(9) == 3 and sched.rungs(1, 9) == [3]
    assert sched.at_rung(1, {}, 2, 9) is None  # trial 1: bracket 1, whose first rung is 3
    assert sched.at_rung(1, {}, 4, 9) == (1, 3)
    assert sched.at_rung(2, {}, 8, 9) is None  # bracket 2 has no rung below 9
    assert sched.at_rung(4, {"hpoflow_bracket": 0}, 2, 9) == (0, 1)  # the recorded bracket, not the number's


def test_a_rung_keeps_the_value_of_the_report_that_reached_it_and_promotion_ranks_by_rung() -> None:
    """``goes_on`` and ``next_promotion`` pool the trials by rung, whatever step each reached it at."""
    import optuna

    study = optuna.create_study()
    for rungs, paused in [({"3": 0.2}, 3), ({"3": 0.9}, 3), ({"3": 0.5}, 3)]:  # reached at steps 4, 3, 6
        t = study.ask()
        t.set_user_attr(ATTR_RUNGS, rungs)
        t.set_user_attr(ATTR_PAUSED, paused)
    sched = _asha(min_resource=3, reduction_factor=2)
    trials = study.get_trials()
    assert not sched.goes_on(trials, 3, 0, 3, 0.6)  # 4 values at rung 3: the top 2 are 0.2 and 0.5
    assert sched.goes_on(trials, 3, 0, 3, 0.1)
    best = sched.next_promotion(trials, busy=set())
    assert best is not None and best.number == 0  # top 1 of 3 at rung 3


# Reports every second step (2, 4, 6, ...), saving the step it reached to HPOFLOW_CHECKPOINT_DIR first and
# starting after the one it finds there; appends each step it trains to $HPOFLOW_TRIAL_DIR/trained.txt.
_PROGRAM = textwrap.dedent("""\
    import json, os, sys
    from pathlib import Path
    from hpoflow import client

    x, last = float(sys.argv[1]), int(sys.argv[2])
    ckpt = Path(os.environ["HPOFLOW_CHECKPOINT_DIR"]) / "every2.json"
    start = json.loads(ckpt.read_text())["step"] if ckpt.exists() else 0
    for step in range(start + 2, last + 1, 2):
        with open(Path(os.environ["HPOFLOW_TRIAL_DIR"]) / "trained.txt", "a") as f:
            f.write(f"{step}\\n")
        ckpt.parent.mkdir(parents=True, exist_ok=True)
        ckpt.with_suffix(".tmp").write_text(json.dumps({"step": step}))
        os.replace(ckpt.with_suffix(".tmp"), ckpt)
        client.report(step, val_loss=(x - 0.3) ** 2 + 1.0 / step)
        if client.should_stop():
            break
""")


@pytest.mark.slow
def test_promotion_asha_pauses_at_rungs_a_program_whose_steps_never_equal_them(tmp_path: Path) -> None:
    """Rungs 3 and 6 (``min_resource: 3``, ``reduction_factor: 2``, 8 steps); reports at 2, 4, 6, 8. One slot,
    two bad configurations first: the first reaches rung 3 at step 4 alone and pauses, the second joins
    the rung and pauses, the first is promoted and resumes after step 4 (its checkpoint), reaching rung 6 at
    step 6 and pausing; the good one is in the top half of both rungs, goes on and completes. (Were rungs
    met only at equal steps, no trial would ever reach rung 3.)"""
    prog = tmp_path / "every2.py"
    prog.write_text(_PROGRAM)
    xs = [1.0, 1.0, 0.3]
    data = {"study": {"name": "every2", "metric": "val_loss", "direction": "minimize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 3, "max_concurrent": 1, "seed": 1,
                       "enqueue": [{"x": x} for x in xs],
                       "scheduler": {"type": "asha", "min_resource": 3, "reduction_factor": 2, "anchor": "min"}},
            "training": {"command": ["python", str(prog), "${x}", "8"], "epochs": 8},
            "resources": {"processes": 1}}
    study = optimize(data, tmp_path / "run").study
    bad1, bad2, good = study.trials
    states = [(t.number, t.state, t.user_attrs.get(ATTR_RUNGS), t.user_attrs.get(ATTR_SEGMENTS)) for t in study.trials]
    assert good.state == TrialState.COMPLETE and good.user_attrs.get(ATTR_SEGMENTS) is None, states
    assert sorted(good.intermediate_values) == [2, 4, 6, 8]
    assert good.user_attrs[ATTR_RUNGS] == {"3": good.intermediate_values[4], "6": good.intermediate_values[6]}
    assert bad1.state == bad2.state == TrialState.PRUNED, states
    assert [(s["step"], s["reported"]) for s in bad1.user_attrs[ATTR_SEGMENTS]] == [(3, 4), (6, 6)], states
    assert bad1.user_attrs[ATTR_RUNGS] == {"3": bad1.intermediate_values[4], "6": bad1.intermediate_values[6]}
    assert bad1.user_attrs[ATTR_PAUSED] == 6
    assert [(s["step"], s["reported"]) for s in bad2.user_attrs[ATTR_SEGMENTS]] == [(3, 4)], states
    # the promoted trial's second run started after the step its first saved: no step trained twice
    trained = (tmp_path / "run" / "trials" / "0" / "trained.txt").read_text().split()
    assert trained == ["2", "4", "6"]


def test_rungs_follow_hyperbands_geometry_from_the_full_budget() -> None:
    """anchor max (the default): max_resource / eta**k, rounded, down to min_resource (Li et al.'s Hyperband,
    the YAHPO Gym paper's budgets 2, 6, 17 of 52); anchor min: the grace period and its multiples."""
    from hpoflow.search.schedulers import first_rung, rungs_of

    assert rungs_of(1, 3, 52, 0) == [2, 6, 17]
    assert [rungs_of(1, 3, 52, b) for b in range(4)] == [[2, 6, 17], [6, 17], [17], []]  # Hyperband's brackets
    assert rungs_of(1, 3, 52, 0, "min") == [1, 3, 9, 27]
    assert rungs_of(3, 2, 8, 0, "min") == [3, 6] and rungs_of(3, 2, 8, 0) == [4]
    assert rungs_of(5, 3, 52, 0) == [6, 17]  # none below min_resource
    assert rungs_of(1, 3, 1, 0) == [] and first_rung(1) == 1
    assert (first_rung(52), first_rung(15), first_rung(10), first_rung(100, 2)) == (2, 2, 1, 2)
    asha = PromotionScheduler(AshaSchedulerOptions(), "maximize")
    assert asha.rungs(0, 52) == [2, 6, 17] and asha.at_rung(0, {}, 1, 52) is None  # the first epoch is not judged


def test_the_pruners_auto_steps_are_the_first_rung_of_the_studys_epochs() -> None:
    """median/percentile warmup_steps and asha/hyperband min_resource default to auto: the first rung of
    the epochs (2 of 52), 0 or 1 when the epochs are unknown; a number given is kept."""
    from hpoflow.search.samplers import make_pruner
    from hpoflow.spec import PrunerSpec

    def built(pruner: dict[str, Any], epochs: Any) -> Any:
        return make_pruner(PrunerSpec.model_validate(pruner), epochs)

    assert built({"type": "median"}, 52)._n_warmup_steps == 2
    assert built({"type": "percentile"}, None)._n_warmup_steps == 0
    assert built({"type": "median", "warmup_steps": 0}, 52)._n_warmup_steps == 0
    assert built({"type": "asha"}, 52)._min_resource == 2
    assert built({"type": "asha"}, "${epochs}")._min_resource == 1  # a searched epoch count: unknown here
    assert built({"type": "asha", "min_resource": 4}, 52)._min_resource == 4
    assert built({"type": "hyperband"}, 52)._min_resource == 2
    assert built({"type": "hyperband"}, 52)._max_resource == 52  # the epochs: brackets from the first trial
    assert built({"type": "hyperband"}, "${epochs}")._max_resource == "auto"  # unknown: Optuna's, at a complete
    assert built({"type": "hyperband", "max_resource": 30}, 52)._max_resource == 30
    with pytest.raises(ValueError, match="min_resource must be >= 1 or auto"):
        PrunerSpec.model_validate({"type": "asha", "min_resource": 0}).options  # noqa: B018


def test_hyperband_prunes_before_any_trial_completes_when_the_epochs_are_known() -> None:
    """With ``max_resource`` from ``training.epochs``, Hyperband's brackets exist from the first trial: of 60
    trials running at once, none complete, the poor ones are pruned at their rungs. Optuna's ``auto``
    (epochs unknown) waits for a complete trial and prunes none of them."""
    import optuna

    from hpoflow.search.samplers import make_pruner
    from hpoflow.spec import PrunerSpec

    def pruned(epochs: Any) -> int:
        study = optuna.create_study(direction="maximize", study_name="hb",
                                    pruner=make_pruner(PrunerSpec.model_validate({"type": "hyperband"}), epochs))
        trials = [study.ask() for _ in range(60)]
        stopped: set[int] = set()
        for step in range(1, 20):  # every running trial reports each epoch, in turn (60 at once)
            for i, t in enumerate(trials):
                if i in stopped:
                    continue
                t.report(float(-i), step)  # trial i's value is -i: each trial is worse than those before it
                if t.should_prune():
                    stopped.add(i)
        assert 0 not in stopped  # the best of all
        return len(stopped)

    assert pruned(52) > 20
    assert pruned("${epochs}") == 0
