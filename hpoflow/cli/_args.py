"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["int_at_least", "non_negative_int", "positive_int"]


def int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse type: a whole number >= ``minimum``."""

    def parse(text: str) -> int:
        digits = text.strip().removeprefix("-")
        if not (digits.isascii() and digits.isdigit()):  # int() would take "٣" and "1_0"
            raise argparse.ArgumentTypeError(f"expected a whole number (ASCII digits), got {text!r}")
        v = int(text)
        if v < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {v}")
        return v

    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)
