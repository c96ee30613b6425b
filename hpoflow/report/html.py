"""``hpoflow report``: one self-contained HTML file that shows a study (opens offline: plotly.js is
embedded, no CDN).

Optuna's visualisation module draws what it already has (optimisation history, learning curves,
parameter importances, parallel coordinates, slices); this module adds what none has: the slot
timeline (each trial a bar from submit to result, one lane per slot, the study's busy fraction),
a PBT/PB2 study's lineage and hyperparameter schedules (``_lineage``), cost panels from what trials
measured (samples/s, step time, communication fraction by world size and strategy), and system usage
per trial when recorded. A panel that cannot be drawn says why.

Reads the study (read-only: usable while it runs); writes only its own output file, atomically.
Needs the ``report`` extra (plotly).
"""

from __future__ import annotations

import html
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from hpoflow.errors import HpoflowError
from hpoflow.fileio import write_atomic
from hpoflow.report import _lineage
from hpoflow.report.tables import best_rows, status_dict
from hpoflow.run.ledger import ATTR_SEGMENTS

__all__ = ["PANELS", "Interval", "Panel", "busy_fraction", "intervals", "lanes", "write_pngs", "write_report"]

_STATE_COLOURS = {"COMPLETE": "#2a9d8f", "PRUNED": "#e9c46a", "FAIL": "#e76f51", "RUNNING": "#8ab17d",
                  "WAITING": "#adb5bd", "PAUSED": "#8d99ae"}


def _plotly() -> Any:
    try:
        import plotly
    except ImportError:
        raise HpoflowError("hpoflow report needs plotly. Fix: pip install 'hpoflow[report]' (or pip install "
                           "plotly)") from None
    return plotly


@dataclass(frozen=True)
class Interval:
    """One run of a trial in time: from submit to result (wall-clock seconds since the epoch). A trial a
    scheduler paused has one interval per run (docs/schedulers.md): state ``PAUSED`` for a run that ended
    in a pause at step ``paused_at``; ``resumed``: the run was a promotion, from a checkpoint."""

    number: int
    state: str
    submit: float
    end: float
    run_s: float  # time in the training function (the busy part)
    max_ranks: int = 0  # elastic trials: the most ranks it ran on (0: a fixed-size trial)
    resizes: int = 0
    paused_at: int = 0
    resumed: bool = False


@dataclass(frozen=True)
class Panel:
    """A titled figure of the report, or the reason it has none."""

    title: str
    figure: Any = None  # a plotly Figure
    note: str = ""


def _timings(t: FrozenTrial) -> dict[str, float]:
    tm = t.user_attrs.get("timings")
    return tm if isinstance(tm, dict) else {}


def intervals(study: optuna.Study) -> list[Interval]:
    """Finished trials with the timings their engine recorded (``started_at``, ``launch_s``,
    ``duration_s`` or ``engine_duration_s``, ``run_s``), and the runs of trials a scheduler paused
    (``hpoflow_segments``), submit order."""
    out = []
    for t in study.get_trials(deepcopy=False):
        segments = t.user_attrs.get(ATTR_SEGMENTS)
        segments = segments if isinstance(segments, list) else []
        for k, seg in enumerate(segments):
            if isinstance(seg, dict) and {"start", "end"} <= set(seg):
                out.append(Interval(t.number, "PAUSED", float(seg["start"]), float(seg["end"]),
                                    float(seg.get("run_s", float(seg["end"]) - float(seg["start"]))),
                                    paused_at=int(seg.get("step", 0)), resumed=k > 0))
        tm = _timings(t)
        if "started_at" not in tm or "duration_s" not in tm:
            continue
        submit = float(tm["started_at"]) - float(tm.get("launch_s", 0.0))
        # the slot is held from the submit to the end: engine_duration_s where the engine records it (the
        # local engine's duration_s starts with the user's code), else duration_s
        held = float(tm.get("engine_duration_s", tm["duration_s"]))
        out.append(Interval(t.number, t.state.name, submit, submit + held,
                            float(tm.get("run_s", tm["duration_s"])), int(tm.get("max_ranks", 0)),
                            int(tm.get("resizes", 0)), resumed=bool(segments)))
    return sorted(out, key=lambda i: (i.submit, i.number))


