"""hpoflow's indexed pruners (``hpoflow.search.pruners``) decide as Optuna's, without reading the study.

Two in-memory studies are fed the same learning curves (seeded: trials start, report and finish
interleaved, some values NaN, a few reports out of step order, some trials failed), one pruned by
Optuna's class and one by hpoflow's, fed as the driver feeds it (each told trial at once, and a
``Tally`` read now and then), or only by a tally's reads, or from a third into the study, or never;
every ``should_prune`` answer and every ``completed_rung_K`` attr must be the same. Then: a fed pruner
reads no trials, and the real driver feeds its pruner (the same run as with Optuna's class).
"""

from __future__ import annotations

import math
import random
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
from optuna.pruners import BasePruner, HyperbandPruner, MedianPruner, PercentilePruner, SuccessiveHalvingPruner
from optuna.study import StudyDirection
from optuna.trial import FrozenTrial, TrialState

from hpoflow.api import optimize
from hpoflow.engines.simulated.costs import TrialCost
from hpoflow.engines.simulated.engine import SimulatedEngine
from hpoflow.engines.simulated.options import SimulatedOptions
from hpoflow.registry import PRUNERS
from hpoflow.run.ledger import Tally
from hpoflow.search.pruners import (
    IndexedHyperbandPruner,
    IndexedMedianPruner,
    IndexedPercentilePruner,
    IndexedSuccessiveHalvingPruner,
    nanpercentile_sorted,
)
from hpoflow.trial import TrialRequest

