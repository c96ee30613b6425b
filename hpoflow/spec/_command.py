"""``training.command``: the user's own program as a trial (an argv, never a shell).

A command is an argv list, or a string split with ``shlex`` (never given to a shell). Any argument
may hold ``${param}`` placeholders, whole (``"${lr}"``) or inside it (``--lr=${lr}``, a Hydra
override ``lr=${lr}``): each is replaced by the trial's value as text, so a value never becomes more
than the one argument it stands in. An argument naming a parameter that is inactive in the trial (its
``when`` condition unmet) is left out, and so is the option name written just before a whole
placeholder (``--momentum "${momentum}"``: both go). Only an option name written as such in the command
goes with it: an argument that is another parameter's value (``"${flag}"`` = ``--amp`` just before an
inactive ``"${momentum}"``), ``--``, ``-`` and a negative number (``-1``) stay.

``${trial_dir}`` and ``${checkpoint_dir}`` (``RUN_PLACEHOLDERS``) are no parameters: they stand for the
trial's directory and its checkpoint directory, known where the trial runs, and are replaced there
(``run_values``), in ``command`` and in ``training.workdir``.

The program runs in ``training.workdir``: by default its trial directory (``${trial_dir}``), so files a
program writes under fixed names (``model.pt``, ``lightning_logs/``) are the trial's own; ``.`` is the
directory ``hpoflow`` runs in. Relative paths of the command keep meaning what they mean there: an
argument (or an ``--option=value``'s value) that names an existing file or directory relative to the
directory ``hpoflow`` runs in is made absolute (``anchor_paths``; a bare word that follows no option
stays: it may be a subcommand); a path that does not exist yet (an output) stays relative, so it lands
in the working directory.

The program is found like a shell would: a name without ``/`` on ``PATH``, a path relative to the
directory ``hpoflow`` runs in; ``python``/``python3`` mean the interpreter running hpoflow (as
``torchrun`` runs a script with its own interpreter).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import sys
from collections.abc import Mapping
from typing import Any

from pydantic_core import PydanticCustomError

__all__ = ["PYTHON_NAMES", "RUN_PLACEHOLDERS", "UNBOUNDED_EPOCHS", "anchor_paths", "command_argv",
           "command_placeholders", "command_problem", "program", "run_values", "runs_warm", "substitute_command",
           "warm_target"]

# A command trial without training.epochs has no step limit: its epochs are this (a program ends itself).
UNBOUNDED_EPOCHS = 2**31 - 1
PYTHON_NAMES = ("python", "python3")
_ANY_PLACEHOLDER = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_WHOLE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)\}$")
# placeholders of where a trial runs, not of its parameters: replaced on the trial's host (run_values)
RUN_PLACEHOLDERS = ("trial_dir", "checkpoint_dir")


def command_argv(value: Any) -> list[str] | None:
    """A command as an argv: a string split with ``shlex``, a list with each scalar as text; None
    stays None. ``PydanticCustomError`` for an unbalanced quote, an empty command, or an item that is
    not a scalar."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            argv = shlex.split(value)
        except ValueError as exc:
            raise PydanticCustomError(
                "bad_command", "{at}: the command {c} cannot be split into arguments ({why}); it is split like a shell "
                "splits a line, but never run by one. Fix: close the quote, or write the command as a list",
                {"at": "command", "c": repr(value), "why": str(exc)}) from None
    elif isinstance(value, list | tuple):
        argv = []
        for i, item in enumerate(value):
            if isinstance(item, dict | list | tuple) or item is None:
                raise PydanticCustomError(
                    "bad_command", "{at}: an argument is text or a number, but got {v}. Fix: write it as text",
                    {"at": f"command.{i}", "v": repr(item)})
            argv.append(_text(item))
    else:
        raise PydanticCustomError(
            "bad_command", "{at}: a command is a list of arguments ([python, train.py, --lr, \"${lr}\"]) or one "
            "line of text, but got {v}", {"at": "command", "v": repr(value)})
    if not argv or not argv[0]:
        raise PydanticCustomError("bad_command", "{at}: the command is empty. Fix: name a program first, "
                                  "e.g. [python, train.py]", {"at": "command"})
    return argv