def lanes(items: list[Interval]) -> list[int]:
    """A lane (slot) for each interval, in the order of ``items``: the lowest lane free at its submit
    (the schedule as it ran)."""
    free_at: list[float] = []
    out = []
    for it in items:
        for lane, t in enumerate(free_at):
            if t <= it.submit + 1e-3:  # a slot freed and refilled in the same millisecond
                free_at[lane] = it.end
                out.append(lane)
                break
        else:
            out.append(len(free_at))
            free_at.append(it.end)
    return out


def busy_fraction(items: list[Interval], slots: int) -> float:
    """Time in the training function over slots x makespan (first submit to last result): the
    method of ``bench/utilization.py``."""
    if not items or slots < 1:
        return 0.0
    span = max(i.end for i in items) - min(i.submit for i in items)
    return sum(i.run_s for i in items) / (slots * span) if span > 0 else 0.0


# -- panels -----------------------------------------------------------------------------------------
def _optuna_plot(fn_name: str, title: str, why_none: str) -> Callable[[optuna.Study, Mapping[str, Any]], Panel]:
    def panel(study: optuna.Study, ctx: Mapping[str, Any]) -> Panel:
        import optuna.visualization as vis

        done = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if not done:
            return Panel(title, note="no complete trial yet")
        try:
            fig = getattr(vis, fn_name)(study)
        except (ValueError, RuntimeError, ZeroDivisionError) as exc:
            return Panel(title, note=f"{why_none}: {exc}")
        if not fig.data:
            return Panel(title, note=why_none)
        return Panel(title, fig)

    return panel


def _timeline(study: optuna.Study, ctx: Mapping[str, Any]) -> Panel:
    go = _plotly().graph_objects
    items = intervals(study)
    if not items:
        return Panel("slot timeline", note="no trial has recorded timings yet")
    lane = dict(zip(map(id, items), lanes(items), strict=True))
    slots = int(ctx.get("slots") or (max(lane.values()) + 1))
    t0 = min(i.submit for i in items)
    fig = go.Figure()
    for state in sorted({i.state for i in items}):
        sel = [i for i in items if i.state == state]
        fig.add_trace(go.Bar(
            name=state.lower(), orientation="h", base=[i.submit - t0 for i in sel], x=[i.end - i.submit for i in sel],
            y=[f"slot {lane[id(i)]}" for i in sel], marker_color=_STATE_COLOURS.get(state, "#6c757d"),
            # an elastic trial that grew is hatched and says how far (docs/elastic.md); a promoted run is dotted
            marker_pattern_shape=["/" if i.resizes else "." if i.resumed else "" for i in sel],
            text=[_label(i) for i in sel],
            hovertemplate="trial %{text}: %{base:.1f} s + %{x:.1f} s<extra></extra>"))
    busy = busy_fraction(items, slots)
    fig.update_layout(barmode="overlay", xaxis_title="seconds since the first submit",
                      height=max(260, 120 + 36 * slots), title=f"busy fraction {busy:.3f} on {slots} slot(s)")
    fig.update_yaxes(autorange="reversed")
    grown = [i for i in items if i.resizes]
    elastic = (f"; {len(grown)} elastic trial(s) grew onto idle cores (hatched; a slot here is a trial's, whatever "
               "its size)") if grown else ""
    n_paused, n_resumed = sum(i.state == "PAUSED" for i in items), sum(i.resumed for i in items)
    sched = (f"; {n_paused} run(s) paused at a rung (grey, 'pause@step'), {n_resumed} promoted run(s) resumed from "
             "a checkpoint (dotted)") if n_paused or n_resumed else ""
    return Panel("slot timeline", fig, note=f"busy fraction {busy:.3f}: time in training functions / (slots x "
                                          "makespan), makespan from the first submit to the last result" + elastic
                                          + sched)


