"""What hpoflow prints is the user's text as written: parameter values, errors and paths that look like
rich markup (``[red]``, ``[/x]``) reach the terminal and pipes unchanged, and never crash the print."""

from __future__ import annotations

import io
from pathlib import Path

from rich.console import Console

import hpoflow
from hpoflow.engines.threads import Reporter, ThreadEngine
from hpoflow.report.progress import ProgressListener
from hpoflow.report.tables import trials_table
from hpoflow.trial import TrialResult


def _objective(params: dict[str, object], reporter: Reporter) -> float:
    if params["tag"] == "[/boom]":
        raise RuntimeError("gloo: [/__w/pytorch/third_party/gloo/pair.cc:152] Connection closed by peer")
    return 1.0 if params["tag"] == "[red]loud[/red]" else 0.5


def test_values_and_errors_that_look_like_markup_print_as_written(tmp_path: Path) -> None:
    spec = {"study": {"name": "markup", "metric": "value", "direction": "maximize"},
            "space": {"tag": {"type": "categorical", "choices": ["[red]loud[/red]", "[/boom]", "plain"]}},
            "search": {"algorithm": "grid"}, "training": {"function": "trainfns_light:slow"}}
    buf = io.StringIO()
    listener = ProgressListener(Console(file=buf, width=200))
    result = hpoflow.optimize(spec, tmp_path / "run", engine=ThreadEngine(_objective, slots=1), listener=listener)
    assert result.summary.n_finished == 3
    progress = buf.getvalue()
    assert "[/__w/pytorch/third_party/gloo/pair.cc:152]" in progress  # an error with a closing tag: printed
    assert "tag=[red]loud[/red]" in progress
    table = io.StringIO()
    Console(file=table, width=200).print(trials_table(result.study))
    assert "[red]loud[/red]" in table.getvalue()


def test_a_trial_error_with_a_stray_closing_tag_does_not_crash_the_progress_line() -> None:
    buf = io.StringIO()
    listener = ProgressListener(Console(file=buf, width=200))
    listener.on_start(1, 0)
    listener.on_trial_end(TrialResult(0, "failed", error="[/x] not a tag"), {"p": "[b]"}, None)
    assert "[/x] not a tag" in buf.getvalue() and "p=[b]" in buf.getvalue()
