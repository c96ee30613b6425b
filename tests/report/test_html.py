"""``hpoflow report``: a self-contained HTML report, checked in a real headless browser."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hpoflow
from hpoflow.engines.local import LocalEngine
from hpoflow.report.html import busy_fraction, intervals
from tests.conftest import ROOT

pytest.importorskip("plotly")
pytestmark = pytest.mark.slow  # a real study, then a browser


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rd = tmp_path_factory.mktemp("report") / "run"
    spec = {"study": {"name": "report", "metric": "value", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}, "k": {"type": "int", "low": 1, "high": 4}},
            "search": {"algorithm": "tpe", "n_trials": 10, "max_concurrent": 2, "seed": 0},
            "training": {"function": "trainfns_light:costly"}, "oracle": {"enabled": False}}
    sys.path.insert(0, str(ROOT / "tests"))
    engine = LocalEngine(cores=[0, 1])
    try:
        hpoflow.optimize(spec, rd, engine=engine)
    finally:
        engine.close()
    return rd


def _report(run_dir: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hpoflow", "report", str(run_dir), "-o", str(out), *extra],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.fixture(scope="module")
def report(run_dir: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> tuple[subprocess.CompletedProcess[str], Path, dict[Path, int]]:
    """``hpoflow report`` of the module's run, made once for the tests that read the page: the command,
    the page, and every file of the run directory with its modification time before the command."""
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    out = tmp_path_factory.mktemp("report-html") / "report.html"
    return _report(run_dir, out), out, before


def test_the_report_draws_every_panel_and_leaves_the_run_alone(
        run_dir: Path, report: tuple[subprocess.CompletedProcess[str], Path, dict[Path, int]]) -> None:
    r, out, before = report
    assert r.returncode == 0, r.stderr
    assert "8 of 8 panels drawn" in r.stdout, r.stdout
    page = out.read_text()
    assert "<script src=" not in page and "plotly.js v" in page.lower()  # offline: plotly.js is inline
    assert page.count("plotly-graph-div") == 8
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()} == before


def test_the_timelines_busy_fraction_is_the_utilization_benchmarks(run_dir: Path) -> None:
    study, _ = hpoflow.run.open.load_run(run_dir)
    # bench/utilization.py's method: time in the function (the result files' run_s) / (slots x makespan),
    # makespan from the first submit to the last end the driver saw. The driver sees a trial end when the
    # engine does (engine_duration_s after its submit), which is later than the rank's own duration_s by
    # the engine's work after the function, and more so on a loaded machine: so the ends come from the
    # engine's record in the study, not from the result files.
    res = {int(p.parent.name): json.loads(p.read_text())["timings"] for p in run_dir.glob("trials/*/result.json")}
    engine = {t.number: t.user_attrs["timings"] for t in study.trials}
    assert set(res) == set(engine) and len(res) == 10
    submits = {n: t["started_at"] - t["launch_s"] for n, t in res.items()}
    span = max(submits[n] + engine[n]["engine_duration_s"] for n in res) - min(submits.values())
    expected = sum(t["run_s"] for t in res.values()) / (2 * span)
    assert busy_fraction(intervals(study), 2) == pytest.approx(expected, abs=0.01)


def test_trials_csv_has_system_usage(run_dir: Path) -> None:
    header = (run_dir / "trials.csv").read_text().splitlines()[0].split(",")
    for col in ("system_cpu_percent", "system_rss_peak_mb", "system_net_sent_mb", "system_net_recv_mb"):
        assert col in header


def test_the_report_renders_in_headless_chromium_without_errors(
        report: tuple[subprocess.CompletedProcess[str], Path, dict[Path, int]], tmp_path: Path) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        pytest.skip("no chromium here (.ci/run installs it with apt-get where it can)")
    r, out, _ = report
    assert r.returncode == 0, r.stderr
    shot = tmp_path / "report.png"
    args = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--enable-logging=stderr", "--v=0",
            "--virtual-time-budget=10000", "--window-size=1280,4000"]
    # one page load gives both (headless Chromium runs every command it is given: ~4 CPU-s a load here)
    dom = subprocess.run([*args, "--dump-dom", f"--screenshot={shot}", out.as_uri()], capture_output=True, text=True,
                         timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln or "Uncaught" in ln]
    assert not [ln for ln in console if "error" in ln.lower() or "Uncaught" in ln], console
    html = dom.stdout
    assert html.count('class="main-svg"') >= 8  # every figure drawn by plotly.js
    for i in range(8):  # and each has data: traces in its plot area
        start = html.index(f'id="figure-{i}"')
        nxt = html.find('id="figure-', start + 10)
        chunk = html[start: nxt if nxt > 0 else len(html)]
        assert "trace" in chunk or "parcoords" in chunk, f"figure {i} has no data"
    if not shot.exists():  # an older headless mode: one command a load
        subprocess.run([*args, f"--screenshot={shot}", out.as_uri()], capture_output=True, timeout=180, check=True)
    assert shot.stat().st_size > 20_000


def test_png_export_writes_each_figure(run_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("kaleido")
    if not (shutil.which("chromium") or shutil.which("google-chrome")):
        pytest.skip("kaleido renders through a chromium/chrome browser; none here")
    r = _report(run_dir, tmp_path / "r.html", "--png", str(tmp_path / "png"))
    assert r.returncode == 0, r.stderr
    pngs = sorted((tmp_path / "png").glob("*.png"))
    assert len(pngs) == 8 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_the_timeline_hatches_elastic_trials_that_grew() -> None:
    import optuna
    from optuna.distributions import FloatDistribution

    from hpoflow.report.html import PANELS

    study = optuna.create_study()
    for number, timings in enumerate([
            {"started_at": 100.0, "launch_s": 0.1, "duration_s": 5.0, "run_s": 4.8},
            {"started_at": 100.5, "launch_s": 0.1, "duration_s": 9.0, "run_s": 8.8, "resizes": 1.0, "max_ranks": 2.0,
             "core_s": 12.0}]):
        study.add_trial(optuna.trial.create_trial(
            value=float(number), params={"x": 0.5}, distributions={"x": FloatDistribution(0.0, 1.0)},
            user_attrs={"timings": timings}))
    items = intervals(study)
    assert [(i.max_ranks, i.resizes) for i in items] == [(0, 0), (2, 1)]
    timeline = next(p for p in PANELS if p.__name__ == "_timeline")
    panel = timeline(study, {"slots": 2})
    assert panel is not None and panel.figure is not None
    bar = panel.figure.data[0]
    assert list(bar.marker.pattern.shape) == ["", "/"]
    assert list(bar.text) == ["0", "1 (up to 2 ranks)"]
    assert "1 elastic trial(s) grew" in panel.note


def test_the_progress_line_says_when_an_elastic_trial_changed_size() -> None:
    import io

    from rich.console import Console

    from hpoflow.report.progress import ProgressListener
    from hpoflow.trial import TrialResult

    out = io.StringIO()
    listener = ProgressListener(Console(file=out, width=200))
    listener.on_start(2, 0)
    listener.on_trial_end(TrialResult(0, "complete", 0.9, timings={"duration_s": 3.0}), {"lr": 0.1}, 0.9)
    listener.on_trial_end(TrialResult(1, "complete", 0.95, timings={"duration_s": 2.0, "resizes": 2.0,
                                                                     "max_ranks": 4.0}), {"lr": 0.2}, 0.95)
    lines = out.getvalue().splitlines()
    assert "elastic" not in lines[0]
    assert "in 2.0s (elastic: up to 4 ranks, 2 resize(s))" in lines[1]


def test_the_timeline_shows_pauses_and_promotions() -> None:
    """A trial a scheduler paused (docs/schedulers.md) has one bar per run: grey 'pause@step' runs, and
    the promoted runs after them dotted, each in the slot it ran in."""
    import optuna
    from optuna.distributions import FloatDistribution

    from hpoflow.report.html import PANELS, lanes

    study = optuna.create_study(direction="maximize")
    segments = [{"start": 100.0, "end": 102.0, "run_s": 1.9, "step": 1, "outcome": "paused"},
                {"start": 104.0, "end": 107.0, "run_s": 2.9, "step": 3, "outcome": "paused"}]
    study.add_trial(optuna.trial.create_trial(
        value=0.9, params={"x": 0.5}, distributions={"x": FloatDistribution(0.0, 1.0)},
        user_attrs={"hpoflow_segments": segments,
                    "timings": {"started_at": 110.1, "launch_s": 0.1, "duration_s": 5.0, "run_s": 4.8}}))
    study.add_trial(optuna.trial.create_trial(
        value=0.5, params={"x": 0.1}, distributions={"x": FloatDistribution(0.0, 1.0)},
        user_attrs={"timings": {"started_at": 102.1, "launch_s": 0.1, "duration_s": 2.0, "run_s": 1.9}}))
    items = intervals(study)
    assert [(i.number, i.state, i.paused_at, i.resumed) for i in items] == [
        (0, "PAUSED", 1, False), (1, "COMPLETE", 0, False), (0, "PAUSED", 3, True), (0, "COMPLETE", 0, True)]
    assert lanes(items) == [0, 0, 0, 0]  # one slot was enough: the paused trial held none
    timeline = next(p for p in PANELS if p.__name__ == "_timeline")
    panel = timeline(study, {"slots": 2})
    assert panel is not None and panel.figure is not None
    texts = [t for bar in panel.figure.data for t in bar.text]
    assert "0 pause@1" in texts and "0 pause@3 (promoted)" in texts and "0 (promoted)" in texts
    assert "2 run(s) paused at a rung" in panel.note and "2 promoted run(s)" in panel.note