def _label(i: Interval) -> str:
    text = f"{i.number} (up to {i.max_ranks} ranks)" if i.resizes else str(i.number)
    if i.state == "PAUSED":
        text += f" pause@{i.paused_at}"
    return text + (" (promoted)" if i.resumed else "")


def _population(study: optuna.Study, ctx: Mapping[str, Any]) -> Panel | None:
    """A PBT/PB2 study's lineage and hyperparameter schedules (``hpoflow.report._lineage``)."""
    items = _lineage.intervals(study)
    if not items:
        return None  # not a population study: no trial has a lineage
    _plotly()
    fig, note = _lineage.figure(study, items)
    return Panel("population: lineage and hyperparameter schedules", fig, note=note)


_COSTS = (("samples_per_s", "samples/s"), ("step_time_s", "step time (s)"), ("comm_fraction", "communication fraction"),
          ("bytes_per_step", "bytes per step"))


def _costs(study: optuna.Study, ctx: Mapping[str, Any]) -> Panel:
    go = _plotly().graph_objects
    from plotly.subplots import make_subplots

    rows = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)):
        m = t.user_attrs.get("metrics") or {}
        if any(k in m for k, _ in _COSTS):
            world = int(m.get("world_size", t.user_attrs.get("world_size", ctx.get("processes", 1))))
            strategy = str(t.user_attrs.get("strategy", ctx.get("strategy", "allreduce")))
            rows.append((t.number, f"{strategy} x{world}", m))
    present = [(k, label) for k, label in _COSTS if any(k in m for _, _, m in rows)]
    if not present:
        return Panel("cost per trial", note="the trials recorded no throughput or communication measurements "
                                            "(the built-in trainer records them; a user function may report them)")
    fig = make_subplots(rows=1, cols=len(present), subplot_titles=[label for _, label in present])
    for col, (key, _) in enumerate(present, start=1):
        for group in sorted({g for _, g, _ in rows}):
            sel = [(n, m[key]) for n, g, m in rows if g == group and key in m]
            fig.add_trace(go.Scatter(x=[n for n, _ in sel], y=[v for _, v in sel], mode="markers", name=group,
                                     legendgroup=group, showlegend=col == 1), row=1, col=col)
    fig.update_xaxes(title_text="trial")
    fig.update_layout(height=360)
    return Panel("cost per trial", fig)


_ORACLE = (("step_s", "step_time_s", "step time (s)"), ("throughput", "samples_per_s", "samples/s (all ranks)"))


def _oracle(study: optuna.Study, ctx: Mapping[str, Any]) -> Panel | None:
    """The oracle's prediction (made before the trial ran) against what the trial measured."""
    go = _plotly().graph_objects
    from plotly.subplots import make_subplots

    trials = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED))
    if not any(t.user_attrs.get("oracle") for t in trials):
        return None  # the oracle judged no trial (a user function, or oracle.enabled false)
    rows = []
    for pred_key, meas_key, label in _ORACLE:
        pts = [(t.number, float(p), float(m)) for t in trials
               if isinstance(p := (t.user_attrs.get("oracle") or {}).get(pred_key), int | float)
               and isinstance(m := (t.user_attrs.get("metrics") or {}).get(meas_key), int | float) and p > 0 and m > 0]
        if pts:
            rows.append((label, pts))
    title = "oracle: predicted against measured"
    if not rows:
        return Panel(title, note="no trial has both an oracle prediction and a measurement")
    fig = make_subplots(rows=1, cols=len(rows), subplot_titles=[label for label, _ in rows])
    for col, (_label, pts) in enumerate(rows, start=1):
        lo = min(min(p, m) for _, p, m in pts)
        hi = max(max(p, m) for _, p, m in pts)
        fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line={"dash": "dash", "color": "grey"},
                                 name="prediction = measurement", showlegend=col == 1), row=1, col=col)
        fig.add_trace(go.Scatter(x=[p for _, p, _ in pts], y=[m for _, _, m in pts], mode="markers", showlegend=False,
                                 text=[f"trial {n}: measured/predicted {m / p:.2f}" for n, p, m in pts]),
                      row=1, col=col)
        fig.update_xaxes(title_text="predicted", type="log", row=1, col=col)
        fig.update_yaxes(title_text="measured", type="log", row=1, col=col)
    fig.update_layout(height=380)
    ratios = sorted(m / p for _, p, m in rows[0][1])
    return Panel(title, fig, note=f"median measured/predicted {rows[0][0]}: {ratios[len(ratios) // 2]:.2f} over "
                                  f"{len(ratios)} trial(s) (the oracle prices a trial from oracle.cluster before it "
                                  "runs)")


