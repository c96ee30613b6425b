"""The ``compss:`` section of a study spec, validated into a frozen ``CompssOptions``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hpoflow.engines.compss.layout import LAUNCHERS
from hpoflow.errors import EngineError, did_you_mean

__all__ = ["CompssOptions"]


@dataclass(frozen=True)
class CompssOptions:
    """Options of the compss engine (spec section ``compss:``); every field has a working default.

    launcher: how a multi-node trial starts one node launcher per node (srun | mpirun | ssh).
    master_addr: the rendezvous address (default: the executing node's name from COMPSs).
    srun_args / mpirun_args / ssh_args: extra launcher arguments (srun: ``--overlap`` so the step
    may share the nodes with the COMPSs worker; set ``[]`` on Slurm < 20.11).
    python: interpreter for rank processes on every node (default: this one).
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
    env: dict[str, str] = field(default_factory=dict)
    socket_ifname: str = "auto"
    poll_interval_s: float = 0.2
    heartbeat_timeout_s: float = 120.0
    start_timeout_s: float = 900.0
    kill_grace_s: float = 5.0
    answer_timeout_s: float = 600.0
    pg_timeout_s: float = 120.0
    time_out_grace_s: float = 120.0
    max_in_flight: int | None = None

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> CompssOptions:
        names = [f.name for f in dataclasses.fields(cls)]
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key not in names:
                raise EngineError(
                    f"compss.{key}: unknown option{did_you_mean(key, names)}; valid options: "
                    f"{', '.join(names)}. Fix: rename or remove it"
                )
            if key.endswith("_args"):
                if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
                    raise EngineError(f"compss.{key} must be a list of strings (argv), but got {value!r}")
                value = tuple(value)
            elif key == "env":
                if not isinstance(value, Mapping):
                    raise EngineError(f"compss.env must be a mapping of names to values, but got {value!r}")
                value = {str(k): str(v) for k, v in value.items()}
            elif key.endswith("_s"):
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise EngineError(f"compss.{key} must be a number of seconds > 0, but got {value!r}")
                value = float(value)
            elif key == "max_in_flight" and value is not None and (
                    isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise EngineError(f"compss.max_in_flight must be a whole number >= 1, but got {value!r}")
            kwargs[key] = value
        opts = cls(**kwargs)
        if opts.launcher not in LAUNCHERS:
            raise EngineError(
                f"compss.launcher must be one of {', '.join(LAUNCHERS)}, but got {opts.launcher!r}"
                f"{did_you_mean(opts.launcher, LAUNCHERS)}. Fix: launcher: srun on SLURM, mpirun "
                "elsewhere with MPI, ssh with passwordless ssh between the nodes"
            )
        if opts.socket_ifname not in ("auto", "none"):
            raise EngineError(
                f"compss.socket_ifname must be auto or none, but got {opts.socket_ifname!r}. Fix: to "
                "pin an interface, use compss: {env: {GLOO_SOCKET_IFNAME: eth0}}"
            )
        return opts

    def for_task(self) -> dict[str, Any]:
        """The options the task body needs (plain JSON)."""
        return {
            "launcher": self.launcher, "master_addr": self.master_addr, "srun_args": list(self.srun_args),
            "mpirun_args": list(self.mpirun_args), "ssh_args": list(self.ssh_args), "python": self.python,
            "env": dict(self.env), "socket_ifname": self.socket_ifname, "kill_grace_s": self.kill_grace_s,
            "answer_timeout_s": self.answer_timeout_s, "pg_timeout_s": self.pg_timeout_s,
        }
