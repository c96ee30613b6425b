"""Consoles for what hpoflow prints: full width when the output is a pipe or a file.

rich assumes 80 columns when stdout is not a terminal, which cut tables piped into ``less`` or a
file; here a non-terminal console is as wide as its widest line (up to ``PIPE_WIDTH``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["PIPE_WIDTH", "console", "render_table"]

PIPE_WIDTH = 1000


def console(stderr: bool = False) -> Console:
    """A rich ``Console`` on stdout (or stderr) that never wraps or cuts piped output."""
    c = Console(stderr=stderr)
    if not c.is_terminal:
        c = Console(stderr=stderr, width=PIPE_WIDTH, soft_wrap=True)
    return c


def render_table(table: Mapping[str, Any]) -> Table:
    """A rich table of plain rows: ``{"title", "columns", "rows"}`` (``hpoflow.report.tables.best_rows``;
    the first two and the last columns right-aligned). Every cell is plain text: a value such as
    ``[red]x`` is shown as written, never read as rich markup."""
    out = Table(title=Text(str(table["title"])))
    columns = [str(c) for c in table["columns"]]
    for i, c in enumerate(columns):
        out.add_column(Text(c), justify="right" if i < 2 or i == len(columns) - 1 else "left")
    for row in table["rows"]:
        out.add_row(*[Text(str(v)) for v in row])
    return out