def _system(study: optuna.Study, ctx: Mapping[str, Any]) -> Panel:
    go = _plotly().graph_objects
    from plotly.subplots import make_subplots

    keys = (("cpu_percent", "CPU % (mean over ranks)"), ("rss_peak_mb", "peak RSS MB (max over ranks)"),
            ("net_sent_mb", "MB sent (sum)"), ("net_recv_mb", "MB received (sum)"),
            ("energy_j", "energy J (CPU share + GPU; docs/energy.md)"))
    rows = [(t.number, t.user_attrs["system"]) for t in study.get_trials(deepcopy=False)
            if isinstance(t.user_attrs.get("system"), dict)]
    present = [(k, label) for k, label in keys if any(k in s for _, s in rows)]
    if not present:
        return Panel("system usage per trial", note="no trial recorded system usage")
    fig = make_subplots(rows=1, cols=len(present), subplot_titles=[label for _, label in present])
    for col, (key, _) in enumerate(present, start=1):
        sel = [(n, s[key]) for n, s in rows if key in s]
        fig.add_trace(go.Bar(x=[n for n, _ in sel], y=[v for _, v in sel], showlegend=False), row=1, col=col)
    fig.update_xaxes(title_text="trial")
    fig.update_layout(height=340)
    return Panel("system usage per trial", fig)


def _pareto(study: optuna.Study, ctx: Mapping[str, Any]) -> Panel | None:
    if len(study.directions) < 2:
        return None  # one objective: no front to draw
    if len(study.directions) > 3:
        return Panel("Pareto front", note="Optuna draws the front of 2 or 3 objectives; see the table above")
    return _optuna_plot("plot_pareto_front", "Pareto front", "nothing to draw")(study, ctx)


#: The report's panels, in order: ``(study, context) -> Panel`` (or None where it does not apply).
#: Append to add one.
PANELS: list[Callable[[optuna.Study, Mapping[str, Any]], Panel | None]] = [
    _pareto,
    _optuna_plot("plot_optimization_history", "optimisation history", "nothing to draw"),
    _optuna_plot("plot_intermediate_values", "learning curves (intermediate values; pruned trials stop early)",
                 "no trial reported intermediate values"),
    _timeline,
    _population,
    _optuna_plot("plot_param_importances", "parameter importances", "not enough complete trials"),
    _optuna_plot("plot_parallel_coordinate", "parallel coordinates", "nothing to draw"),
    _optuna_plot("plot_slice", "slices", "nothing to draw"),
    _costs,
    _oracle,
    _system,
]


# -- the page ---------------------------------------------------------------------------------------
_CSS = """body{font-family:system-ui,sans-serif;margin:2em auto;max-width:1200px;color:#222}
h1{margin-bottom:.2em} .meta{color:#555} table{border-collapse:collapse;margin:1em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right} th{background:#f3f3f3}
section{margin:2em 0} .note{color:#666;font-style:italic} pre{background:#f6f6f6;padding:.6em;overflow:auto}"""


