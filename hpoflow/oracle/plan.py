"""What the oracle predicts: one training configuration, typed once by the CLI or the API.

:class:`Plan` names the strategy (data parallel with an all-reduce, a parameter server, periodic
averaging, a pipeline, or a sharded one: ``zero1``, ``fsdp``), the sizes (batch per device, devices,
data set and epochs), the precision and the options that change memory and time (DDP buckets, FSDP's
resharding, parameter dtype and CPU offload, activation checkpointing). ``compute_scale`` is what a
measured baseline sets (:mod:`hpoflow.oracle.baseline`): the factor between the device time the
model predicts and the device time measured, applied to every step.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hpoflow.oracle.catalog import ALGORITHMS, PRECISION_BYTES, STRATEGIES
from hpoflow.oracle.cluster import ClusterSpec
from hpoflow.oracle.errors import OracleError

__all__ = ["CHECKPOINTING", "GRAD_DTYPES", "SHARDED", "Plan"]

GRAD_DTYPES = ("fp32", "fp16", "bf16")
#: activation checkpointing policies: none; every ``checkpoint_interval``-th unit keeps only its
#: input and recomputes its forward in backward (``full``); every unit keeps the outputs of every
#: other matrix product and of attention and recomputes the rest (``op``: torchtitan's selective
#: per-operator policy)
CHECKPOINTING = ("none", "full", "op")
#: strategies that shard model state over the data-parallel ranks
SHARDED = ("zero1", "fsdp")


@dataclass(frozen=True)
class Plan:
    """What to predict: strategy, sizes and training length (typed once by the CLI/API).

    ``algorithm`` forces the all-reduce algorithm of ``allreduce`` (``auto``: the fastest);
    ``grad_dtype`` is the all-reduce's dtype (``fp16``/``bf16``: DDP's compression hooks);
    ``bucket_mb`` is DDP's ``bucket_cap_mb`` (0: one all-reduce per parameter tensor);
    ``channels_last``: activations in NHWC (``memory_format=torch.channels_last``).
    ``precision`` is the training precision (autocast for ``fp16``/``bf16``). FSDP (``fsdp``):
    ``reshard_after_forward`` frees each unit's gathered parameters after its forward (and gathers
    them again in backward); the root's too with ``reshard_root`` (FSDP2 keeps the root gathered
    unless ``fully_shard(root, reshard_after_forward=True)`` says otherwise). ``param_dtype`` is
    its mixed-precision policy's: parameters gathered and computed in it; gradients reduced in
    ``reduce_dtype`` (by default the same). ``cpu_offload`` keeps sharded parameters, gradients
    and optimizer state in host memory. ``activation_checkpointing`` is one of
    :data:`CHECKPOINTING` (``checkpoint_interval``: every k-th unit for ``full``).
    """

    batch_size: int
    devices: int | None = None
    strategy: str = "allreduce"
    algorithm: str = "auto"
    optimizer: str = "sgd"
    momentum: float = 0.9
    precision: str = "fp32"
    grad_dtype: str = "fp32"
    bucket_mb: float = 25.0
    channels_last: bool = False
    overlap: float | None = None
    servers: int = 1
    period: int = 4
    stages: int = 2
    micro_batches: int | None = None
    dataset_size: int = 1_281_167
    epochs: float = 90.0
    reshard_after_forward: bool = True
    reshard_root: bool = False
    param_dtype: str = "fp32"
    reduce_dtype: str | None = None
    cpu_offload: bool = False
    activation_checkpointing: str = "none"
    checkpoint_interval: int = 1
    compute_scale: float = 1.0

    @property
    def sharded(self) -> bool:
        return self.strategy in SHARDED

    @property
    def compute_dtype(self) -> str:
        """The dtype the model's parameters compute in: FSDP's ``param_dtype``, else fp32."""
        return self.param_dtype if self.strategy == "fsdp" else "fp32"

    def validate(self, cluster: ClusterSpec) -> Plan:
        """This plan with ``devices`` filled in (None: every device of the cluster), or
        :class:`OracleError` naming the bad field, its value and the fix."""
        devices = cluster.total_devices if self.devices is None else self.devices
        checks: list[tuple[bool, str, object, str]] = [
            (self.strategy in STRATEGIES, "strategy", self.strategy, f"one of {', '.join(STRATEGIES)}"),
            (self.algorithm == "auto" or self.algorithm in ALGORITHMS, "algorithm", self.algorithm,
             f"auto or one of {', '.join(ALGORITHMS)}"),
            (self.precision in PRECISION_BYTES, "precision", self.precision, f"one of {', '.join(PRECISION_BYTES)}"),
            (self.grad_dtype in GRAD_DTYPES, "grad_dtype", self.grad_dtype, f"one of {', '.join(GRAD_DTYPES)}"),
            (self.param_dtype in GRAD_DTYPES, "param_dtype", self.param_dtype, f"one of {', '.join(GRAD_DTYPES)}"),
            (self.reduce_dtype is None or self.reduce_dtype in GRAD_DTYPES, "reduce_dtype", self.reduce_dtype,
             f"one of {', '.join(GRAD_DTYPES)}"),
            (self.batch_size >= 1, "batch_size", self.batch_size, "an integer >= 1"),
            (1 <= devices <= cluster.total_devices, "devices", devices,
             f"between 1 and the {cluster.total_devices} devices of cluster {cluster.name!r}"),
            (self.servers >= 1, "servers", self.servers, "an integer >= 1"),
            (self.period >= 1, "period", self.period, "an integer >= 1"),
            (self.stages >= 1, "stages", self.stages, "an integer >= 1"),
            (self.micro_batches is None or self.micro_batches >= 1, "micro_batches", self.micro_batches,
             "an integer >= 1"),
            (self.strategy != "pipeline" or devices % self.stages == 0, "devices", devices,
             f"a multiple of the pipeline stages ({self.stages})"),
            (self.overlap is None or 0 <= self.overlap <= 1, "overlap", self.overlap, "in [0, 1]"),
            (self.bucket_mb >= 0, "bucket_mb", self.bucket_mb, ">= 0 (0: one all-reduce per parameter tensor)"),
            (self.dataset_size >= 1, "dataset_size", self.dataset_size, "an integer >= 1"),
            (self.epochs > 0, "epochs", self.epochs, "> 0"),
            (self.activation_checkpointing in CHECKPOINTING, "activation_checkpointing",
             self.activation_checkpointing, f"one of {', '.join(CHECKPOINTING)}"),
            (self.checkpoint_interval >= 1, "checkpoint_interval", self.checkpoint_interval, "an integer >= 1"),
            (self.compute_scale > 0, "compute_scale", self.compute_scale, "> 0"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise OracleError(f"{name} must be {rule}, but got {value!r}; change {name}")
        return replace(self, devices=devices)
