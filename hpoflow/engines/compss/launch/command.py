"""The ``runcompss`` / ``enqueue_compss`` command line of a study: options in, argv list out.

``build_command`` is a pure function of a frozen ``LaunchOptions`` (tested by comparing lists);
``hpoflow launch`` prints it (``--dry-run``) or runs it with ``subprocess`` (never a shell).
Flag names are those of COMPSs 3.3's ``runcompss``/``enqueue_compss`` help: ``--lang``,
``--python_interpreter``, ``--pythonpath``, ``--log_level``, ``--project``, ``--resources``,
``--num_nodes``, ``--cpus_per_node``, ``--gpus_per_node``, ``--exec_time`` (minutes), ``--qos``,
``--queue``, ``--project_name``, ``--job_name``, ``--sc_cfg``.

Arguments that survive COMPSs: ``runcompss`` keeps the application's arguments as one string and
expands it unquoted, ``enqueue_compss`` pastes its own and the application's into a generated job
script, so quoting by the caller is lost and any value is split at spaces, globbed, and (in the job
script) read by a shell. hpoflow therefore never relies on quoting:

- values the application reads (the spec path and the run directory) are passed as they are when
  every character is in ``SAFE_CHARS``, else as ``b64:`` + URL-safe base64 of their UTF-8 bytes,
  which ``workflows/hpo.py`` decodes (``decode_app_value``): any path works;
- values COMPSs or the batch system reads itself (interpreter, workflow path, pythonpath, XML paths,
  job name, queue, qos, project, site config, extra flags) must consist of ``SAFE_CHARS`` only, or
  ``LaunchOptions`` refuses them with an ``EngineError`` naming the value, the rule and the fix.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hpoflow.errors import EngineError

__all__ = ["ENCODED_PREFIX", "LOG_LEVELS", "SAFE_CHARS", "LaunchOptions", "build_command", "check_safe",
           "decode_app_value", "default_workflow", "encode_app_value", "is_safe", "slurm_detected"]

LOG_LEVELS = ("off", "info", "api", "debug", "trace")
SAFE_CHARS = "letters, digits and . _ - / + , : = @ %"
_SAFE = re.compile(r"[A-Za-z0-9._/+,:=@%-]+")
ENCODED_PREFIX = "b64:"


def is_safe(value: str) -> bool:
    """True when ``value`` passes through COMPSs's re-splitting unchanged (only ``SAFE_CHARS``)."""
    return _SAFE.fullmatch(value) is not None


def check_safe(value: str, what: str, fix: str) -> str:
    """``value`` if it is safe, else ``EngineError`` naming it, the rule and ``fix``."""
    if not is_safe(value):
        raise EngineError(
            f"{what} {value!r} cannot be passed through COMPSs: runcompss and enqueue_compss split their "
            "arguments again at spaces and hand them to a shell (quotes are lost; $, ;, `, *, ( ) act), so "
            f"values they read may hold only {SAFE_CHARS} (ASCII). Fix: {fix}")
    return value


def encode_app_value(value: str) -> str:
    """``value`` itself if safe, else ``b64:<URL-safe base64 of its UTF-8 bytes, unpadded>``."""
    if is_safe(value) and not value.startswith(ENCODED_PREFIX):
        return value
    raw = value.encode("utf-8", "surrogateescape")
    return ENCODED_PREFIX + base64.urlsafe_b64encode(raw).decode("ascii").rstrip("=")


def decode_app_value(text: str) -> str:
    """The inverse of ``encode_app_value`` (a value without the prefix is returned unchanged)."""
    if not text.startswith(ENCODED_PREFIX):
        return text
    body = text[len(ENCODED_PREFIX):]
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
    except ValueError as exc:
        raise ValueError(f"{text!r} is not a valid b64: value ({exc})") from None
    return raw.decode("utf-8", "surrogateescape")


def default_workflow() -> Path:
    """``workflows/hpo.py`` of this checkout (the package is installed editable)."""
    return Path(__file__).resolve().parents[4] / "workflows" / "hpo.py"  # <root>/hpoflow/engines/compss/launch/


def slurm_detected(env: Mapping[str, str] | None = None, which: object = shutil.which) -> bool:
    """A SLURM login node: ``sbatch`` on PATH and not already inside a job (there, ``runcompss``)."""
    env = os.environ if env is None else env
    return callable(which) and which("sbatch") is not None and "SLURM_JOB_ID" not in env


