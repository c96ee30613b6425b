"""What the driver takes from an agent's messages, checked: an authenticated agent is still only trusted
to send well-formed messages, and one that does not is dropped (``BadMessage``), never the driver.

Standard library and ``hpoflow.trial``.
"""

from __future__ import annotations

from typing import Any, get_args

from hpoflow.trial import TrialReport, TrialResult, TrialStatus

__all__ = ["BadMessage", "integer", "number", "report", "result"]

_MAX_KEYS = 10_000  # metrics, timings, usage: a trial reports tens


class BadMessage(ValueError):
    """An agent's message that breaks the protocol (a field missing, of the wrong type)."""


def number(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadMessage(f"{what} is {type(value).__name__} {str(value)[:40]!r}, not a number")
    try:
        return float(value)
    except OverflowError:
        raise BadMessage(f"{what} is an integer too large for a float") from None


def integer(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadMessage(f"{what} is {type(value).__name__} {str(value)[:40]!r}, not an integer")
    return value


def _numbers(value: Any, what: str) -> dict[str, float]:
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > _MAX_KEYS:
        raise BadMessage(f"{what} is not an object of at most {_MAX_KEYS} numbers")
    return {str(k): number(v, f"{what}[{str(k)[:40]!r}]") for k, v in value.items()}


def _text(value: Any, what: str) -> str | None:
    if value is None or isinstance(value, str):
        return value
    raise BadMessage(f"{what} is {type(value).__name__}, not a string")


def report(msg: dict[str, Any]) -> TrialReport:
    """A ``report`` message's report; ``BadMessage`` when a field is wrong (a metric that is no number)."""
    return TrialReport(integer(msg.get("number"), "number"), integer(msg.get("step", 0), "step"),
                       _numbers(msg.get("metrics"), "metrics"), bool(msg.get("wants")))


def result(msg: dict[str, Any]) -> TrialResult:
    """A ``result`` message's result, for trial ``number``; ``BadMessage`` when a field is wrong."""
    trial = integer(msg.get("number"), "number")
    raw = msg.get("result")
    if not isinstance(raw, dict):
        raise BadMessage("result is not an object")
    status = raw.get("status")
    statuses: tuple[TrialStatus, ...] = get_args(TrialStatus)
    checked = next((s for s in statuses if s == status), None)
    if checked is None:
        raise BadMessage(f"result status {str(status)[:40]!r} is not one of {list(statuses)}")
    value = raw.get("value")
    return TrialResult(trial, checked, None if value is None else number(value, "result value"),
                       _numbers(raw.get("metrics"), "result metrics"), _text(raw.get("error"), "result error"),
                       _text(raw.get("stderr_tail"), "result stderr_tail") or "",
                       _numbers(raw.get("timings"), "result timings"), bool(raw.get("retryable")),
                       _numbers(raw.get("system"), "result system"))
