"""The report's PBT panel (hpoflow.report._lineage, registered in hpoflow.report.html.PANELS): the
population's lineage and hyperparameter schedules, read from the ``hpoflow_lineage`` user attrs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import optuna
import pytest
from optuna.distributions import BaseDistribution, FloatDistribution

from hpoflow.report.html import PANELS, Panel, render
from hpoflow.run.ledger import ATTR_LINEAGE

pytest.importorskip("plotly")

# A population of 4 (trial numbers 0-11 in this order), three intervals of 2 epochs each. After interval
# 0 members 2 and 3 copy members 1 and 0; after interval 1 members 0 and 3 copy members 2 and 1.
# The best trial (8) descends from 6 and 1.
#        number: (member, interval, parent, donor, value, lr)
POPULATION = {0: (0, 0, None, None, 0.5, 1e-2), 1: (1, 0, None, None, 0.6, 1e-3),
              2: (2, 0, None, None, 0.2, 1e-1), 3: (3, 0, None, None, 0.3, 1e-4),
              4: (0, 1, 0, None, 0.65, 1e-2), 5: (1, 1, 1, None, 0.7, 1e-3),
              6: (2, 1, 1, 1, 0.75, 2e-3), 7: (3, 1, 0, 0, 0.62, 2e-2),
              8: (0, 2, 6, 6, 0.9, 4e-3), 9: (1, 2, 5, None, 0.78, 1e-3),
              10: (2, 2, 6, None, 0.85, 2e-3), 11: (3, 2, 5, 5, 0.8, 5e-4)}


def _study(direction: Literal["minimize", "maximize"] = "maximize", flip: bool = False) -> optuna.Study:
    study = optuna.create_study(direction=direction)
    dists: dict[str, BaseDistribution] = {"lr": FloatDistribution(1e-5, 1.0, log=True),
                                          "momentum": FloatDistribution(0.0, 1.0)}
    for member, interval, parent, donor, value, lr in POPULATION.values():
        lineage = {"member": member, "interval": interval, "parent": parent, "donor": donor,
                   "start": 2 * interval, "end": 2 * interval + 1, "seed": 100 + member}
        study.add_trial(optuna.trial.create_trial(
            value=-value if flip else value, params={"lr": lr, "momentum": 0.9}, distributions=dists,
            user_attrs={ATTR_LINEAGE: lineage}))
    return study


def _panel(study: optuna.Study) -> Panel | None:
    make = next(p for p in PANELS if p.__name__ == "_population")
    return make(study, {})


def _traces(panel: Panel, kind: str) -> list[Any]:
    return [t for t in panel.figure.data if (t.meta or {}).get("kind") == kind]


def test_the_lineage_draws_a_segment_per_interval_and_an_arrow_per_exploit() -> None:
    panel = _panel(_study())
    assert panel is not None and panel.figure is not None
    assert panel.title == "population: lineage and hyperparameter schedules"
    segments = {t.meta["trial"]: t for t in _traces(panel, "segment")}
    assert sorted(segments) == list(range(12))
    # trial 6: member 2's interval 1, epochs 2-3, drawn over [2, 4] (intervals of a member touch)
    assert list(segments[6].x) == [2, 3, 4] and set(segments[6].y) == {2}
    assert "trial 6 (member 2, interval 1): epochs 2-3, value 0.75" in segments[6].hovertext
    assert '"lr": 0.002' in segments[6].hovertext and "copied trial 1" in segments[6].hovertext
    # coloured by value: the worst and the best interval at the two ends of the colour scale
    assert segments[2].line.color == "rgb(68, 1, 84)" and segments[8].line.color == "rgb(253, 231, 37)"
    (arrows,) = _traces(panel, "exploits")
    assert arrows.meta["pairs"] == [[1, 6], [0, 7], [6, 8], [5, 11]]
    # from the donor's end (member, epoch 2 or 4) to where the copy starts
    assert list(arrows.x) == [2, 2, None, 2, 2, None, 4, 4, None, 4, 4, None]
    assert list(arrows.y) == [1, 2, None, 0, 3, None, 2, 0, None, 1, 3, None]
    assert "4 member(s), 12 interval(s), 4 exploit(s)" in panel.note


def test_the_best_trials_lineage_is_highlighted() -> None:
    panel = _panel(_study())
    assert panel is not None
    assert {t.meta["trial"] for t in _traces(panel, "segment") if t.meta["best"]} == {1, 6, 8}
    (best,) = _traces(panel, "best")
    assert best.meta["trials"] == [1, 6, 8]
    assert list(best.x) == [0, 2, 2, 4, 4, 6] and list(best.y) == [1, 1, 2, 2, 0, 0]
    assert "best trial 8's lineage (red): 1 (member 1) -> 6 (member 2) -> 8 (member 0)" in panel.note
    # minimising the same values negated picks the same trial and colours it the same
    flipped = _panel(_study("minimize", flip=True))
    assert flipped is not None
    (best,) = _traces(flipped, "best")
    assert best.meta["trials"] == [1, 6, 8]
    seg8 = next(t for t in _traces(flipped, "segment") if t.meta["trial"] == 8)
    assert seg8.line.color == "rgb(253, 231, 37)"


def test_the_schedules_show_each_explored_hyperparameter_per_member() -> None:
    panel = _panel(_study())
    assert panel is not None
    schedules = _traces(panel, "schedule")
    assert {t.meta["param"] for t in schedules} == {"lr"}  # momentum never changed: no schedule
    member2 = next(t for t in schedules if t.meta["member"] == 2)
    assert list(member2.x) == [0, 2, 4, 6] and list(member2.y) == [1e-1, 2e-3, 2e-3, 2e-3]
    assert member2.line.shape == "hv"
    (best,) = _traces(panel, "best schedule")
    assert list(best.x) == [0, 2, 4, 6] and list(best.y) == [1e-3, 2e-3, 4e-3, 4e-3]
    assert panel.figure.layout.yaxis2.type == "log"  # lr's distribution is log-scaled


def test_a_study_without_lineage_has_no_population_panel(tmp_path: Path) -> None:
    study = optuna.create_study()
    for number in range(3):
        study.add_trial(optuna.trial.create_trial(
            value=float(number), params={"x": number / 3}, distributions={"x": FloatDistribution(0.0, 1.0)},
            user_attrs={ATTR_LINEAGE: {"member": 0}}))  # malformed: not an interval trial
    assert _panel(study) is None
    _, panels = render(study, tmp_path, "spec: {}", "in-memory")
    assert not any(p.title.startswith("population") for p in panels)
    page, panels = render(_study(), tmp_path, "spec: {}", "in-memory")
    assert [p.title for p in panels].count("population: lineage and hyperparameter schedules") == 1
    assert "best trial 8&#x27;s lineage" in page


def test_an_interval_interrupted_and_rerun_is_drawn_once_as_its_rerun() -> None:
    """A driver killed mid-interval: its interval's trial is recorded interrupted and rerun as a new
    trial with the same lineage (``hpoflow_replaces`` names the first). The panel draws the rerun."""
    from hpoflow.run.ledger import ATTR_REPLACES

    study = _study()
    dists: dict[str, BaseDistribution] = {"lr": FloatDistribution(1e-5, 1.0, log=True),
                                          "momentum": FloatDistribution(0.0, 1.0)}
    member, interval, parent, donor, value, lr = POPULATION[9]
    lineage = {"member": member, "interval": interval, "parent": parent, "donor": donor,
               "start": 2 * interval, "end": 2 * interval + 1, "seed": 100 + member}
    study.add_trial(optuna.trial.create_trial(  # trial 12: the rerun of trial 9
        value=value, params={"lr": lr, "momentum": 0.9}, distributions=dists,
        user_attrs={ATTR_LINEAGE: lineage, ATTR_REPLACES: 9}))
    panel = _panel(study)
    assert panel is not None
    segments = sorted(t.meta["trial"] for t in _traces(panel, "segment"))
    assert segments == [*range(9), 10, 11, 12]
    assert "4 member(s), 12 interval(s), 4 exploit(s)" in panel.note
