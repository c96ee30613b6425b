"""The ``compss:`` section of a study spec, validated into a frozen ``CompssOptions``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from pydantic import Field, ValidationError, field_validator

from hpoflow.engines.compss.shape import TaskShape
from hpoflow.errors import EngineError, did_you_mean
from hpoflow.registry import LAUNCHERS, Options

__all__ = ["CompssOptions", "TrialResources"]


class TrialResources(Protocol):
    """A trial's resources: ``resources:`` of a spec (``ResourcesSpec``) or a ``TrialRequest``."""

    @property
    def processes(self) -> int: ...
    @property
    def cpus_per_process(self) -> int: ...
    @property
    def gpus_per_process(self) -> float: ...
    @property
    def nodes(self) -> int: ...
    @property
    def timeout(self) -> float | None: ...


class CompssOptions(Options):
    """Options of the compss engine (spec section ``compss:``); every field has a working default.

    launcher: how a multi-node trial starts one node launcher per node (a registered launcher:
    srun | mpirun | ssh). master_addr: the rendezvous address (default: the executing node's name
    from COMPSs). srun_args / mpirun_args / ssh_args: extra launcher arguments (srun: ``--overlap``
    so the step may share the nodes with the COMPSs worker; set ``[]`` on Slurm < 20.11).
    python: interpreter for rank processes on every node (default: this one).
    memory_size_gb: memory (whole GB) each node of a trial needs; COMPSs places tasks by it.
    time_out_grace_s: added to resources.timeout for the task's COMPSs ``time_out`` (a backstop).
    slots: the computing units the study's trials may hold at once (its workers' cores): elastic
    trials (``resources.processes: {min, max}``) grow onto what of it is idle and shrink back when
    submitted trials need it; unset, elastic trials keep their minimum size (COMPSs does not tell an
    application what is idle).
    cpus_per_node / gpus_per_node: the computing units and GPUs of one COMPSs worker node (``enqueue_compss
    --cpus_per_node/--gpus_per_node``; ``hpoflow launch`` passes them to the workflow for a batch job). A
    node's share of a trial must fit them; every node of a multi-node trial then asks for all of a
    worker's computing units, so COMPSs can never put two of its nodes on one host; and an elastic
    trial never grows past what one worker holds per node.
    placement_retries: how many times in a row a multi-node task that COMPSs placed twice on one host
    (a name repeated in ``COMPSS_HOSTNAMES``: possible when ``cpus_per_node`` is unknown) is given back
    and submitted again before the trial fails (retryable: then ``resources.max_retries`` counts it).
    env: extra environment for every rank (e.g. ``NCCL_SOCKET_IFNAME``).
    socket_ifname: ``auto`` sets ``GLOO_SOCKET_IFNAME`` to the interface that routes to the
    rendezvous in multi-node trials; ``none`` leaves it alone.
    """

    launcher: str = "srun"
    master_addr: str | None = None
    srun_args: tuple[str, ...] = ("--overlap",)
    mpirun_args: tuple[str, ...] = ()
    ssh_args: tuple[str, ...] = ("-o", "BatchMode=yes")
    python: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    socket_ifname: str = "auto"
    poll_interval_s: float = Field(default=0.2, gt=0)
    heartbeat_timeout_s: float = Field(default=120.0, gt=0)
    start_timeout_s: float = Field(default=900.0, gt=0)
    kill_grace_s: float = Field(default=5.0, gt=0)
    answer_timeout_s: float = Field(default=600.0, gt=0)
    pg_timeout_s: float = Field(default=120.0, gt=0)
    time_out_grace_s: float = Field(default=120.0, gt=0)
    memory_size_gb: int | None = Field(default=None, ge=1)
    max_in_flight: int | None = Field(default=None, ge=1)
    slots: int | None = Field(default=None, ge=1)
    cpus_per_node: int | None = Field(default=None, ge=1)
    gpus_per_node: int | None = Field(default=None, ge=0)
    placement_retries: int = Field(default=3, ge=0)

    @field_validator("env", mode="before")
    @classmethod
    def _env_strings(cls, value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): str(v) for k, v in value.items()}
        return value

    @field_validator("launcher")
    @classmethod
    def _known_launcher(cls, value: str) -> str:
        if value not in LAUNCHERS:
            raise ValueError(
                f"launcher must be one of {', '.join(LAUNCHERS.names())}, but got {value!r}"
                f"{did_you_mean(value, LAUNCHERS.names())}. Fix: launcher: srun on SLURM, mpirun elsewhere "
                "with MPI, ssh with passwordless ssh between the nodes")
        return value

    @field_validator("socket_ifname")
    @classmethod
    def _ifname_mode(cls, value: str) -> str:
        if value not in ("auto", "none"):
            raise ValueError(f"socket_ifname must be auto or none, but got {value!r}. Fix: to pin an interface, "
                             "use compss: {env: {GLOO_SOCKET_IFNAME: eth0}}")
        return value

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CompssOptions:
        """Validate a ``compss:`` mapping; the first problem raises ``EngineError`` naming the key."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            key = ".".join(str(p) for p in err["loc"])
            if err["type"] == "extra_forbidden":
                names = list(cls.model_fields)
                raise EngineError(f"compss.{key}: unknown option{did_you_mean(key, names)}; valid options: "
                                  f"{', '.join(names)}. Fix: rename or remove it") from None
            msg = str(err["msg"]).removeprefix("Value error, ")
            raise EngineError(f"compss.{key}: {msg}, but got {err.get('input')!r}") from None

    def task_shape(self, res: TrialResources) -> TaskShape:
        """The literal shape COMPSs registers for trials with these resources (``EngineError`` if the
        processes do not split evenly over the nodes, or a node's share does not fit one worker)."""
        try:
            return TaskShape.of(res.processes, res.cpus_per_process, res.gpus_per_process, res.nodes, res.timeout,
                                time_out_grace_s=self.time_out_grace_s, memory_gb=self.memory_size_gb,
                                node_cpus=self.cpus_per_node, node_gpus=self.gpus_per_node)
        except ValueError as exc:
            raise EngineError(str(exc)) from None

    def for_task(self) -> dict[str, Any]:
        """The options the task body needs (plain JSON)."""
        return {
            "launcher": self.launcher, "master_addr": self.master_addr, "srun_args": list(self.srun_args),
            "mpirun_args": list(self.mpirun_args), "ssh_args": list(self.ssh_args), "python": self.python,
            "env": dict(self.env), "socket_ifname": self.socket_ifname, "kill_grace_s": self.kill_grace_s,
            "answer_timeout_s": self.answer_timeout_s, "pg_timeout_s": self.pg_timeout_s,
        }