def _table(table: Mapping[str, Any]) -> str:
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in table["columns"])
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>" for row in table["rows"])
    return f"<table><tr>{head}</tr>{body}</table>"


def render(study: optuna.Study, run_dir: Path, spec_text: str, storage_label: str,
           context: Mapping[str, Any] | None = None) -> tuple[str, list[Panel]]:
    """The report's HTML and its panels. ``context``: ``slots`` (the study's max_concurrent),
    ``processes``, ``strategy``, ``budget`` (n_trials)."""
    plotly = _plotly()
    ctx = dict(context or {})
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    panels = [p for p in (make(study, ctx) for make in PANELS) if p is not None]
    status = status_dict(study, storage_label, budget=ctx.get("budget"))
    best = best_rows(study, top=10)
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>hpoflow report: "
             f"{html.escape(study.study_name)}</title><style>{_CSS}</style>"
             f"<script type='text/javascript'>{plotly.offline.get_plotlyjs()}</script></head><body>",
             f"<h1>{html.escape(study.study_name)}</h1>",
             f"<p class='meta'>{html.escape(str(run_dir))} · {html.escape(storage_label)} · written "
             f"{time.strftime('%Y-%m-%d %H:%M:%S')} · budget {status['n_trials'] or '-'} trials · "
             + ", ".join(f"{v} {k.removeprefix('n_')}" for k, v in status.items()
                         if k.startswith("n_") and k not in ("n_trials", "n_total") and v)
             + f" · {status['direction']} {html.escape(str(ctx.get('metric', 'the metric')))}</p>"]
    if status["best_trial"] is not None:
        parts.append(f"<p>best trial <b>{status['best_trial']}</b>: value <b>{status['best_value']:.6g}</b> with "
                     f"<code>{html.escape(json.dumps(status['best_params']))}</code></p>")
    parts.append(_table(best))
    parts.append(f"<p>resume or extend: <code>hpoflow run {html.escape(str(run_dir / 'spec.yaml'))} --run-dir "
                 f"{html.escape(str(run_dir))}</code>; the best configuration alone: <code>rerun_spec</code> in "
                 f"<code>{html.escape(str(run_dir / 'best.yaml'))}</code></p>")
    for i, p in enumerate(panels):
        parts.append(f"<section id='panel-{i}'><h2>{html.escape(p.title)}</h2>")
        if p.figure is not None:
            parts.append(p.figure.to_html(full_html=False, include_plotlyjs=False, div_id=f"figure-{i}"))
        if p.note:
            parts.append(f"<p class='note'>{html.escape(p.note)}</p>")
        parts.append("</section>")
    parts.append(f"<section><h2>spec</h2><pre>{html.escape(spec_text)}</pre></section></body></html>")
    return "".join(parts), panels


def write_report(study: optuna.Study, run_dir: Path, out: Path, spec_text: str, storage_label: str,
                 context: Mapping[str, Any] | None = None) -> list[Panel]:
    """Write the report to ``out`` atomically; return its panels (figure or reason)."""
    page, panels = render(study, run_dir, spec_text, storage_label, context)
    write_atomic(out, page)
    return panels


def write_pngs(panels: list[Panel], directory: Path) -> list[Path]:
    """Each drawn panel as a PNG (plotly's static export through kaleido)."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        raise HpoflowError("--png needs kaleido (plotly's static image export). Fix: pip install kaleido") from None
    directory.mkdir(parents=True, exist_ok=True)
    figs, written = [], []
    for i, p in enumerate(panels):
        if p.figure is None:
            continue
        name = "".join(c if c.isalnum() else "_" for c in p.title.split("(")[0].strip()).strip("_")
        p.figure.update_layout(width=1100, height=max(400, int(p.figure.layout.height or 450)))
        figs.append(p.figure)
        written.append(directory / f"{i:02d}_{name}.png")
    import plotly.io as pio

    pio.write_images(figs, [str(w) for w in written])  # one browser session for all of them
    return written
