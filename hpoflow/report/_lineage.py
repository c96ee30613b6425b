"""The report's PBT panel: the population's lineage and its hyperparameter schedules.

A PBT/PB2 study stores one trial per interval of a member, with the user attr ``hpoflow_lineage``:
``{member, interval, parent, donor, start, end, seed}`` (``parent``: the trial whose checkpoint it
resumed; ``donor``: set, equal to ``parent``, when it copied another member; it trains epochs ``start``
to ``end``); its params are the interval's hyperparameters, its value the interval's final value.

Drawn on an epoch axis where an interval covers ``[start, end + 1]`` (so a member's intervals touch and
an exploit's arrow runs from the donor's end to where the copy starts):

- lineage: a row per member, a segment per interval coloured by its value (better is always yellow), an
  arrow from the donor's interval to the trial that copied it, the best trial's chain of parents drawn
  over it in red;
- schedules: for each hyperparameter that changed during the study, its value against the epoch, a
  step line per member, the best trial's schedule (along its chain of parents) in thick red.

Every trace carries ``meta`` (``{"kind": "segment" | "values" | "exploits" | "best" | "schedule" |
"best schedule", ...}``) so tests and tools can read the figure without parsing colours.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.distributions import FloatDistribution, IntDistribution
from optuna.trial import TrialState

from hpoflow.run.ledger import ATTR_LINEAGE, is_counted

__all__ = ["LineageInterval", "best_chain", "figure", "intervals"]


_KEYS = ("member", "interval", "start", "end")
_BEST = "#d62828"
_PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


@dataclass(frozen=True)
class LineageInterval:
    """One interval trial of a PBT member."""

    number: int
    member: int
    interval: int
    start: int
    end: int
    parent: int | None
    donor: int | None
    value: float | None
    params: Mapping[str, Any]


def _int_or_none(v: Any) -> int | None:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None


def intervals(study: optuna.Study) -> list[LineageInterval]:
    """The study's interval trials (those with a well-formed ``hpoflow_lineage``), by member and interval."""
    out = []
    trials = study.get_trials(deepcopy=False)
    counted = is_counted(trials)  # an interval interrupted and rerun is drawn once: as its rerun
    for t in trials:
        lin = t.user_attrs.get(ATTR_LINEAGE)
        if not counted(t) or not isinstance(lin, dict) or any(_int_or_none(lin.get(k)) is None for k in _KEYS):
            continue
        value = t.values[0] if t.values and t.state == TrialState.COMPLETE else None
        if value is None and t.intermediate_values:  # a pruned or running interval: its last report
            value = t.intermediate_values[max(t.intermediate_values)]
        out.append(LineageInterval(
            t.number, int(lin["member"]), int(lin["interval"]), int(lin["start"]), int(lin["end"]),
            _int_or_none(lin.get("parent")), _int_or_none(lin.get("donor")),
            float(value) if value is not None and math.isfinite(value) else None, dict(t.params)))
    return sorted(out, key=lambda i: (i.member, i.interval, i.number))


def best_chain(items: list[LineageInterval], maximize: bool) -> list[LineageInterval]:
    """The best interval (best value; ties: the lower number, as the study's best trial and best.yaml)
    and its ancestors by ``parent``, in epoch order."""
    scored = [i for i in items if i.value is not None]
    if not scored:
        return []
    sign = 1.0 if maximize else -1.0
    best = max(scored, key=lambda i: (sign * (i.value or 0.0), -i.number))
    by_number = {i.number: i for i in items}
    chain, seen = [best], {best.number}
    while chain[-1].parent is not None and chain[-1].parent in by_number and chain[-1].parent not in seen:
        chain.append(by_number[chain[-1].parent])
        seen.add(chain[-1].number)
    return sorted(chain, key=lambda i: (i.start, i.interval))


def _explored(study: optuna.Study, items: list[LineageInterval]) -> list[tuple[str, bool]]:
    """The hyperparameters that took more than one value, with whether to draw them on a log axis."""
    names = sorted({k for i in items for k in i.params})
    out = []
    for k in names:
        values = {json.dumps(i.params[k]) for i in items if k in i.params}
        if len(values) < 2:
            continue
        dist = next((t.distributions[k] for t in study.get_trials(deepcopy=False) if k in t.distributions), None)
        out.append((k, isinstance(dist, FloatDistribution | IntDistribution) and dist.log))
    return out


def _hover(i: LineageInterval) -> str:
    value = f"{i.value:.6g}" if i.value is not None else "-"
    text = (f"trial {i.number} (member {i.member}, interval {i.interval}): epochs {i.start}-{i.end}, value {value}"
            f"<br>{json.dumps(dict(i.params), default=str)}")
    if i.donor is not None:
        text += f"<br>copied trial {i.donor} (exploit)"
    elif i.parent is not None:
        text += f"<br>resumed trial {i.parent}"
    return text


