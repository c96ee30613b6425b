"""COMPSs ``resources.xml`` and ``project.xml`` for a machine or a cluster, built with ``xml.etree``.

Element names follow the COMPSs 3.3 schemas (``resources_schema.xsd``, ``project_schema.xsd``):
``ResourcesList > [SharedDisk] ComputeNode > Processor (ComputingUnits [, Type GPU]) Memory/Size
Adaptors/Adaptor(NIOAdaptor) > SubmissionSystem/Interactive, Ports/MinPort,MaxPort; SharedDisks/
AttachedDisk/MountPoint`` and ``Project > MasterNode, ComputeNode > InstallDir, WorkingDir,
Application/Pythonpath, LimitOfTasks``. Values are set as element text/attributes by ElementTree,
never pasted into markup, so any host name or path is escaped correctly.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "NIO_ADAPTOR",
    "NodeConfig",
    "detect_node",
    "project_xml",
    "read_resources",
    "resources_xml",
    "to_text",
    "write_config",
]

NIO_ADAPTOR = "es.bsc.compss.nio.master.NIOAdaptor"


@dataclass(frozen=True)
class NodeConfig:
    """One COMPSs worker node."""

    name: str = "localhost"
    cpus: int = 1
    gpus: int = 0
    memory_gb: float | None = None
    install_dir: str = "/opt/COMPSs/"
    working_dir: str = "/tmp/COMPSsWorker/"
    pythonpath: tuple[str, ...] = ()
    limit_of_tasks: int | None = None
    min_port: int = 43001
    max_port: int = 43002
    shared_disks: tuple[tuple[str, str], ...] = ()  # (disk name, mount point)

    def __post_init__(self) -> None:
        if self.cpus < 1:
            raise ValueError(f"a COMPSs node needs cpus >= 1, but {self.name!r} has cpus={self.cpus}")
        if self.gpus < 0:
            raise ValueError(f"gpus must be >= 0, but {self.name!r} has gpus={self.gpus}")
        if not 0 < self.min_port <= self.max_port < 65536:
            raise ValueError(f"ports must satisfy 0 < min_port <= max_port < 65536, but got "
                             f"{self.min_port}..{self.max_port} for {self.name!r}")


def _sub(parent: ET.Element, tag: str, text: str | None = None, **attrib: str) -> ET.Element:
    el = ET.SubElement(parent, tag, attrib)
    if text is not None:
        el.text = text
    return el


def _shared_disks(parent: ET.Element, disks: Sequence[tuple[str, str]]) -> None:
    if not disks:
        return
    sd = _sub(parent, "SharedDisks")
    for name, mount in disks:
        ad = _sub(sd, "AttachedDisk", Name=name)
        _sub(ad, "MountPoint", mount)


def resources_xml(nodes: Sequence[NodeConfig]) -> ET.ElementTree:
    """``resources.xml``: every node's processors (CPU and GPU), memory, NIO adaptor, shared disks."""
    root = ET.Element("ResourcesList")
    disk_names = list(dict.fromkeys(name for n in nodes for name, _ in n.shared_disks))
    for name in disk_names:
        _sub(root, "SharedDisk", Name=name)
    for n in nodes:
        cn = _sub(root, "ComputeNode", Name=n.name)
        cpu = _sub(cn, "Processor", Name="MainProcessor")
        _sub(cpu, "ComputingUnits", str(n.cpus))
        if n.gpus:
            gpu = _sub(cn, "Processor", Name="GPU")
            _sub(gpu, "Type", "GPU")
            _sub(gpu, "ComputingUnits", str(n.gpus))
        if n.memory_gb is not None:
            mem = _sub(cn, "Memory")
            _sub(mem, "Size", f"{n.memory_gb:g}")
        adaptors = _sub(cn, "Adaptors")
        ad = _sub(adaptors, "Adaptor", Name=NIO_ADAPTOR)
        ss = _sub(ad, "SubmissionSystem")
        _sub(ss, "Interactive")
        ports = _sub(ad, "Ports")
        _sub(ports, "MinPort", str(n.min_port))
        _sub(ports, "MaxPort", str(n.max_port))
        _shared_disks(cn, n.shared_disks)
    return ET.ElementTree(root)


