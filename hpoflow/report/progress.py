"""Live progress of a running study: a bar on a terminal, a line per finished trial elsewhere."""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console

from hpoflow.report.tables import fmt
from hpoflow.search.driver import DriverListener, DriverSummary
from hpoflow.trial import TrialResult

__all__ = ["ProgressListener"]


class ProgressListener(DriverListener):
    """Live progress for a terminal (a bar with done/running/failed/best/ETA) or, elsewhere, a line
    per finished trial."""

    def __init__(self, console: Console | None = None, quiet: bool = False) -> None:
        self.console = console or Console(stderr=True)
        self.quiet = quiet
        self.live = self.console.is_terminal and not quiet
        self._progress: Any = None
        self._task: Any = None
        self.total = 0
        self.done = 0
        self.failed = 0
        self.running = 0
        self.best: float | None = None
        self.t0 = time.monotonic()

    def on_start(self, n_total: int, n_done: int) -> None:
        self.total, self.done, self.t0 = n_total, n_done, time.monotonic()
        if n_done:
            self._print(f"resuming: {n_done} of {n_total} trials already finished")
        if self.live:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]trials"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), TimeElapsedColumn(), TextColumn("eta"),
                TimeRemainingColumn(), console=self.console, transient=False,
            )
            self._progress.start()
            self._task = self._progress.add_task("trials", total=n_total, completed=n_done, info="")

    def _info(self) -> str:
        best = "-" if self.best is None else f"{self.best:.4g}"
        return f"running {self.running}  failed {self.failed}  best {best}"

    def _print(self, text: str) -> None:
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, soft_wrap=True, markup=False)
        else:
            self.console.print(text, highlight=False, soft_wrap=True, markup=False)

    def on_trial_start(self, number: int, params: dict[str, Any]) -> None:
        self.running += 1
        if self._progress is not None:
            self._progress.update(self._task, info=self._info())

    def on_trial_end(self, result: TrialResult, params: dict[str, Any], best: float | None) -> None:
        self.running -= 1
        self.done += 1
        self.best = best
        if result.status == "failed":
            self.failed += 1
        value = "" if result.value is None else f" value={result.value:.4g}"
        dur = result.timings.get("duration_s")
        took = "" if dur is None else f" in {dur:.1f}s"
        resizes = int(result.timings.get("resizes", 0))
        if resizes:  # an elastic trial (docs/elastic.md)
            took += f" (elastic: up to {int(result.timings.get('max_ranks', 0))} ranks, {resizes} resize(s))"
        ps = " ".join(f"{k}={fmt(v)}" for k, v in params.items())
        err = f"  error: {result.error}" if result.error and result.status != "complete" else ""
        self._print(f"trial {result.number:>4} {result.status:<9}{value}{took}  {ps}{err}"
                    f"  [{self.done}/{self.total}]")
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done, info=self._info())

    def on_finish(self, summary: DriverSummary) -> None:
        if self._progress is not None:
            self._progress.stop()
