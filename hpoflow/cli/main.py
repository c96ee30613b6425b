"""``hpoflow`` entry point: parse arguments, dispatch, and turn user errors into exit code 2."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence

from hpoflow import __version__
from hpoflow.errors import HpoflowError

__all__ = ["build_parser", "main"]


# command -> module with ``register(subparsers)``; a module is imported only when its command runs
# (or for --help), so a light command never pays for a heavy one's imports (torch, optuna).
COMMANDS: dict[str, str] = {
    "run": "hpoflow.cli.run_cmd",
    "validate": "hpoflow.cli.validate_cmd",
    "status": "hpoflow.cli.status_cmd",
    "launch": "hpoflow.cli.launch_cmd",
    "scaling": "hpoflow.cli.scaling_cmd",
    "oracle": "hpoflow.cli.oracle_cmd",
    "schema": "hpoflow.cli.schema_cmd",
    "dashboard": "hpoflow.cli.dashboard_cmd",
    "report": "hpoflow.cli.report_cmd",
}


# Commands that only read and print, and start nothing that outlives them: a Ctrl-C (SIGINT) ends them at
# once, with one line and exit code 130 (``_quit``), wherever the main thread is. A KeyboardInterrupt raised
# there is not reliable (hpoflow.run.signals says why: pydantic-core panics if it comes while it loads, a
# library turns it into an error of its own or swallows it, and CPython ends the process by SIGINT after one
# ended a string ``exec``), and these commands have nothing to stop or write. ``run`` records the signal
# instead (its driver stops), ``dashboard`` stops its server; the others raise KeyboardInterrupt, caught below.
QUIT_AT_ONCE = frozenset({"validate", "status"})


def _quit(signum: int, frame: object) -> None:
    """SIGINT's handler for ``QUIT_AT_ONCE``: what was printed stays printed; then one line, and exit 130."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # (a print the signal interrupted cannot be flushed: dropped)
            stream.flush()
    with contextlib.suppress(OSError):
        os.write(2, b"hpoflow: interrupted\n")
    os._exit(130)


def _registrars(argv: Sequence[str]) -> list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]]:
    first = next((a for a in argv if not a.startswith("-")), None)
    modules = [COMMANDS[first]] if first in COMMANDS else list(COMMANDS.values())
    regs = []
    for mod in modules:
        try:
            module = importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name and mod.startswith(exc.name):
                continue  # optional subcommand not present in this build
            raise
        regs.append(module.register)
    return regs


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hpoflow",
        description="Task-based hyperparameter optimisation for deep learning, on this machine or a cluster "
                    "(engines: local, SLURM, PyCOMPSs).",
    )
    parser.add_argument("--version", action="version", version=f"hpoflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for register in _registrars(argv):
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    program = argv is None  # the hpoflow command itself: its process ends when this returns
    try:  # (a Ctrl-C while the parser is built: one line too)
        argv = list(sys.argv[1:] if argv is None else argv)
        if program and next((a for a in argv if not a.startswith("-")), None) in QUIT_AT_ONCE:
            signal.signal(signal.SIGINT, _quit)
        parser = build_parser(argv)
        args = parser.parse_args(argv)
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("hpoflow: %(message)s"))
        logging.getLogger("hpoflow").addHandler(handler)
        logging.getLogger("hpoflow").setLevel(logging.WARNING)
        return int(args.func(args))
    except HpoflowError as exc:
        print(f"hpoflow: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("hpoflow: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`hpoflow oracle --json | head`): stop quietly, as a C tool would
        # (128 + SIGPIPE); point stdout at /dev/null so the interpreter's final flush cannot fail too
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    finally:
        if program:  # a Ctrl-C or SIGTERM now has nothing left to stop: it must not kill the interpreter's
            for s in (signal.SIGINT, signal.SIGTERM):  # exit (a traceback, or death by SIGINT, not this code)
                signal.signal(s, signal.SIG_IGN)


if __name__ == "__main__":
    sys.exit(main())
