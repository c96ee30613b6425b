"""``hpoflow`` entry point: parse arguments, dispatch, and turn user errors into exit code 2."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from hpoflow import __version__
from hpoflow.errors import HpoflowError

__all__ = ["build_parser", "main"]


def _registrars() -> list[Callable[[argparse._SubParsersAction], None]]:
    from hpoflow.cli import run_cmd, status_cmd, validate_cmd

    regs = [run_cmd.register, validate_cmd.register, status_cmd.register]
    for mod, attr in (("hpoflow.cli.launch_cmd", "register"), ("hpoflow.oracle.cli", "register"),
                      ("hpoflow.cli.scaling_cmd", "register")):
        try:
            module = __import__(mod, fromlist=[attr])
        except ModuleNotFoundError as exc:
            if exc.name and mod.startswith(exc.name):
                continue  # optional subcommand not present in this build
            raise
        regs.append(getattr(module, attr))
    return regs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpoflow",
        description="Task-based hyperparameter optimisation for deep learning (local or PyCOMPSs).",
    )
    parser.add_argument("--version", action="version", version=f"hpoflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in _registrars():
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except HpoflowError as exc:
        print(f"hpoflow: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("hpoflow: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