optuna.logging.set_verbosity(optuna.logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # Optuna's nanmax of an all-NaN curve

Factory = Callable[[], BasePruner]


def test_the_percentile_of_sorted_values_is_numpys_to_the_bit() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        n = rng.randint(1, 12)
        pool = [rng.choice([0.0, -0.0, 1.0, 2.5, -3.0]) for _ in range(3)]
        values = [rng.choice(pool) if rng.random() < 0.3 else rng.uniform(-5, 5) for _ in range(n)]
        if rng.random() < 0.1:
            values.append(rng.choice([math.inf, -math.inf]))
        q = rng.choice([0.0, 25.0, 50.0, 75.0, 100.0, 100 - 33.3, rng.uniform(0, 100)])
        got = nanpercentile_sorted(sorted(values), q)
        want = float(np.nanpercentile(np.array(values, dtype=float), q))
        assert (math.isnan(got) and math.isnan(want)) or got == want, (values, q, got, want)
    assert math.isnan(nanpercentile_sorted([], 50.0))


def _curve(rng: random.Random, steps: int) -> tuple[list[int], list[float]]:
    """A trial's report steps (every one, every other, or with gaps; a few out of order) and values."""
    stride = rng.choice([1, 1, 1, 2, 3])
    at = list(range(rng.choice([0, 1]), steps, stride))
    if rng.random() < 0.05 and len(at) > 3:
        at[-1], at[-2] = at[-2], at[-1]  # one report out of step order
    level, slope = rng.gauss(0, 1), rng.uniform(0.0, 0.2)
    values = [level + slope * math.log1p(s) + rng.gauss(0, 0.2) for s in at]
    for i in range(len(values)):
        if rng.random() < 0.03:
            values[i] = math.nan
    if rng.random() < 0.02:
        values = [math.nan] * len(values)
    return at, values


class _Pair:
    """The two studies, fed alike. ``mode``: ``driver`` (fed from the start: each told trial at once, and a
    ``Tally`` read now and then), ``tally`` (only the reads of a tally, one before every prune call),
    ``late`` (unfed for the first third of the trials, then as ``driver`` from a tally's first read),
    ``unfed``."""

    def __init__(self, ref: BasePruner, mine: BasePruner, direction: str, mode: str) -> None:
        self.ref = optuna.create_study(study_name="pair", direction=StudyDirection[direction.upper()], pruner=ref)
        self.mine = optuna.create_study(study_name="pair", direction=StudyDirection[direction.upper()], pruner=mine)
        self.observe: Callable[[list[FrozenTrial], set[int]], None] = mine.observe  # type: ignore[attr-defined]
        self.mode = mode
        self.fed = mode in ("driver", "tally")
        self.tally = Tally()
        if self.fed:
            self.tally.watch(self.observe)
            self.observe([], set())  # the study is empty: the index starts from nothing
        self.decisions = {True: 0, False: 0}

    def start_feeding(self) -> None:
        """The late start: a tally's first read gives every trial so far."""
        self.tally.refresh(self.mine)
        self.tally.watch(self.observe)
        self.fed = True

    def tell(self, ta: optuna.Trial, tb: optuna.Trial, **kw: Any) -> None:
        self.ref.tell(ta, **kw)
        self.mine.tell(tb, **kw)
        if self.fed and self.mode != "tally":  # as the driver's _tell
            self.observe([self.mine._storage.get_trial(tb._trial_id)], set())

    def before_prune(self, rng: random.Random) -> None:
        if self.fed and (self.mode == "tally" or rng.random() < 0.05):
            self.tally.refresh(self.mine)

    def check_attrs(self) -> None:
        for a, b in zip(self.ref.get_trials(deepcopy=False), self.mine.get_trials(deepcopy=False), strict=True):
            assert a.system_attrs == b.system_attrs, a.number
            assert a.state == b.state


def _run(ref: BasePruner, mine: BasePruner, direction: str, seed: int, *, n_trials: int = 300, steps: int = 30,
         concurrency: int = 12, mode: str = "driver") -> _Pair:
    """Drive both studies through the same events; every prune decision compared."""
    rng = random.Random(seed)
    pair = _Pair(ref, mine, direction, mode)
    running: list[tuple[optuna.Trial, optuna.Trial, list[int], list[float]]] = []
    started = 0
    while started < n_trials or running:
        while started < n_trials and len(running) < concurrency and (not running or rng.random() < 0.5):
            ta, tb = pair.ref.ask(), pair.mine.ask()
            at, values = _curve(rng, steps)
            running.append((ta, tb, at, values))
            started += 1
            if mode == "late" and started == n_trials // 3:
                pair.start_feeding()
        i = rng.randrange(len(running))
        ta, tb, at, values = running[i]
        if not at:
            pair.tell(ta, tb, values=rng.random())
            running.pop(i)
            continue
        step, value = at.pop(0), values.pop(0)
        ta.report(value, step)
        tb.report(value, step)
        pair.before_prune(rng)
        decided = ta.should_prune()
        assert tb.should_prune() == decided, f"trial {ta.number} at step {step}"
        pair.decisions[decided] += 1
        if decided:
            pair.tell(ta, tb, state=TrialState.PRUNED)
            running.pop(i)
        elif not at:
            pair.tell(ta, tb, values=value if not math.isnan(value) else 0.0)
            running.pop(i)
        elif rng.random() < 0.02 and started > n_trials // 3:
            pair.tell(ta, tb, state=TrialState.FAIL)
            running.pop(i)
    pair.check_attrs()
    return pair


PERCENTILE: list[tuple[str, Factory, Factory]] = [
    ("median-default", MedianPruner, IndexedMedianPruner),
    ("median-warmup-interval", lambda: MedianPruner(10, 5, 3, n_min_trials=5),
     lambda: IndexedMedianPruner(10, 5, 3, n_min_trials=5)),
    ("median-no-startup", lambda: MedianPruner(0, 0, 1), lambda: IndexedMedianPruner(0, 0, 1)),
    ("percentile-25", lambda: PercentilePruner(25.0, 5, 3, 2, n_min_trials=3),
     lambda: IndexedPercentilePruner(25.0, 5, 3, 2, n_min_trials=3)),
    ("percentile-0", lambda: PercentilePruner(0.0, 1), lambda: IndexedPercentilePruner(0.0, 1)),
    ("percentile-100", lambda: PercentilePruner(100.0, 2, 1), lambda: IndexedPercentilePruner(100.0, 2, 1)),
    ("percentile-80", lambda: PercentilePruner(80.0, 3, 0, 4), lambda: IndexedPercentilePruner(80.0, 3, 0, 4)),
]
HALVING: list[tuple[str, Factory, Factory]] = [
    ("asha-auto", SuccessiveHalvingPruner, IndexedSuccessiveHalvingPruner),
    ("asha-1-2", lambda: SuccessiveHalvingPruner(1, 2), lambda: IndexedSuccessiveHalvingPruner(1, 2)),
    ("asha-2-3-rate1-boot2", lambda: SuccessiveHalvingPruner(2, 3, 1, 2),
     lambda: IndexedSuccessiveHalvingPruner(2, 3, 1, 2)),
    ("asha-1-4-boot5", lambda: SuccessiveHalvingPruner(1, 4, 0, 5), lambda: IndexedSuccessiveHalvingPruner(1, 4, 0, 5)),
    ("hyperband-auto", HyperbandPruner, IndexedHyperbandPruner),
    ("hyperband-1-27-boot2", lambda: HyperbandPruner(1, 27, 3, 2), lambda: IndexedHyperbandPruner(1, 27, 3, 2)),
    ("hyperband-2-40-eta2", lambda: HyperbandPruner(2, 40, 2), lambda: IndexedHyperbandPruner(2, 40, 2)),
    ("hyperband-1-30-eta4", lambda: HyperbandPruner(1, 30, 4), lambda: IndexedHyperbandPruner(1, 30, 4)),
]
CASES = PERCENTILE + HALVING


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
@pytest.mark.parametrize(("name", "ref", "mine"), [pytest.param(*case, id=case[0]) for case in CASES])
def test_every_decision_and_rung_attr_is_optunas(name: str, ref: Factory, mine: Factory, direction: str) -> None:
    pair = _run(ref(), mine(), direction, seed=zlib.crc32(f"{name}-{direction}".encode()))
    assert pair.decisions[True] > 10 and pair.decisions[False] > 100, pair.decisions


@pytest.mark.parametrize("direction", ["minimize", "maximize"])
def test_an_auto_min_resource_past_100_steps_is_optunas(direction: str) -> None:
    """``min_resource: auto`` is the longest COMPLETE trial's last step / 100: 2 with 250 steps."""
    pair = _run(SuccessiveHalvingPruner(), IndexedSuccessiveHalvingPruner(), direction, 3, n_trials=40, steps=250)
    mine = pair.mine.pruner
    assert isinstance(mine, IndexedSuccessiveHalvingPruner) and mine._min_resource == 2
    pair = _run(HyperbandPruner(), IndexedHyperbandPruner(), direction, 4, n_trials=40, steps=250)
    assert isinstance(pair.mine.pruner, IndexedHyperbandPruner) and pair.mine.pruner._max_resource == 250


@pytest.mark.parametrize("mode", ["tally", "late", "unfed"])
@pytest.mark.parametrize(("name", "ref", "mine"), [pytest.param(*case, id=case[0]) for case in CASES[::2]])
def test_fed_by_reads_only_fed_late_or_never_fed_it_decides_as_optuna(name: str, ref: Factory, mine: Factory,
                                                                      mode: str) -> None:
    """Fed only at a tally's reads (how a driver sees other drivers' trials: here one read before each
    prune call, so nothing is stale), fed from a tally's first read a third into the study, or never
    fed (Optuna's prune, its O(N) reads)."""
    _run(ref(), mine(), "minimize", zlib.crc32(f"{name}-{mode}".encode()), n_trials=150, mode=mode)


def test_the_brackets_are_optunas() -> None:
    study = optuna.create_study(study_name="brackets", pruner=IndexedHyperbandPruner(1, 81, 3))
    pruner = study.pruner
    assert isinstance(pruner, IndexedHyperbandPruner)
    pruner._try_initialization(study)
    pruner._indexed_study = study.study_name
    for number in range(2000):
        t = optuna.trial.create_trial(state=TrialState.RUNNING)
        t.number = number
        assert pruner._bracket_of(number) == pruner._get_bracket_id(study, t)


def test_observe_is_idempotent_and_leaves_interrupted_trials_out() -> None:
    study = optuna.create_study(pruner=IndexedMedianPruner(0, 0, 1))
    pruner = study.pruner
    assert isinstance(pruner, IndexedMedianPruner)
    for v in (1.0, 2.0, 3.0):
        t = study.ask()
        t.report(v, 0)
        study.tell(t, v)
    trials = study.get_trials(deepcopy=False)
    pruner.observe(trials, set())
    pruner.observe(trials, set())  # again: nothing changes
    column = pruner._index.columns[0]
    assert (pruner._index.n_complete, column.count, column.values) == (3, 3, [1.0, 2.0, 3.0])
    pruner.observe([], {1})  # trial 1 was interrupted and rerun: out, for good
    pruner.observe(trials, set())
    column = pruner._index.columns[0]
    assert (pruner._index.n_complete, column.count, column.values) == (2, 2, [1.0, 3.0])
    changed = optuna.trial.create_trial(value=5.0, intermediate_values={0: 5.0, 1: math.nan})
    changed.number = 2  # new content replaces the trial's part
    pruner.observe([changed], set())
    assert pruner._index.columns[0].values == [1.0, 5.0]
    assert (pruner._index.columns[1].count, pruner._index.columns[1].values) == (1, [])

    sh = IndexedSuccessiveHalvingPruner(1, 2)
    record = optuna.trial.create_trial(state=TrialState.RUNNING, system_attrs={"completed_rung_0": 0.5})
    record.number = 4
    sh.observe([record, record], set())
    assert list(sh._rungs.values(0, "completed_rung_0")) == [0.5]
    sh.observe([], {4})
    assert list(sh._rungs.values(0, "completed_rung_0")) == []


class _Reads:
    """Counts the storage's whole-study reads (every ``get_trials`` of a study ends there) while ``on``."""

    def __init__(self, study: optuna.Study) -> None:
        self.n = 0
        self.on = False
        read = study._storage.get_all_trials

        def counted(*args: Any, **kwargs: Any) -> list[FrozenTrial]:
            self.n += self.on
            return read(*args, **kwargs)

        study._storage.get_all_trials = counted  # type: ignore[method-assign]


@pytest.mark.parametrize(("name", "ref", "mine"), [pytest.param(*CASES[i], id=CASES[i][0]) for i in (0, 3, 8, 12)])
def test_a_fed_pruner_reads_no_trials(name: str, ref: Factory, mine: Factory) -> None:
    """Optuna's pruner reads the whole study at every call (or every rung); a fed one never does."""
    for factory, fed in ((ref, False), (mine, True)):
        study = optuna.create_study(pruner=factory())
        rng = random.Random(1)
        for _ in range(60):  # a history to compare with
            t = study.ask()
            for s in range(12):
                t.report(rng.random(), s)
            study.tell(t, rng.random())
        if fed:
            study.pruner.observe(study.get_trials(deepcopy=False), set())  # type: ignore[attr-defined]
        reads = _Reads(study)
        calls = 0
        for _ in range(20):
            t = study.ask()
            for s in range(12):
                t.report(rng.random(), s)
                reads.on = True
                t.should_prune()
                reads.on = False
                calls += 1
            study.tell(t, state=TrialState.PRUNED)
        if fed:
            assert reads.n == 0, f"{reads.n} reads of the study in {calls} prune calls"
        else:
            assert reads.n >= 20, f"{reads.n} reads in {calls} calls"  # what the test would see without the index


# -- the real driver, on the simulated engine --------------------------------------------------------------

EPOCHS = 12


def _cost(request: TrialRequest) -> TrialCost:
    """A curve per configuration, whose rank among the others changes over the epochs (the sine)."""
    x, y = float(request.params["x"]), float(request.params["y"])
    curve = [x * (e + 1) / EPOCHS + y * math.sin(e + 7 * x) * 0.2 for e in range(EPOCHS)]
    return TrialCost(5.0 * EPOCHS, {"val_accuracy": curve[-1]}, [{"val_accuracy": v} for v in curve])


def _spec(pruner: dict[str, Any], slots: int) -> dict[str, Any]:
    return {"study": {"name": "indexed", "metric": "val_accuracy", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}, "y": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 60, "max_concurrent": slots, "seed": 3, "pruner": pruner},
            "training": {"model": "mlp", "epochs": EPOCHS}, "oracle": {"enabled": False}}