def figure(study: optuna.Study, items: list[LineageInterval]) -> tuple[Any, str]:
    """The panel's figure (lineage on top, a schedule per explored hyperparameter under it) and its note."""
    import plotly.graph_objects as go
    from plotly.colors import sample_colorscale
    from plotly.subplots import make_subplots

    maximize = study.directions[0] == optuna.study.StudyDirection.MAXIMIZE
    params = _explored(study, items)
    chain = best_chain(items, maximize)
    in_chain = {i.number for i in chain}
    fig = make_subplots(rows=1 + len(params), cols=1, shared_xaxes=True, vertical_spacing=0.06,
                        subplot_titles=["lineage (colour: the interval's value; arrows: exploits)"]
                        + [f"schedule: {k}" for k, _ in params])
    # (a) lineage: a segment per interval, coloured by value
    scale = "Viridis" if maximize else "Viridis_r"
    values = [i.value for i in items if i.value is not None]
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    for i in items:
        colour = "#adb5bd" if i.value is None else sample_colorscale(
            scale, [(i.value - lo) / (hi - lo) if hi > lo else 0.5])[0]
        fig.add_trace(go.Scatter(
            x=[i.start, (i.start + i.end + 1) / 2, i.end + 1], y=[i.member] * 3, mode="lines",
            line={"color": colour, "width": 8}, hovertext=_hover(i), hoverinfo="text", showlegend=False,
            meta={"kind": "segment", "trial": i.number, "best": i.number in in_chain}), row=1, col=1)
    scored = [i for i in items if i.value is not None]
    fig.add_trace(go.Scatter(
        x=[(i.start + i.end + 1) / 2 for i in scored], y=[i.member for i in scored], mode="markers",
        marker={"color": [i.value for i in scored], "colorscale": scale, "showscale": True, "size": 7,
                "colorbar": {"title": {"text": "value"}, "len": 1.0 / (1 + len(params)), "y": 1.0, "yanchor": "top",
                             "x": 1.01, "thickness": 14}},
        hovertext=[_hover(i) for i in scored], hoverinfo="text", name="interval value", showlegend=False,
        meta={"kind": "values"}), row=1, col=1)
    by_number = {i.number: i for i in items}
    exploits = [(by_number[i.donor], i) for i in sorted(items, key=lambda i: (i.start, i.member))
                if i.donor is not None and i.donor in by_number]
    if exploits:
        xs: list[float | None] = []
        ys: list[float | None] = []
        sizes: list[int] = []
        for d, i in exploits:
            xs += [d.end + 1, i.start, None]
            ys += [d.member, i.member, None]
            sizes += [0, 12, 0]
        fig.add_trace(go.Scatter(
            x=xs, y=ys, mode="lines+markers", line={"color": "#444", "width": 1.5, "dash": "dot"},
            marker={"symbol": "arrow", "angleref": "previous", "size": sizes, "color": "#444"},
            name="exploit (copied weights)", hoverinfo="skip",
            meta={"kind": "exploits", "pairs": [[d.number, i.number] for d, i in exploits]}), row=1, col=1)
    if chain:
        px: list[float] = []
        py: list[float] = []
        for i in chain:
            px += [i.start, i.end + 1]
            py += [i.member, i.member]
        fig.add_trace(go.Scatter(
            x=px, y=py, mode="lines", line={"color": _BEST, "width": 3}, opacity=0.9,
            name=f"best trial {chain[-1].number}'s lineage", hoverinfo="skip",
            meta={"kind": "best", "trials": [i.number for i in chain]}), row=1, col=1)
    members = sorted({i.member for i in items})
    fig.update_yaxes(title_text="member", tickvals=members, autorange="reversed", row=1, col=1)
    # (b) schedules: a step line per member, the best chain's schedule over them
    for row, (k, log) in enumerate(params, start=2):
        for m in members:
            own = [i for i in items if i.member == m and k in i.params]
            if not own:
                continue
            fig.add_trace(go.Scatter(
                x=[i.start for i in own] + [own[-1].end + 1], y=[i.params[k] for i in own] + [own[-1].params[k]],
                mode="lines", line={"shape": "hv", "color": _PALETTE[m % len(_PALETTE)], "width": 1.5},
                name=f"member {m}", legendgroup=f"member {m}", showlegend=row == 2,
                hovertext=[_hover(i) for i in own] + [_hover(own[-1])], hoverinfo="text",
                meta={"kind": "schedule", "param": k, "member": m}), row=row, col=1)
        steps = [i for i in chain if k in i.params]
        if steps:
            fig.add_trace(go.Scatter(
                x=[i.start for i in steps] + [steps[-1].end + 1],
                y=[i.params[k] for i in steps] + [steps[-1].params[k]],
                mode="lines", line={"shape": "hv", "color": _BEST, "width": 4}, opacity=0.8,
                name=f"best trial {chain[-1].number}'s schedule", legendgroup="best", showlegend=row == 2,
                hoverinfo="skip", meta={"kind": "best schedule", "param": k, "trials": [i.number for i in steps]}),
                row=row, col=1)
        fig.update_yaxes(title_text=k, type="log" if log else "linear", row=row, col=1)
    fig.update_xaxes(title_text="epoch", row=1 + len(params), col=1)
    fig.update_layout(height=220 + 40 * len(members) + 220 * len(params),
                      legend={"x": 1.09, "xanchor": "left"})  # beside the colour bar, not over it
    n_members, n_intervals = len(members), len({(i.member, i.interval) for i in items})
    note = f"{n_members} member(s), {n_intervals} interval(s), {len(exploits)} exploit(s)"
    if chain:
        path = " -> ".join(f"{i.number} (member {i.member})" for i in chain)
        note += f"; best trial {chain[-1].number}'s lineage (red): {path}"
    if not params:
        note += "; no hyperparameter changed, so no schedule to draw"
    return fig, note