def _number(text: str | None) -> float | None:
    try:
        return float(text) if text is not None and text.strip() else None
    except ValueError:
        return None


def read_resources(path: Path) -> list[NodeConfig]:
    """The compute nodes a ``resources.xml`` lists: name, CPU computing units (every non-GPU
    ``Processor``), GPUs (``Processor`` with ``Type`` GPU) and memory. ``ValueError`` (naming the file)
    when it is not readable COMPSs resources XML."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise ValueError(f"{path} is not a readable COMPSs resources.xml ({exc})") from None
    if root.tag != "ResourcesList":
        raise ValueError(f"{path} is not a COMPSs resources.xml: its root is <{root.tag}>, not <ResourcesList>")
    nodes = []
    for cn in root.findall("ComputeNode"):
        cpus = gpus = 0
        for proc in cn.findall("Processor"):
            units = int(_number(proc.findtext("ComputingUnits")) or 0)
            if (proc.findtext("Type") or "CPU").strip().upper() == "GPU":
                gpus += units
            else:
                cpus += units
        nodes.append(NodeConfig(name=cn.get("Name") or "?", cpus=max(1, cpus), gpus=gpus,
                                memory_gb=_number(cn.findtext("Memory/Size"))))
    return nodes


def project_xml(nodes: Sequence[NodeConfig], master_shared_disks: Sequence[tuple[str, str]] = ()
                ) -> ET.ElementTree:
    """``project.xml``: the master plus, per worker node, InstallDir, WorkingDir, Pythonpath, LimitOfTasks."""
    root = ET.Element("Project")
    master = _sub(root, "MasterNode")
    _shared_disks(master, master_shared_disks)
    for n in nodes:
        cn = _sub(root, "ComputeNode", Name=n.name)
        _sub(cn, "InstallDir", n.install_dir)
        _sub(cn, "WorkingDir", n.working_dir)
        if n.pythonpath:
            app = _sub(cn, "Application")
            _sub(app, "Pythonpath", os.pathsep.join(n.pythonpath))
        _sub(cn, "LimitOfTasks", str(n.limit_of_tasks if n.limit_of_tasks is not None else n.cpus))
    return ET.ElementTree(root)


def to_text(tree: ET.ElementTree) -> str:
    root = tree.getroot()
    if root is None:  # pragma: no cover - trees built here always have a root
        raise ValueError("empty XML tree")
    ET.indent(root, space="  ")
    body = ET.tostring(root, encoding="unicode", short_empty_elements=True)
    return f'<?xml version="1.0" encoding="UTF-8" standalone="no"?>\n{body}\n'


def detect_node(name: str = "localhost", pythonpath: Sequence[str] = ()) -> NodeConfig:
    """This machine as one COMPSs node: usable cores, visible GPUs, memory, ``$COMPSS_HOME``."""
    from hpoflow.engines.machine import detect_gpus, machine_cores

    mem_gb: float | None = None
    try:
        import psutil

        mem_gb = float(int(psutil.virtual_memory().total / 2**30))
    except ImportError:  # pragma: no cover - psutil is a dependency
        pass
    install = os.environ.get("COMPSS_HOME", "/opt/COMPSs/")
    return NodeConfig(name=name, cpus=len(machine_cores()), gpus=len(detect_gpus()), memory_gb=mem_gb,
                      install_dir=install if install.endswith("/") else install + "/",
                      pythonpath=tuple(dict.fromkeys(pythonpath)))


def write_config(resources_path: Path, nodes: Sequence[NodeConfig],
                 master_shared_disks: Sequence[tuple[str, str]] = ()) -> tuple[Path, Path]:
    """Write ``resources_path`` and a ``project.xml`` next to it; return both paths."""
    resources_path.parent.mkdir(parents=True, exist_ok=True)
    project_path = resources_path.with_name("project.xml")
    if project_path == resources_path:
        project_path = resources_path.with_name("project.generated.xml")
    resources_path.write_text(to_text(resources_xml(nodes)))
    project_path.write_text(to_text(project_xml(nodes, master_shared_disks)))
    return resources_path, project_path