@pytest.mark.parametrize(("ours", "theirs"), [
    ({"type": "median", "startup_trials": 5, "warmup_steps": 2},
     {"class": "optuna.pruners.MedianPruner", "options": {"n_startup_trials": 5, "n_warmup_steps": 2}}),
    ({"type": "asha", "min_resource": 1, "reduction_factor": 3},
     {"class": "optuna.pruners.SuccessiveHalvingPruner", "options": {"min_resource": 1, "reduction_factor": 3}}),
    ({"type": "hyperband", "min_resource": 1, "max_resource": EPOCHS, "reduction_factor": 3},
     {"class": "optuna.pruners.HyperbandPruner",
      "options": {"min_resource": 1, "max_resource": EPOCHS, "reduction_factor": 3}}),
], ids=["median", "asha", "hyperband"])
@pytest.mark.parametrize("slots", [1, 6])
def test_the_driver_feeds_its_pruner_and_the_run_is_optunas(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            ours: dict[str, Any], theirs: dict[str, Any],
                                                            slots: int) -> None:
    """The same study with hpoflow's pruner (by name) and with Optuna's (by class path): the same trials,
    pruned at the same steps, with the same rung attrs. One driver alone on the study feeds its pruner
    every change (its own results at once, rung values as written), so the index holds what Optuna would
    read, with one slot or several (the simulated engine's virtual clock gives both runs the same
    events); the fed pruner reads no trials."""
    assert PRUNERS.get(ours["type"]).__module__ == "hpoflow.search.pruners"
    inside = {"prune": False, "reads": 0}

    def counting(read: Callable[..., list[FrozenTrial]]) -> Callable[..., list[FrozenTrial]]:
        def counted(*args: Any, **kwargs: Any) -> list[FrozenTrial]:
            inside["reads"] += inside["prune"]
            return read(*args, **kwargs)
        return counted

    def pruning(prune: Callable[..., bool]) -> Callable[..., bool]:
        def judged(*args: Any, **kwargs: Any) -> bool:
            inside["prune"] = True
            try:
                return prune(*args, **kwargs)
            finally:
                inside["prune"] = False
        return judged

    monkeypatch.setattr(optuna.Study, "get_trials", counting(optuna.Study.get_trials))
    monkeypatch.setattr(optuna.Study, "_get_trials", counting(optuna.Study._get_trials))
    monkeypatch.setattr(optuna.trial.Trial, "should_prune", pruning(optuna.trial.Trial.should_prune))
    outcomes: list[list[tuple[Any, ...]]] = []
    reads: list[int] = []
    for pruner in (ours, theirs):
        inside["reads"] = 0
        engine = SimulatedEngine(SimulatedOptions.model_validate({"slots": slots, "lognormal": {}}), cost=_cost)
        res = optimize(_spec(pruner, slots), tmp_path / str(len(outcomes)), engine=engine, handle_signals=False)
        s = res.summary
        assert s.n_complete + s.n_pruned == 60 and s.n_pruned > 5 and s.n_complete > 0, s
        outcomes.append([(t.number, t.state, t.last_step, t.params,
                          {k: v for k, v in t.system_attrs.items() if k.startswith("completed_rung_")})
                         for t in res.study.trials])
        reads.append(inside["reads"])
    assert outcomes[0] == outcomes[1]
    assert reads[0] == 0 and reads[1] > 0, reads  # ours was fed (unfed, it reads as Optuna's)
