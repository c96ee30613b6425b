"""Which workers ``runcompss`` will have on this machine, and whether a study's trial fits them.

``hpoflow launch --local`` (or a launch without ``--nodes`` off a SLURM login node) runs ``runcompss``
here. Its workers are the compute nodes of the resources XML it is given: ``--resources-xml``, the one
``--generate-resources`` writes for this machine, or, with neither, COMPSs's own
``Runtime/configuration/xml/resources/default_resources.xml`` (COMPSs 3.3: ``localhost``, 4 computing
units, no GPU). A trial whose shape no worker can hold is never placed: its task would wait for
``compss.start_timeout_s`` and fail, trial after trial. ``check_workers`` refuses it before anything is
written, printed or run.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from hpoflow.engines.compss.launch.batch import compss_home
from hpoflow.engines.compss.launch.runtime_xml import NodeConfig
from hpoflow.engines.compss.shape import TaskShape
from hpoflow.errors import EngineError

__all__ = ["check_workers", "default_resources_file"]


def default_resources_file(env: Mapping[str, str] | None = None) -> Path | None:
    """The resources XML ``runcompss`` uses without ``--resources``, when COMPSs is found here."""
    home = compss_home(env)
    path = home / "Runtime" / "configuration" / "xml" / "resources" / "default_resources.xml" if home else None
    return path if path is not None and path.is_file() else None


def _describe(node: NodeConfig) -> str:
    mem = f", {node.memory_gb:g} GB" if node.memory_gb is not None else ""
    return f"{node.name} ({node.cpus} computing units, {node.gpus} GPU(s){mem})"


def check_workers(shape: TaskShape, workers: Sequence[NodeConfig], source: str, fix: str) -> None:
    """``EngineError`` (the need, what ``source`` has, ``fix``) unless ``shape.nodes`` distinct workers can
    each hold one node's share of a trial (computing units, GPUs, memory)."""
    fits = [w for w in workers if w.cpus >= shape.computing_units and w.gpus >= shape.gpus
            and (shape.memory_gb is None or w.memory_gb is None or w.memory_gb >= shape.memory_gb)]
    if len(fits) >= shape.nodes:
        return
    mem = f", {shape.memory_gb} GB" if shape.memory_gb else ""
    listed = "; ".join(_describe(w) for w in workers[:4]) + ("; ..." if len(workers) > 4 else "")
    raise EngineError(
        f"a trial needs {shape.nodes} worker node(s) of {shape.computing_units} computing units and {shape.gpus} "
        f"GPU(s){mem} each, but {source} has {len(fits)} that can hold it ({listed or 'no compute node'}), so "
        f"COMPSs would never place its task. Fix: {fix}")
