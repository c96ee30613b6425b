"""Argument types shared by the subcommands."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

__all__ = ["add_storage_args", "int_at_least", "non_negative_int", "positive_int", "storage_arg"]


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


def add_storage_args(p: argparse.ArgumentParser) -> None:
    """``--storage-env NAME`` and ``--storage URL`` (one of them) for a command that reads a run's storage."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("--storage-env", metavar="NAME",
                   help="environment variable holding the study's storage URL: the way to give a URL with a "
                        "password (default: what the run recorded, its storage_env or its storage)")
    g.add_argument("--storage", metavar="URL",
                   help="the study's storage URL; a password in it is visible to every user of this machine "
                        "(ps): prefer --storage-env")


def storage_arg(args: argparse.Namespace) -> str | None:
    """The storage URL ``add_storage_args`` gave (None: the run's own). A password given on the command line
    is blanked out of it (``ps`` shows ``*`` from now on) with a warning that says what to do instead."""
    from hpoflow.credentials import hold, password_of, take_env, wipe_argv
    from hpoflow.errors import HpoflowError

    if args.storage_env:
        from_env = take_env(args.storage_env)
        if from_env is None:
            raise HpoflowError(f"--storage-env: the environment variable {args.storage_env} is not set. Fix: export "
                               f"{args.storage_env}=<storage URL>")
        return from_env
    url: str | None = args.storage
    password = password_of(url)
    if url and password:
        hold(url)
        wipe_argv(password)
        print("hpoflow: warning: --storage put the database password on the command line, where every user of "
              "this machine could see it (ps) until now. Fix: export the URL in an environment variable, e.g. "
              "HPOFLOW_STORAGE, and pass --storage-env HPOFLOW_STORAGE", file=sys.stderr)
    return url