def _text(value: Any) -> str:
    """A parameter's value as one argument: numbers as Python writes them, ``true``/``false`` as YAML."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def command_placeholders(argv: list[str]) -> list[tuple[int, str]]:
    """``(index, name)`` of every ``${name}`` in the arguments, whole or inside one."""
    return [(i, m.group(1)) for i, arg in enumerate(argv) for m in _ANY_PLACEHOLDER.finditer(arg)]


def substitute_command(value: Any, params: Mapping[str, Any]) -> list[str] | None:
    """The trial's argv: every placeholder replaced by its value; an argument of an inactive parameter
    left out (with the option name written just before it, for a whole placeholder: ``_option_name``)."""
    argv = command_argv(value)
    if argv is None:
        return None
    out: list[str] = []
    after_option = False  # the last argument of out is an option name written in the command
    for i, arg in enumerate(argv):
        names = [m.group(1) for m in _ANY_PLACEHOLDER.finditer(arg) if m.group(1) not in RUN_PLACEHOLDERS]
        if any(n not in params for n in names):
            if _WHOLE.match(arg) and after_option:
                out.pop()  # the option whose value this was
            after_option = False
            continue
        after_option = i > 0 and _option_name(arg)
        out.append(_ANY_PLACEHOLDER.sub(lambda m: m.group(0) if m.group(1) in RUN_PLACEHOLDERS
                                        else _text(params[m.group(1)]), arg))
    return out


def _option_name(arg: str) -> bool:
    """Whether ``arg``, as written in the command, is an option's name that may take the next argument as
    its value (``--momentum``, ``-m``): it starts with ``-``, holds no placeholder and no ``=``, and is
    neither ``-``/``--`` nor a negative number (``-1``: a value of the option before it)."""
    if not arg.startswith("-") or arg in ("-", "--") or "=" in arg or "${" in arg:
        return False
    try:
        float(arg)
    except ValueError:
        return True
    return False


def run_values(text: str, values: Mapping[str, str]) -> str:
    """``text`` with each ``${trial_dir}``/``${checkpoint_dir}`` (``RUN_PLACEHOLDERS``) replaced by ``values``."""
    return _ANY_PLACEHOLDER.sub(lambda m: values.get(m.group(1), m.group(0)) if m.group(1) in RUN_PLACEHOLDERS
                                else m.group(0), text)


def anchor_paths(argv: list[str], base: str) -> list[str]:
    """``argv`` with every relative path that names an existing file or directory under ``base`` (the
    directory ``hpoflow`` runs in) made absolute: the program itself, a script, an option's value
    (``--data data``, ``--data=data``), a positional argument that looks like a path (``data/``,
    ``cfg.yaml``). A module after ``-m``, code after ``-c``, a bare word after no option (a subcommand:
    ``main.py train``) and a path that does not exist there (an output the program will write: it goes
    to its working directory) are left alone."""

    def anchored(path: str) -> str:
        if not path or os.path.isabs(path) or "${" in path:
            return path
        full = os.path.join(base, path)
        return os.path.normpath(full) if os.path.exists(full) else path

    def pathlike(arg: str, prev: str) -> bool:
        # a bare word after no option may be a subcommand (``main.py train``, ``cli.py fit``): left alone
        return "/" in arg or bool(os.path.splitext(arg)[1]) or (prev.startswith("-") and "=" not in prev)

    out: list[str] = []
    for i, arg in enumerate(argv):
        if i == 0:
            out.append(anchored(arg) if "/" in arg else arg)  # a name on PATH stays a name
        elif out[-1] in ("-m", "-c") and argv[0] in PYTHON_NAMES:
            out.append(arg)
        elif arg.startswith("-"):
            name, eq, value = arg.partition("=")
            out.append(f"{name}={anchored(value)}" if eq and arg.startswith("--") else arg)
        else:
            out.append(anchored(arg) if pathlike(arg, argv[i - 1]) else arg)
    return out


def program(argv0: str) -> str:
    """The executable ``argv0`` names: this interpreter for ``python``/``python3``, else as given."""
    return sys.executable if argv0 in PYTHON_NAMES else argv0


def command_problem(argv: list[str], workdir: str) -> tuple[int, str] | None:
    """Why ``argv`` cannot start (``(index, message)`` of the argument at fault), found without running
    anything: the program is not on ``PATH`` or not an executable file; for ``python SCRIPT``, the
    script is not a file. Relative paths are taken from ``workdir``."""
    argv0 = argv[0]
    if "${" in argv0:
        return None  # a searched program: the trial says what it could not run
    if argv0 not in PYTHON_NAMES:
        if "/" in argv0:
            path = os.path.join(workdir, argv0)
            if not os.path.isfile(path):
                return 0, (f"the program {argv0!r} is not a file (relative to {workdir}, the directory hpoflow runs "
                           "in). Fix: correct the path, or run hpoflow from the directory it is relative to")
            if not os.access(path, os.X_OK):
                return 0, (f"the program {argv0!r} is not executable. Fix: chmod +x {argv0}, or run it with its "
                           "interpreter")
        elif shutil.which(argv0) is None:
            return 0, (f"the program {argv0!r} is not on PATH. Fix: install it, give its path, or add its directory "
                       "to PATH")
        return None
    script = _python_script(argv)
    if script is None or "${" in script[1]:
        return None
    i, name = script
    if not os.path.isfile(os.path.join(workdir, name)):
        return i, (f"python's script {name!r} is not a file (relative to {workdir}, the directory hpoflow runs in). "
                   "Fix: correct the path, or run hpoflow from the directory it is relative to")
    return None


def _python_script(argv: list[str]) -> tuple[int, str] | None:
    """``(index, path)`` of the script of ``python [options] SCRIPT ...``; None for ``-m``/``-c``/``-``."""
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg in ("-m", "-c", "-") or arg.startswith(("-m", "-c")):
            return None
        if arg in ("-W", "-X", "--check-hash-based-pycs"):
            i += 2
            continue
        if arg.startswith("-"):
            i += 1
            continue
        return i, arg
    return None


def warm_target(argv: list[str]) -> tuple[str, str, list[str]] | None:
    """What a warm process can run itself with ``runpy``: ``("path", SCRIPT, args)`` for ``python SCRIPT
    args``, ``("module", MODULE, args)`` for ``python -m MODULE args`` (``-u`` allowed before either);
    None for any other program or interpreter option (it needs an interpreter of its own)."""
    if not argv or argv[0] not in PYTHON_NAMES:
        return None
    rest = argv[2:] if argv[1:2] == ["-u"] else argv[1:]
    if len(rest) >= 2 and rest[0] == "-m":
        return "module", rest[1], rest[2:]
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest[1:]
    return None


def runs_warm(command: object, isolate: object) -> bool:
    """Whether a command trial's program runs warm (``hpoflow.train.command``: forked from the rank's
    process, torch imported): a command (a list) that ``warm_target`` can run itself, and
    ``training.isolate`` not set."""
    return isinstance(command, list) and not isolate and warm_target([str(a) for a in command]) is not None
