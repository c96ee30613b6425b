"""Options of the slurm engine (``engine_options:`` when ``engine: slurm``); pydantic only."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator

from hpoflow.registry import Options

__all__ = ["SAFE", "SlurmOptions"]

# what a value passed to sbatch/srun, or written into a job script's #SBATCH line, may hold: SLURM
# reads these itself (no shell), but a #SBATCH line ends at the first space and a job name or an
# account with a quote or a newline in it is always a mistake
SAFE = re.compile(r"^[A-Za-z0-9._,:=@%+/-]+$")


def _safe(value: str, key: str) -> str:
    if not SAFE.fullmatch(value):
        raise ValueError(f"{key} may hold only letters, digits and . _ , : = @ % + / - (ASCII), but got {value!r}")
    return value


def _no_hint_clash(srun_args: tuple[str, ...]) -> None:
    """``threads_per_core: 1`` is ``--hint=nomultithread``, which srun refuses beside a binding of the
    user's (``--cpu-bind`` other than ``verbose``, ``--threads-per-core``, ``--ntasks-per-core``, ``-B``):
    every step would fail to start, so the spec is refused at the flag."""
    for flag in srun_args:
        name, _, value = flag.partition("=")
        binds = name == "--cpu-bind" and any(v not in ("v", "verbose") for v in value.split(",") if v)
        if binds or name in ("--threads-per-core", "--ntasks-per-core", "--extra-node-info") or flag.startswith("-B"):
            raise ValueError(
                f"threads_per_core: 1 runs each rank with --hint=nomultithread, which srun does not take together "
                f"with a CPU binding of its own (--cpu-bind, --threads-per-core, --ntasks-per-core, -B), but "
                f"srun_args holds {flag!r}. Fix: remove {flag} from srun_args, or remove threads_per_core: 1 and "
                "say the binding in srun_args alone (e.g. --cpu-bind=cores --threads-per-core=1)")


class SlurmOptions(Options):
    """``mode``: ``steps`` runs each trial as a job step of the allocation the driver runs in (the
    default where ``SLURM_JOB_ID`` is set, i.e. inside ``sbatch``/``salloc``); ``jobs`` submits each
    trial as its own batch job (the default elsewhere, e.g. on a login node); ``auto`` chooses.
    ``partition``, ``account``, ``qos``, ``constraint``: the trial jobs' (jobs mode).
    ``time_min``: a trial job's time limit in minutes (jobs mode; default: resources.timeout plus a
    margin, else the partition's default). ``max_jobs``: trial jobs queued or running at once (jobs mode).
    ``memory_gb``: memory per node of a trial job (jobs mode, ``--mem``) where ``resources.memory_gb``
    (per rank) is not set; default: SLURM's default. In steps mode every step asks for memory: the
    ranks' ``resources.memory_gb``, else their share of the allocation's memory by CPUs or by GPUs,
    whichever is larger (as SLURM's ``DefMemPerGPU``).
    ``threads_per_core``: 1 gives each rank whole cores, one thread each (``--hint=nomultithread``: a
    rank's ``cpus_per_process`` counts cores; srun takes no ``--cpu-bind`` beside it); unset, SLURM's
    default (it counts hardware threads, rounded up to whole cores where SLURM allocates cores).
    ``srun_args`` / ``sbatch_args``: extra flags, each one element (``--reservation=x``).
    ``python``: the interpreter on the nodes (default: the driver's). ``env``: extra environment for
    every rank. ``socket_ifname``: ``auto`` points gloo at the interface that routes to the driver's node
    (the one the step's hosts share), ``none`` leaves it alone.
    ``poll_interval_s``: how often the engine looks at running trials; ``heartbeat_timeout_s``: a trial
    job whose heartbeat is older is lost (jobs mode); ``kill_grace_s``: after a stop, before SIGKILL;
    ``pg_timeout_s`` / ``answer_timeout_s``: a trial's process-group timeout and how long rank 0 waits
    for a pruning answer.
    ``agents``: ``on`` runs the trials of steps mode on node agents (one ``srun`` step over the whole
    allocation, each node's agent a warm pool like the local engine's; ``hpoflow.engines.slurm.agents``)
    instead of one step per trial; ``auto`` does so inside an allocation (steps mode); ``off`` keeps
    one step per trial. ``agent_timeout_s``: an agent silent that long (it sends a heartbeat every
    second, less often in fleets over 250 nodes) is lost, and its trials rerun elsewhere; an agent that
    hears nothing from the driver that long ends. ``agent_start_timeout_s``: how long the driver waits for
    its agents to connect (a thousand nodes importing from a cold shared file system take minutes; agents
    retry for as long); a fleet with no agent up by then stops the study."""

    mode: Literal["auto", "steps", "jobs"] = "auto"
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    time_min: int | None = Field(default=None, ge=1)
    max_jobs: int = Field(default=8, ge=1)
    memory_gb: int | None = Field(default=None, ge=1)
    threads_per_core: Literal[1] | None = None
    srun_args: tuple[str, ...] = ()
    sbatch_args: tuple[str, ...] = ()
    python: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    socket_ifname: Literal["auto", "none"] = "auto"
    poll_interval_s: float = Field(default=0.1, gt=0)
    heartbeat_timeout_s: float = Field(default=120.0, gt=0)
    kill_grace_s: float = Field(default=5.0, gt=0)
    pg_timeout_s: float = Field(default=120.0, gt=0)
    answer_timeout_s: float = Field(default=600.0, gt=0)
    agents: Literal["auto", "on", "off"] = "auto"
    agent_timeout_s: float = Field(default=30.0, gt=0)
    agent_start_timeout_s: float = Field(default=900.0, gt=0)

    @field_validator("partition", "account", "qos", "constraint")
    @classmethod
    def _plain(cls, value: str | None, info: Any) -> str | None:
        return None if value is None else _safe(value, str(info.field_name))

    @field_validator("srun_args", "sbatch_args")
    @classmethod
    def _flags(cls, value: tuple[str, ...], info: Any) -> tuple[str, ...]:
        for v in value:
            if not v.startswith("-") or any(c.isspace() for c in v):
                raise ValueError(f"{info.field_name}: each element is one flag such as --reservation=x, but got "
                                 f"{v!r}")
        if info.field_name == "srun_args" and info.data.get("threads_per_core") == 1:
            _no_hint_clash(value)
        return value

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): str(v) for k, v in value.items()}
        return value

    def resolved_mode(self, environ: Mapping[str, str]) -> Literal["steps", "jobs"]:
        """``steps`` inside an allocation (``SLURM_JOB_ID`` set), else ``jobs``, unless ``mode`` says."""
        if self.mode != "auto":
            return self.mode
        return "steps" if environ.get("SLURM_JOB_ID") else "jobs"

    def resolved_agents(self, environ: Mapping[str, str]) -> bool:
        """Whether trials run on node agents: ``on``, or ``auto`` in steps mode; never in jobs mode."""
        return self.resolved_mode(environ) == "steps" and self.agents != "off"