@dataclass(frozen=True)
class LaunchOptions:
    """Everything that shapes the command. Paths should be absolute (batch jobs start elsewhere)."""

    spec: str
    run_dir: str
    workflow: str
    batch: bool = False  # enqueue_compss (batch system) instead of runcompss (this machine)
    nodes: int | None = None
    cpus_per_node: int | None = None
    gpus_per_node: int | None = None
    time_minutes: int | None = None
    qos: str | None = None
    queue: str | None = None
    account: str | None = None
    job_name: str | None = None
    sc_cfg: str | None = None  # enqueue_compss --sc_cfg: the site's queue system config (name or file)
    log_level: str = "off"
    python: str = sys.executable
    pythonpath: tuple[str, ...] = ()
    project_xml: str | None = None
    resources_xml: str | None = None
    extra_args: tuple[str, ...] = ()  # passed to runcompss/enqueue_compss before the application
    app_args: tuple[str, ...] = ()  # passed to workflows/hpo.py after SPEC --run-dir DIR (safe values)

    def __post_init__(self) -> None:
        """Checks every value (``EngineError``: the rule, the value, the fix); see the module docstring."""
        if self.log_level not in LOG_LEVELS:
            raise EngineError(f"log level must be one of {', '.join(LOG_LEVELS)}, but got {self.log_level!r}")
        for name in ("nodes", "cpus_per_node", "time_minutes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise EngineError(f"{name} must be >= 1, but got {v}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise EngineError(f"gpus_per_node must be >= 0, but got {self.gpus_per_node}")
        if self.sc_cfg is not None and not self.batch:
            raise EngineError("--sc-cfg configures enqueue_compss (a batch job), but this launch runs runcompss on "
                              "this machine. Fix: add --nodes N to submit a batch job, or drop --sc-cfg")
        move = "move it to a path without spaces or special characters (or link it from one)"
        check_safe(self.python, "the Python interpreter", "use an interpreter (virtual environment) at a path "
                   "without spaces or special characters")
        check_safe(self.workflow, "the workflow script", "install hpoflow from a checkout at a path without "
                   "spaces or special characters")
        for entry in self.pythonpath:
            check_safe(entry, "the pythonpath entry", move)
        for name, flag in (("project_xml", "--project-xml"), ("resources_xml", "--resources-xml / "
                                                                "--generate-resources")):
            value = getattr(self, name)
            if value is not None:
                check_safe(value, f"the {flag} file", move)
        names = {"job_name": ("the job name", "--job-name with letters, digits, - and _ only, e.g. hpo-resnet"),
                 "queue": ("the queue", "use the queue's name as the batch system lists it"),
                 "qos": ("the qos", "use the QoS name as the batch system lists it"),
                 "account": ("the project/account", "use the account name as the batch system lists it"),
                 "sc_cfg": ("the site config", "a name from COMPSs's queues/supercomputers or a file path "
                            "without spaces")}
        for name, (what, fix) in names.items():
            value = getattr(self, name)
            if value is not None:
                check_safe(value, what, fix)
        for arg in (*self.extra_args, *self.app_args):
            check_safe(arg, "the extra argument", "pass flags whose values hold no spaces or shell characters")


def build_command(o: LaunchOptions) -> list[str]:
    """The argv that runs ``workflows/hpo.py SPEC --run-dir DIR`` under COMPSs. Every element is safe
    to be re-split by COMPSs (``is_safe``); the spec and run dir are encoded when they need it."""
    argv = ["enqueue_compss" if o.batch else "runcompss"]
    if o.batch:
        if o.sc_cfg:
            argv.append(f"--sc_cfg={o.sc_cfg}")
        if o.job_name:
            argv.append(f"--job_name={o.job_name}")
        if o.nodes is not None:
            argv.append(f"--num_nodes={o.nodes}")
        if o.cpus_per_node is not None:
            argv.append(f"--cpus_per_node={o.cpus_per_node}")
        if o.gpus_per_node is not None:
            argv.append(f"--gpus_per_node={o.gpus_per_node}")
        if o.time_minutes is not None:
            argv.append(f"--exec_time={o.time_minutes}")
        if o.qos:
            argv.append(f"--qos={o.qos}")
        if o.queue:
            argv.append(f"--queue={o.queue}")
        if o.account:
            argv.append(f"--project_name={o.account}")
    if o.project_xml:
        argv.append(f"--project={o.project_xml}")
    if o.resources_xml:
        argv.append(f"--resources={o.resources_xml}")
    argv += [
        "--lang=python",
        f"--python_interpreter={o.python}",
        f"--log_level={o.log_level}",
    ]
    if o.pythonpath:
        argv.append(f"--pythonpath={os.pathsep.join(dict.fromkeys(o.pythonpath))}")
    argv += list(o.extra_args)
    argv += [o.workflow, encode_app_value(o.spec), "--run-dir", encode_app_value(o.run_dir), *o.app_args]
    return argv


def describe(argv: Sequence[str]) -> str:
    """The argv as one copy-pasteable shell line (display only; execution uses the list)."""
    import shlex

    return shlex.join(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """For job scripts that call ``enqueue_compss`` themselves (``runtime_config/slurm_job.sh``):

    ``python -m hpoflow.engines.compss.launch.command encode VALUE...`` prints each value as the
    application's arguments carry it (``encode_app_value``), one per line;
    ``python -m hpoflow.engines.compss.launch.command check NAME=VALUE...`` exits 2 with the rule and the
    fix for the first value COMPSs would split (values COMPSs or the batch system reads itself; an
    empty value is not passed, so it passes).
    """
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("encode", "check"):
        print("usage: python -m hpoflow.engines.compss.launch.command encode VALUE... | check NAME=VALUE...",
              file=sys.stderr)
        return 2
    if args[0] == "encode":
        for value in args[1:]:
            print(encode_app_value(value))
        return 0
    for item in args[1:]:
        name, _, value = item.partition("=")
        if not value:
            continue
        try:
            check_safe(value, name, f"give {name} a value without spaces or shell characters (a path: move or "
                       "link it to one that has none)")
        except EngineError as exc:
            print(f"hpoflow: error: {exc}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
