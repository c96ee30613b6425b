"""Exceptions a user can cause. The CLI prints them as one short message and exits non-zero."""

from __future__ import annotations

import difflib
from dataclasses import dataclass

__all__ = ["EngineError", "HpoflowError", "Issue", "NonFiniteLoss", "OwnerLost", "RunDirError", "SpecError",
           "StudyTaken", "did_you_mean"]


class HpoflowError(Exception):
    """Base of every error that is the user's to fix (shown without a traceback, exit code 2)."""

    exit_code = 2


@dataclass(frozen=True)
class Issue:
    """One problem in a spec: where (key path and line), what rule, and how to fix it."""

    path: str
    message: str
    line: int | None = None
    source: str = "<spec>"

    def __str__(self) -> str:
        where = f"{self.source}:{self.line}" if self.line is not None else self.source
        key = f" {_printable(self.path)}:" if self.path else ""
        return f"{where}:{key} {_printable(self.message)}"


def _printable(text: str) -> str:
    """``text`` on one line: control characters (a key with a ``\\r`` in it) shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


class SpecError(HpoflowError):
    """A study spec is invalid; ``issues`` lists every problem found."""

    def __init__(self, issues: list[Issue]) -> None:
        self.issues = issues
        n = len(issues)
        head = f"invalid study spec ({n} problem{'s' if n != 1 else ''}):"
        super().__init__("\n".join([head, *(f"  {i}" for i in issues)]))


class EngineError(HpoflowError):
    """An engine cannot run the study as asked (missing runtime, resources larger than the machine)."""


class RunDirError(HpoflowError):
    """A run directory cannot be used (another spec's run, not a run directory, locked)."""


class StudyTaken(HpoflowError):
    """The study is run now by a driver that this one cannot run beside (a PBT study has one owner)."""


class OwnerLost(HpoflowError):
    """Another driver took over the study this driver owned (it was judged dead): this driver stops."""

    exit_code = 1


def did_you_mean(word: str, choices: list[str] | tuple[str, ...]) -> str:
    """`` (did you mean 'x'?)`` for the closest choice, or an empty string."""
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class NonFiniteLoss(RuntimeError):
    """A trial's loss or metric became NaN or infinite: the configuration diverged (not retried)."""
