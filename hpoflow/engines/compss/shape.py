"""The resource shape of a study's COMPSs task, and exactly what the binding registers for it.

COMPSs places a task by the constraints its core element was *registered* with, and the binding
registers a core element once, at the task's first call. A ``"$VAR"`` constraint would be expanded by
the Java runtime from an environment frozen when the JVM started (before the application ran), so
hpoflow never writes one: ``TaskShape`` holds literal numbers, ``tasks.build`` applies the
decorators with them, and ``registration()`` states what the binding then sends to the runtime
(checked against the real binding in tests/engines/test_compss_binding.py; docs/cluster.md).

Per node of a trial: ``computing_units = ranks per node x cpus_per_process``, GPUs = ranks per node
x ``gpus_per_process``, ``memory_size`` (whole GB: the binding truncates any other number) when
``compss.memory_size_gb`` is set; a trial on
``nodes > 1`` is a ``@multinode(computing_nodes=nodes)`` task (implementation type MULTI_NODE).

Distinct hosts: COMPSs schedules the ``nodes`` actions of a multi-node task one by one, each wherever
its constraints fit (``ExecuteTasksRequest.submitMultiNodeTask``; ``MultiNodeGroup`` has no rule that
they differ, and no constraint key names a host or asks for one exclusively), so a per-node shape that
fits twice on one worker can get two "nodes" on one host. When the worker's computing units are known
(``node_cpus``: ``compss.cpus_per_node``, which ``hpoflow launch`` fills in), every node of a multi-node
trial asks for all of them: two actions of one task can then never share a worker.
``time_out`` is the trial's timeout plus ``compss.time_out_grace_s`` (0: none), a backstop only: the
task body enforces the trial timeout itself and kills the ranks, which COMPSs's SIGALRM would not.
Failures are always ``on_failure="IGNORE"`` (RETRY stops the application after two retries).

Standard library only (imported by the launcher and the driver process).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ON_FAILURE", "Registration", "TaskShape"]

ON_FAILURE = "IGNORE"


@dataclass(frozen=True)
class Registration:
    """What the binding passes to the runtime for a task of one shape.

    ``constraints``, ``impl_type``: arguments of ``register_core_element``; ``num_nodes``,
    ``on_failure``, ``time_out``: arguments of ``process_task`` (one call per trial).
    """

    constraints: str
    impl_type: str
    num_nodes: int
    on_failure: str
    time_out: int


@dataclass(frozen=True)
class TaskShape:
    """Literal per-node resources of every trial task of one study (one COMPSs application)."""

    nodes: int
    computing_units: int
    gpus: int = 0
    memory_gb: int | None = None
    time_out: int = 0

    def __post_init__(self) -> None:
        for name in ("nodes", "computing_units"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskShape.{name} must be >= 1, but got {getattr(self, name)}")
        if self.gpus < 0 or self.time_out < 0:
            raise ValueError(f"TaskShape.gpus and time_out must be >= 0, but got {self.gpus}, {self.time_out}")
        if self.memory_gb is not None and self.memory_gb < 1:
            raise ValueError(f"TaskShape.memory_gb must be >= 1, but got {self.memory_gb}")

    @classmethod
    def of(cls, processes: int, cpus_per_process: int, gpus_per_process: float, nodes: int,
           timeout: float | None, *, time_out_grace_s: float = 0.0, memory_gb: int | None = None,
           node_cpus: int | None = None, node_gpus: int | None = None) -> TaskShape:
        """The shape of a trial with these resources. ``node_cpus``/``node_gpus``: one worker's computing
        units and GPUs, when known: a node's share must fit them, and a multi-node trial asks for all of
        a worker's computing units on each of its nodes (see the module docstring). ``ValueError`` if the
        processes do not split over the nodes, a node's share does not fit a worker, or a rank asks for a share
        of a GPU (COMPSs constraints are whole GPUs)."""
        if nodes < 1 or processes % nodes:
            raise ValueError(
                f"resources.processes must be a multiple of resources.nodes (each node runs the same "
                f"number of ranks), but got processes={processes}, nodes={nodes}. Fix: set processes to "
                f"{nodes * max(1, processes // max(1, nodes))} or change nodes")
        if not float(gpus_per_process).is_integer():
            raise ValueError(
                f"resources.gpus_per_process: {gpus_per_process} shares a GPU between trials, but COMPSs gives a "
                "task whole GPUs (its constraints count GPUs, and two tasks never share one). Fix: set "
                "gpus_per_process: 1, or share GPUs on one machine with the local engine")
        ppn = processes // nodes
        units, gpus = ppn * cpus_per_process, ppn * int(gpus_per_process)
        for need, have, what, key, per_node in ((units, node_cpus, "computing units", "cpus_per_process", "cpus"),
                                                (gpus, node_gpus, "GPUs", "gpus_per_process", "gpus")):
            if have is not None and need > have:
                raise ValueError(
                    f"a trial needs {need} {what} per node ({ppn} rank(s) per node x resources.{key}), but a "
                    f"COMPSs worker node has {have} (compss.{per_node}_per_node: hpoflow launch --{per_node}-per-node, "
                    f"or the site config's default). Fix: raise --{per_node}-per-node if the nodes have more, lower "
                    f"resources.{key} or resources.processes, or spread the trial over more resources.nodes")
        if nodes > 1 and node_cpus is not None:
            units = node_cpus  # the whole worker: two nodes of one trial never share a host
        time_out = math.ceil(timeout + time_out_grace_s) if timeout else 0
        return cls(nodes, units, gpus, memory_gb, time_out)

    @property
    def variant(self) -> str:
        """The task function's name: ``trial_[multinode_]cpu|gpu`` (one decorator stack each)."""
        return "trial_" + ("multinode_" if self.nodes > 1 else "") + ("gpu" if self.gpus else "cpu")

    def placement(self) -> tuple[int, int, int, int | None]:
        """What decides where a task runs (everything but ``time_out``)."""
        return (self.nodes, self.computing_units, self.gpus, self.memory_gb)

    def describe(self) -> str:
        mem = f", {self.memory_gb} GB" if self.memory_gb else ""
        return (f"{self.nodes} node(s) x ({self.computing_units} computing units, {self.gpus} GPU(s){mem}), "
                f"time_out {self.time_out} s")

    def decorator_kwargs(self) -> dict[str, dict[str, Any] | None]:
        """Keyword arguments of ``@constraint``, ``@multinode`` (None: not applied), ``@on_failure``
        and ``@task``; ``tasks.build`` applies exactly these (``returns`` of on_failure added there)."""
        cons: dict[str, Any] = {"computing_units": self.computing_units}
        if self.memory_gb is not None:
            cons["memory_size"] = self.memory_gb
        if self.gpus:
            cons["processors"] = [{"processorType": "GPU", "computingUnits": self.gpus}]
        return {
            "constraint": cons,
            "multinode": {"computing_nodes": self.nodes} if self.nodes > 1 else None,
            "on_failure": {"management": ON_FAILURE},
            "task": {"returns": 1, "time_out": self.time_out},
        }

    def registration(self) -> Registration:
        """What the COMPSs 3.3 binding sends for this shape: ``register_core_element`` joins the
        ``@constraint`` items as ``key:value;`` in keyword order, a list printed by ``str()`` with
        its quotes removed; ``@multinode`` sets the implementation type MULTI_NODE and
        ``process_task`` gets ``num_nodes``, ``on_failure`` and ``time_out``."""
        kw = self.decorator_kwargs()
        cons = kw["constraint"] or {}
        parts = []
        for key, value in cons.items():
            text = str(value).replace("'", "") if isinstance(value, list) else str(value)
            parts.append(f"{key}:{text};")
        return Registration("".join(parts), "MULTI_NODE" if self.nodes > 1 else "METHOD", self.nodes, ON_FAILURE,
                            self.time_out)
