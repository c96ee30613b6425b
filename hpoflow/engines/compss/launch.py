"""The ``runcompss`` / ``enqueue_compss`` command line of a study: options in, argv list out.

``build_command`` is a pure function of a frozen ``LaunchOptions`` (tested by comparing lists);
``hpoflow launch`` prints it (``--dry-run``) or runs it with ``subprocess`` (never a shell).
Flag names are those of COMPSs 3.3's ``runcompss``/``enqueue_compss`` help: ``--lang``,
``--python_interpreter``, ``--pythonpath``, ``--log_level``, ``--project``, ``--resources``,
``--num_nodes``, ``--cpus_per_node``, ``--gpus_per_node``, ``--exec_time`` (minutes), ``--qos``,
``--queue``, ``--project_name``, ``--job_name``.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LOG_LEVELS", "LaunchOptions", "build_command", "default_workflow", "slurm_detected"]

LOG_LEVELS = ("off", "info", "api", "debug", "trace")


def default_workflow() -> Path:
    """``workflows/hpo.py`` of this checkout (the package is installed editable)."""
    return Path(__file__).resolve().parents[3] / "workflows" / "hpo.py"  # <root>/hpoflow/engines/compss/


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
    log_level: str = "off"
    python: str = sys.executable
    pythonpath: tuple[str, ...] = ()
    project_xml: str | None = None
    resources_xml: str | None = None
    extra_args: tuple[str, ...] = ()  # passed to runcompss/enqueue_compss before the application
    app_args: tuple[str, ...] = ()  # passed to workflows/hpo.py after SPEC --run-dir DIR

    def __post_init__(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise ValueError(f"log level must be one of {', '.join(LOG_LEVELS)}, but got {self.log_level!r}")
        for name in ("nodes", "cpus_per_node", "time_minutes"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, but got {v}")
        if self.gpus_per_node is not None and self.gpus_per_node < 0:
            raise ValueError(f"gpus_per_node must be >= 0, but got {self.gpus_per_node}")


def build_command(o: LaunchOptions) -> list[str]:
    """The argv that runs ``workflows/hpo.py SPEC --run-dir DIR`` under COMPSs."""
    argv = ["enqueue_compss" if o.batch else "runcompss"]
    if o.batch:
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
    argv += [o.workflow, o.spec, "--run-dir", o.run_dir, *o.app_args]
    return argv


def describe(argv: Sequence[str]) -> str:
    """The argv as one copy-pasteable shell line (display only; execution uses the list)."""
    import shlex

    return shlex.join(argv)
