"""Cluster spec: devices, links and overheads, validated once into frozen pydantic objects.

A spec comes from a preset name (``p100-cluster``, see :data:`~hpoflow.oracle.catalog.PRESETS`),
a YAML file, or a mapping. In YAML, ``device``, ``intra_node`` and ``inter_node`` are either a
catalogue name (``v100``, ``nvlink2``, ``ib-edr``) or a full mapping. Units: FLOP/s, bytes,
bytes/s (per direction), seconds. Unknown keys are errors (``extra="forbid"``).

Example::

    name: my-cluster
    nodes: 4
    devices_per_node: 4
    device: v100                 # or {name, peak_flops: {fp32: 15.7e12}, memory_bytes, ...}
    intra_node: nvlink2
    inter_node: {name: 100GbE, bandwidth: 12.5e9, latency: 15e-6}
    rails: 1                     # network adapters per node (each one inter_node link)
    torus: null                  # or [x, y]: the nodes form an x-by-y torus (x y = nodes)
    overlap: 1.0                 # 1: DDP overlaps each bucket's all-reduce with the rest of backward
    backend: nccl                # nccl | gloo: which library's collectives (gloo's reduce-scatter
                                 # moves as much as an all-reduce)
    network_levels:              # switch levels between the nodes, bottom up (default: none, a
      - {nodes: 32, oversubscription: 1.0}   # non-blocking fabric); a job on more nodes than one
      - {nodes: 512, oversubscription: 2.0}  # switch of a level holds shares its uplinks: the
                                 # inter-node bandwidth is divided by that level's oversubscription
    overheads: {...}             # omitted keys get DEFAULT_OVERHEADS (NCCL's 8.4 us per
                                 # collective, step_jitter 0.022): the GPU presets' values
    filesystem: parallel-fs      # where checkpoints go (a catalogue name or a mapping; default:
                                 # local-ssd on one node, parallel-fs on several); see _filesystem.py
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator

from hpoflow.oracle._filesystem import FILESYSTEMS, FileSystemSpec
from hpoflow.oracle.catalog import DEVICES, LINKS, PRESETS
from hpoflow.oracle.errors import OracleError

__all__ = ["DEFAULT_OVERHEADS", "ClusterSpec", "DeviceSpec", "LinkSpec", "NetworkLevel", "Overheads", "load_cluster"]

PRECISIONS = ("fp32", "tf32", "fp16", "bf16")
#: what a cluster spec gets for overheads it does not give: NCCL's base latency per collective
#: (its tuning model, ring/Simple: 8.4 us) and the coefficient of variation of a GPU's step time
#: read from NVIDIA's 8-GPU ResNet-50 figures (hpoflow.oracle.catalog); a CPU cluster (the laptop
#: preset, a calibrated machine) sets both itself
DEFAULT_OVERHEADS = {"collective_s": 8.4e-6, "step_jitter": 0.022}
OPTIMIZER_KEYS = ("sgd", "momentum", "adam")


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class DeviceSpec(_Frozen):
    """One accelerator (or CPU core): peak FLOP/s per precision, memory, sustained efficiency.

    ``peak_flops`` is the matrix-unit peak per precision (``tf32``, ``fp16``, ``bf16``: tensor
    cores; a precision the device lacks runs at the fp32 rate). Without calibrated tables the
    oracle prices every kernel of a training step by a roofline: matrix kernels at ``efficiency``
    of the peak, memory-bound ones at ``memory_efficiency`` of ``memory_bandwidth``, each plus
    ``kernel_s``. ``contention`` multiplies compute time when every device of a node is busy at
    once (CPU cores sharing caches, memory bandwidth and hyper-threads; 1 for GPUs);
    ``reserved_bytes`` is memory the framework takes before the model (CUDA context, library
    workspaces); ``memory_overhead`` the allocator's extra on top of the activations (rounding,
    fragmentation), as a fraction of them.
    """

    name: str
    peak_flops: dict[str, float]
    memory_bytes: float = Field(gt=0)
    memory_bandwidth: float = Field(gt=0)
    efficiency: dict[str, float] = Field(default_factory=lambda: {"fp32": 0.5})
    conv_efficiency: dict[str, float] | None = None
    #: fp32 efficiency by layer kind ("conv", "linear") as a table of (training FLOPs of one
    #: layer call, forward + backward, -> efficiency), sorted by FLOPs; interpolated in log-log
    #: space and clamped at the ends. Absent (the default): the one efficiency per kind above.
    efficiency_table: dict[str, list[tuple[float, float]]] | None = None
    #: fp32 cost of memory-bound layers by kind (lower-case module class name: ``relu``,
    #: ``maxpool2d``, ``batchnorm2d``, ...) as a table of (input elements of one call -> seconds per
    #: input element, forward + backward, beyond operator dispatch), sorted by elements;
    #: interpolated in log-log space and clamped at the ends. Layers of other kinds (and every
    #: layer without a table) are priced by their activation traffic over ``memory_bandwidth``.
    layer_cost: dict[str, list[tuple[float, float]]] | None = None
    reserved_bytes: float = Field(default=0.0, ge=0)
    memory_efficiency: float = Field(default=1.0, gt=0, le=1)
    kernel_s: float = Field(default=0.0, ge=0)
    memory_overhead: float = Field(default=0.0, ge=0)
    contention: float = Field(default=1.0, ge=1.0)
    source: str = ""

    @field_validator("peak_flops")
    @classmethod
    def _peaks(cls, v: dict[str, float]) -> dict[str, float]:
        bad = [k for k in v if k not in PRECISIONS]
        if bad or "fp32" not in v or any(x <= 0 for x in v.values()):
            raise ValueError(
                f"peak_flops needs an fp32 entry, keys among {PRECISIONS} and positive values, "
                f"but got {v}"
            )
        return v

    @field_validator("efficiency", "conv_efficiency", mode="before")
    @classmethod
    def _eff(cls, v: Any) -> Any:
        if v is None:
            return v
        d = {"fp32": v} if isinstance(v, (int, float)) else v
        if not isinstance(d, Mapping) or not all(0 < float(x) <= 1 for x in d.values()):
            raise ValueError(f"efficiency must be a number in (0, 1] or a mapping of them, got {v}")
        return d

    @field_validator("efficiency_table")
    @classmethod
    def _table(cls, v: dict[str, list[tuple[float, float]]] | None) -> Any:
        if v is None:
            return v
        for kind, rows in v.items():
            works = [w for w, _ in rows]
            if kind not in ("conv", "linear") or not rows or works != sorted(works) \
                    or any(w <= 0 or not 0 < e <= 1 for w, e in rows):
                raise ValueError(
                    f"efficiency_table maps 'conv'/'linear' to non-empty [FLOPs, efficiency] rows "
                    f"sorted by FLOPs > 0 with efficiency in (0, 1], but {kind!r} has {rows}"
                )
        return v

    @field_validator("layer_cost")
    @classmethod
    def _layer_cost(cls, v: dict[str, list[tuple[float, float]]] | None) -> Any:
        if v is None:
            return v
        for kind, rows in v.items():
            elems = [n for n, _ in rows]
            if not kind or not rows or elems != sorted(elems) or any(n <= 0 or c <= 0 for n, c in rows):
                raise ValueError(
                    f"layer_cost maps a layer kind to non-empty [elements, seconds per element] rows "
                    f"sorted by elements, all > 0, but {kind!r} has {rows}"
                )
        return v

    @property
    def calibrated(self) -> bool:
        """Whether ``hpoflow oracle calibrate`` measured per-layer tables for this device (then
        layers are priced from the tables, otherwise by the roofline)."""
        return bool(self.efficiency_table or self.layer_cost)

    def peak(self, precision: str) -> float:
        """Matrix-unit peak FLOP/s at ``precision`` (the fp32 peak where the device lacks it)."""
        return self.peak_flops.get(precision, self.peak_flops["fp32"])

    def matrix_rate(self, precision: str) -> float:
        """Sustained FLOP/s of a large matrix kernel at ``precision``: peak x efficiency."""
        return self.peak(precision) * self.efficiency.get(precision, self.efficiency.get("fp32", 0.5))

    def kind_efficiency(self, precision: str) -> tuple[float, float]:
        """(efficiency, convolution efficiency) at ``precision`` without a table."""
        eff = self.efficiency.get(precision, self.efficiency.get("fp32", 0.5))
        if self.conv_efficiency is None:
            return eff, eff
        return eff, self.conv_efficiency.get(precision, self.conv_efficiency.get("fp32", eff))

    def layer_efficiency(self, kind: str, work: float, precision: str = "fp32") -> float | None:
        """Efficiency of one ``kind`` layer call of ``work`` training FLOPs from the table
        (log-log interpolation, clamped at the ends), or None without a table for it."""
        rows = (self.efficiency_table or {}).get(kind)
        if not rows or precision != "fp32" or work <= 0:
            return None
        return _interpolate(rows, work, log=True)

    def element_cost(self, kind: str, elements: float, precision: str = "fp32") -> float | None:
        """Seconds per input element of one ``kind`` layer call over ``elements`` input
        elements, from ``layer_cost`` (log-log interpolation, clamped), or None without a row."""
        rows = (self.layer_cost or {}).get(kind)
        if not rows or precision != "fp32" or elements <= 0:
            return None
        return _interpolate(rows, elements, log=True)

    def flops(self, precision: str, conv_fraction: float = 0.0) -> float:
        """Sustained FLOP/s at ``precision`` for a workload with this share of convolution FLOPs."""
        peak = self.peak_flops.get(precision, self.peak_flops["fp32"])
        eff = self.efficiency.get(precision, self.efficiency.get("fp32", 0.5))
        if self.conv_efficiency is None:
            return peak * eff
        ceff = self.conv_efficiency.get(precision, self.conv_efficiency.get("fp32", eff))
        # FLOPs split between kinds; time adds, so the rates combine harmonically
        return peak / (conv_fraction / ceff + (1 - conv_fraction) / eff)


def _interpolate(rows: list[tuple[float, float]], x: float, log: bool) -> float:
    """Piecewise-linear interpolation of ``rows`` (sorted by their first value) at ``x``, in
    log-log space when ``log`` (every value > 0), clamped to the first and last row."""
    if x <= rows[0][0]:
        return rows[0][1]
    if x >= rows[-1][0]:
        return rows[-1][1]
    f = math.log if log else float
    for (x0, y0), (x1, y1) in itertools.pairwise(rows):
        if x0 <= x <= x1:
            t = (f(x) - f(x0)) / (f(x1) - f(x0)) if x1 > x0 else 0.0
            y = f(y0) + t * (f(y1) - f(y0))
            return math.exp(y) if log else y
    return rows[-1][1]  # pragma: no cover - rows are sorted


class LinkSpec(_Frozen):
    """A link in the alpha-beta model: bandwidth per direction (bytes/s) and latency (s)."""

    name: str
    bandwidth: float = Field(gt=0)
    latency: float = Field(ge=0)
    source: str = ""


class Overheads(_Frozen):
    """Time not explained by FLOPs or bytes: per training step, per dispatched operator, per
    parameter tensor and element of the optimizer step, and the wait for the slowest device.

    Keys not given get :data:`DEFAULT_OVERHEADS` (``collective_s`` 8.4 us, ``step_jitter`` 0.022),
    the rest 0. ``optimizer_per_param_s`` maps ``sgd`` (no momentum), ``momentum`` (SGD with momentum) and
    ``adam`` (Adam/AdamW) to seconds per parameter of ``optimizer.step``. ``sync_wait`` is a table
    of (compute seconds of a step, seconds a synchronous step on 2 devices adds beyond the
    communication model), sorted by compute and interpolated linearly (clamped at the ends): the
    all-reduce at the end of a longer backward pass waits longer for the slower rank and for the
    communication threads to get the cores back. For p devices the model scales it by the
    expected maximum of p standard normal draws over that of 2. Without a table, ``step_jitter`` is
    the coefficient of variation of one device's step time: a synchronous step of p devices waits
    ``step_jitter x compute x E[max of p standard normals]`` for the slowest (0: no wait).
    """

    step_s: float = Field(default=0.0, ge=0)
    step_jitter: float = Field(default=DEFAULT_OVERHEADS["step_jitter"], ge=0, lt=1)
    per_op_s: float = Field(default=0.0, ge=0)
    per_param_tensor_s: float = Field(default=0.0, ge=0)
    per_conv_s: float = Field(default=0.0, ge=0)
    collective_s: float = Field(default=DEFAULT_OVERHEADS["collective_s"], ge=0)
    optimizer_per_param_s: dict[str, float] = Field(default_factory=dict)
    sync_wait: list[tuple[float, float]] = Field(default_factory=list)

    @field_validator("optimizer_per_param_s")
    @classmethod
    def _per_param(cls, v: dict[str, float]) -> dict[str, float]:
        if any(k not in OPTIMIZER_KEYS for k in v) or any(x < 0 for x in v.values()):
            raise ValueError(
                f"optimizer_per_param_s maps {', '.join(OPTIMIZER_KEYS)} to seconds >= 0, but got {v}"
            )
        return v

    @field_validator("sync_wait")
    @classmethod
    def _sync_wait(cls, v: list[tuple[float, float]]) -> list[tuple[float, float]]:
        xs = [x for x, _ in v]
        if xs != sorted(xs) or any(x < 0 or w < 0 for x, w in v):
            raise ValueError(
                f"sync_wait is a list of [compute seconds, wait seconds] rows sorted by compute, "
                f"all >= 0, but got {v}"
            )
        return v

    def sync_wait_at(self, compute_s: float) -> float:
        """Seconds a 2-device synchronous step with ``compute_s`` of compute waits (0 without a
        table; linear interpolation, clamped at the ends)."""
        return _interpolate(self.sync_wait, compute_s, log=False) if self.sync_wait else 0.0



class NetworkLevel(_Frozen):
    """One switch level between the nodes: a switch of this level connects ``nodes`` nodes
    (directly or through the levels below) and its uplinks carry ``1 / oversubscription`` of what
    they connect (1: non-blocking). A job spread over more nodes than one such switch holds sends
    its inter-node traffic through those uplinks, shared by all its nodes at once."""

    nodes: int = Field(ge=1)
    oversubscription: float = Field(default=1.0, ge=1.0)
    name: str = ""


class ClusterSpec(_Frozen):
    """Nodes x devices per node, the device, the two link levels and the overheads.

    ``rails`` network adapters per node each carry an ``inter_node`` link (DGX nodes: one per GPU);
    ``torus: [x, y]`` arranges the nodes in a 2D torus (enables the torus all-reduce); ``overlap``
    is the fraction of communication that can run during the backward pass (1: DDP's buckets
    overlap it; 0: it all comes after, as with gloo on CPU cores); ``loader_samples_per_s`` is how
    many samples per second the input pipeline feeds one device (None: never the bottleneck);
    ``backend`` is the collectives' library (``nccl`` on GPUs; ``gloo``: its reduce-scatter moves
    as many bytes as an all-reduce); ``network_levels`` are the switch levels above the nodes,
    bottom up (:class:`NetworkLevel`): a job on more nodes than one switch of a level holds gets
    the inter-node bandwidth divided by that level's oversubscription (the product over the levels
    it spans).
    """

    name: str = "cluster"
    nodes: int = Field(ge=1)
    devices_per_node: int = Field(ge=1)
    device: DeviceSpec
    intra_node: LinkSpec
    inter_node: LinkSpec
    rails: int = Field(default=1, ge=1)
    torus: tuple[int, int] | None = None
    overlap: float = Field(default=1.0, ge=0, le=1)
    loader_samples_per_s: float | None = Field(default=None, gt=0)
    overheads: Overheads = Field(default_factory=Overheads)
    backend: str = Field(default="nccl", pattern="^(nccl|gloo)$")
    network_levels: list[NetworkLevel] = Field(default_factory=list)
    #: where checkpoints are written (``hpoflow.oracle._checkpoint``); None: the default by node count
    filesystem: FileSystemSpec | None = None
    source: str = ""

    @field_validator("network_levels")
    @classmethod
    def _levels(cls, v: list[NetworkLevel]) -> list[NetworkLevel]:
        sizes = [level.nodes for level in v]
        if sizes != sorted(sizes) or len(set(sizes)) != len(sizes):
            raise ValueError(f"network_levels go bottom up: each level's nodes larger than the one below, "
                             f"but got nodes {sizes}; sort them")
        return v

    def congestion(self, nodes: int) -> float:
        """The factor the inter-node bandwidth is divided by for a job on ``nodes`` nodes: the
        product of the oversubscription of every level it spans beyond one switch."""
        factor = 1.0
        for level in self.network_levels:
            if nodes > level.nodes:
                factor *= level.oversubscription
        return factor

    @field_validator("torus")
    @classmethod
    def _torus(cls, v: tuple[int, int] | None, info: ValidationInfo) -> tuple[int, int] | None:
        nodes = info.data.get("nodes")
        if v is not None and (min(v) < 1 or v[0] * v[1] != nodes):
            raise ValueError(f"torus [x, y] must multiply to the {nodes} nodes, but got {list(v)}; fix torus or nodes")
        return v

    @field_validator("device", mode="before")
    @classmethod
    def _device(cls, v: Any) -> Any:
        return _lookup(v, DEVICES, "device")

    @field_validator("intra_node", "inter_node", mode="before")
    @classmethod
    def _link(cls, v: Any) -> Any:
        return _lookup(v, LINKS, "link")

    @field_validator("filesystem", mode="before")
    @classmethod
    def _filesystem(cls, v: Any) -> Any:
        return _lookup(v, FILESYSTEMS, "file system")

    @property
    def total_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def _lookup(v: Any, table: Mapping[str, Mapping[str, Any]], what: str) -> Any:
    if isinstance(v, str):
        if v not in table:
            raise ValueError(f"unknown {what} {v!r}; catalogue {what}s: {', '.join(table)}")
        return dict(table[v])
    return v


def _line_of(text: str, loc: tuple[int | str, ...]) -> int | None:
    """1-based line of the YAML node at ``loc`` (deepest existing key), or None."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    line = None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = [(k, v) for k, v in node.value if k.value == str(key)]
            if not match:
                break
            line = match[0][0].start_mark.line + 1
            node = match[0][1]
        else:
            break
    return line


