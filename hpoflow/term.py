"""Consoles for what hpoflow prints: full width when the output is a pipe or a file.

rich assumes 80 columns when stdout is not a terminal, which cut tables piped into ``less`` or a
file; here a non-terminal console is as wide as its widest line (up to ``PIPE_WIDTH``).
"""

from __future__ import annotations

from rich.console import Console

__all__ = ["PIPE_WIDTH", "console"]

PIPE_WIDTH = 1000


def console(stderr: bool = False) -> Console:
    """A rich ``Console`` on stdout (or stderr) that never wraps or cuts piped output."""
    c = Console(stderr=stderr)
    if not c.is_terminal:
        c = Console(stderr=stderr, width=PIPE_WIDTH, soft_wrap=True)
    return c
