"""The driver's batch script for ``hpoflow launch SPEC --engine slurm``: options in, script text out.

``batch_script`` is a pure function of a frozen ``SlurmLaunch``. The script asks for the allocation
the trials run in as job steps (nodes, CPUs and GPUs per node, time, partition, account, qos), a
warning signal before the walltime (``--signal=B:USR1@SECONDS``: the driver stops its trials at their
next step with a checkpoint, and with ``--requeue`` puts the job back in the queue), ``--no-kill`` (a
node that fails does not end the job: its trials are retried on the nodes left), and ``exec``s
``hpoflow run`` so that signal reaches the driver itself. A job script is a shell script: every path
and argument in it is quoted with ``shlex.quote``; what ``#SBATCH`` lines carry must be plain
(``SAFE``), since SLURM reads them without a shell. ``--drivers N`` makes it a job array of N
drivers, each in its own allocation and run directory (``RUN_DIR/driver-K``), on one study storage.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from hpoflow.engines.slurm.options import SAFE
from hpoflow.errors import EngineError

__all__ = ["SlurmLaunch", "batch_script", "sbatch_argv"]

STORAGE_ENV = "HPOFLOW_STORAGE"  # the variable a job array's drivers read their shared storage URL from


@dataclass(frozen=True)
class SlurmLaunch:
    """What the driver's job asks SLURM for, and what it runs."""

    spec: str  # absolute path of the spec
    run_dir: str  # absolute path of the run directory (a job array: the parent of driver-K/)
    python: str
    pythonpath: tuple[str, ...]
    workdir: str
    nodes: int = 1
    cpus_per_node: int | None = None
    gpus_per_node: int = 0
    time_minutes: int | None = None
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    job_name: str = "hpoflow"
    signal_s: int = 300
    requeue: bool = False
    drivers: int = 1
    storage: str | None = None  # a job array's shared storage (a journal path or a URL without password)
    n_trials: int | None = None
    extra: tuple[str, ...] = ()  # more #SBATCH flags, each one element

    def __post_init__(self) -> None:
        for what, value in (("--partition", self.partition), ("--account", self.account), ("--qos", self.qos),
                            ("--job-name", self.job_name)):
            if value is not None and not SAFE.fullmatch(value):
                raise EngineError(f"{what} may hold only letters, digits and . _ , : = @ % + / - (ASCII): SLURM "
                                  f"reads it from an #SBATCH line, but got {value!r}. Fix: use a plain name")
        for flag in self.extra:
            if not flag.startswith("-") or not SAFE.fullmatch(flag.lstrip("-")):
                raise EngineError(f"extra sbatch flag {flag!r}: each is one plain flag such as --reservation=x. "
                                  "Fix: remove spaces and quotes")


def _sbatch_lines(o: SlurmLaunch) -> list[str]:
    lines = [f"--job-name={o.job_name}", f"--nodes={o.nodes}", "--ntasks-per-node=1"]
    if o.cpus_per_node:
        lines.append(f"--cpus-per-task={o.cpus_per_node}")
    else:
        lines.append("--exclusive")  # every CPU of the nodes: the trials' steps share them out
    if o.gpus_per_node:
        lines.append(f"--gpus-per-node={o.gpus_per_node}")
    if o.time_minutes:
        lines.append(f"--time={o.time_minutes}")
    for flag, value in (("partition", o.partition), ("account", o.account), ("qos", o.qos)):
        if value:
            lines.append(f"--{flag}={value}")
    lines += [f"--signal=B:USR1@{o.signal_s}", "--no-kill"]
    if o.requeue:
        lines.append("--requeue")
    if o.drivers > 1:
        lines.append(f"--array=0-{o.drivers - 1}")
    return [*lines, *o.extra]


def batch_script(o: SlurmLaunch) -> str:
    """The batch script of the study's driver (or of each driver of a job array)."""
    q = shlex.quote
    run_dir = q(o.run_dir) + ('/driver-"$SLURM_ARRAY_TASK_ID"' if o.drivers > 1 else "")
    argv = [q(o.python), "-m", "hpoflow", "run", q(o.spec), "--run-dir", run_dir]
    if o.n_trials:
        argv += ["--n-trials", str(o.n_trials)]
    env = [f"export PYTHONPATH={q(':'.join(o.pythonpath))}${{PYTHONPATH:+:$PYTHONPATH}}",
           f"export HPOFLOW_WALLTIME_WARNING_S={o.signal_s}  # the driver's own timer agrees with --signal"]
    if o.requeue:
        env.append("export HPOFLOW_REQUEUE=1  # after a walltime warning the driver requeues this job")
    if o.drivers > 1 and o.storage:
        env.append(f"export {STORAGE_ENV}={q(o.storage)}  # the drivers' one study (spec: storage_env)")
    return "\n".join([
        "#!/bin/bash",
        "# The driver of an hpoflow study (hpoflow launch --engine slurm). Its trials run as job steps of",
        "# this allocation; on the walltime warning (USR1) they stop at their next step with a checkpoint",
        "# and the study resumes when this script runs again.",
        *(f"#SBATCH {line}" for line in _sbatch_lines(o)),
        "set -eu",
        *env,
        f"cd {q(o.workdir)}",
        "exec " + " ".join(argv),
        "",
    ])


def sbatch_argv(script_path: str, output: str, sbatch: Sequence[str] = ("sbatch",)) -> list[str]:
    """How to submit the script: its output file on the command line (a path may hold spaces, which an
    ``#SBATCH`` line cannot carry), appended to, so a requeued job's runs all stay in it."""
    return [*sbatch, "--parsable", f"--output={output}", "--open-mode=append", script_path]