def _from_mapping(data: Any, where: str, text: str | None = None) -> ClusterSpec:
    if not isinstance(data, Mapping):
        raise OracleError(
            f"a cluster spec must be a YAML mapping, but {where} holds {type(data).__name__}; "
            "see docs/oracle.md for the keys"
        )
    try:
        return ClusterSpec.model_validate(dict(data))
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        line = _line_of(text, err["loc"]) if text else None
        at = f"{where} line {line}" if line else where
        raise OracleError(
            f"cluster spec key {key!r} in {at}: {err['msg']} (got {err.get('input')!r}); "
            f"fix that key ({exc.error_count()} error(s) in all)"
        ) from exc


def load_cluster(source: str | Path | Mapping[str, Any]) -> ClusterSpec:
    """A :class:`ClusterSpec` from a preset name, a YAML file path, or a mapping."""
    if isinstance(source, Mapping):
        return _from_mapping(source, "the given mapping")
    text_source = str(source)
    if text_source in PRESETS:
        return _from_mapping(PRESETS[text_source], f"preset {text_source!r}")
    path = Path(text_source)
    if not path.is_file():
        raise OracleError(
            f"--cluster must be a preset name or an existing YAML file, but {text_source!r} is "
            f"neither; presets: {', '.join(PRESETS)} (or write a YAML file, see docs/oracle.md)"
        )
    text = path.read_text(encoding="utf-8")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise OracleError(
            f"cluster file {path}{at} is not valid YAML ({problem}); fix the syntax there"
        ) from exc
    return _from_mapping(data, str(path), text)
