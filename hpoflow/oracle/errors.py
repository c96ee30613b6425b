"""The oracle's one exception type: a user error with a message that states rule, value and fix."""

from __future__ import annotations

from hpoflow.errors import HpoflowError

__all__ = ["OracleError"]


class OracleError(HpoflowError, ValueError):
    """A wrong input to the oracle (unknown model or preset, bad cluster YAML, impossible size).

    The message is one line: the rule, the offending value and where it came from, then the fix.
    The CLI prints it without a traceback and exits with status 2.
    """
