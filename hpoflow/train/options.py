"""Options models of the built-in strategies and models (pydantic only: the spec imports this module).

``training.strategy_options`` is validated by the chosen strategy's model, ``training.model_options``
by the built-in model's; registry entries in ``hpoflow.registry`` (``STRATEGIES``, ``MODELS``) point
here. docs/strategies.md explains each option. A strategy's ``oracle_plan()`` says how the
parallelism oracle prices it (the fields of ``hpoflow.oracle.Plan``); a strategy without one is not
judged by the oracle. A model's options model may say which data sets it trains on with a class
attribute ``task`` (``classify``, the default, or ``next_token``): the spec checks it against the
data set's task at validate time.
"""

from __future__ import annotations

import importlib.util
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from hpoflow.registry import Options

__all__ = [
    "AllReduceOptions",
    "CNNOptions",
    "EASGDOptions",
    "FSDPOptions",
    "GPTOptions",
    "LocalSGDOptions",
    "MLPOptions",
    "ParameterServerOptions",
    "ZeRO1Options",
]


class AllReduceOptions(Options):
    """Synchronous all-reduce (torch DDP)."""

    bucket_cap_mb: float = Field(default=25.0, gt=0)
    gradient_as_bucket_view: bool = False
    compression: Literal["none", "fp16", "bf16", "powersgd"] = "none"
    powersgd_rank: int = Field(default=1, ge=1)
    powersgd_start_iter: int = Field(default=2, ge=2)

    def oracle_plan(self) -> dict[str, Any]:
        """How the oracle prices this strategy: ``hpoflow.oracle.Plan`` fields. DDP's buckets, and its
        compression hooks' all-reduce dtype (PowerSGD's low-rank factors are not modelled: priced as
        fp32); the algorithm is the fastest applicable, as NCCL picks it."""
        dtype = self.compression if self.compression in ("fp16", "bf16") else "fp32"
        return {"strategy": "allreduce", "bucket_mb": self.bucket_cap_mb, "grad_dtype": dtype}


class ParameterServerOptions(Options):
    """Synchronous parameter server, sharded over ``servers`` ranks."""

    servers: int = Field(default=1, ge=1)

    def oracle_plan(self) -> dict[str, Any]:
        return {"strategy": "ps", "servers": self.servers}


class EASGDOptions(Options):
    """Elastic averaging SGD: ``alpha`` (or ``rho``, alpha = lr * rho), exchange every ``tau`` steps."""

    alpha: float | None = Field(default=None, gt=0, lt=1)
    rho: float | None = Field(default=None, gt=0)
    tau: int = Field(default=4, ge=1)
    momentum: bool = False
    momentum_coefficient: float = Field(default=0.9, ge=0, lt=1)

    def oracle_plan(self) -> dict[str, Any]:
        return {"strategy": "easgd", "period": self.tau}

    @model_validator(mode="after")
    def _alpha_or_rho(self) -> EASGDOptions:
        if self.alpha is not None and self.rho is not None:
            raise ValueError(f"easgd takes alpha or rho (alpha = lr * rho), not both, but got alpha={self.alpha}, "
                             f"rho={self.rho}. Fix: remove one")
        return self


class LocalSGDOptions(Options):
    """Local SGD: average the models every ``period`` steps."""

    period: int = Field(default=8, ge=1)

    def oracle_plan(self) -> dict[str, Any]:
        """Local SGD exchanges the whole model every ``period`` steps: priced as the oracle's
        periodic exchange (its ``easgd`` model) with that period."""
        return {"strategy": "easgd", "period": self.period}


class ZeRO1Options(Options):
    """ZeRO stage 1: gradients all-reduced by DDP, the optimizer state sharded over the ranks
    (``torch.distributed.optim.ZeroRedundancyOptimizer``). ``reduce_dtype``: the dtype the (fp32)
    gradients are all-reduced in (bf16, fp16: DDP's compression hooks), fp32 whatever the precision."""

    #: its optimizer state is sharded over the ranks: checkpoints through a format that keeps sharded state
    sharded: ClassVar[bool] = True

    bucket_cap_mb: float = Field(default=25.0, gt=0)
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"

    def oracle_plan(self) -> dict[str, Any]:
        """Priced as ZeRO-1: DDP's all-reduce of the gradients (its buckets, in ``reduce_dtype``),
        optimizer state / p per rank, and each rank's updated shard broadcast after the step."""
        return {"strategy": "zero1", "bucket_mb": self.bucket_cap_mb, "grad_dtype": self.reduce_dtype}


_FSDP2_COLLECTIVES = "torch.distributed.fsdp._fully_shard._fsdp_collectives"


class FSDPOptions(Options):
    """FSDP2 (``torch.distributed.fsdp.fully_shard``) per block: parameters, gradients and optimizer
    state sharded; each block's parameters all-gathered for its forward (and again for its backward
    when ``reshard_after_forward``), its gradients reduce-scattered. ``mixed_precision``: the dtype
    parameters are gathered and computed in (FSDP2's ``param_dtype``); ``reduce_dtype``: the dtype
    gradients are reduce-scattered in, fp32 by default whatever ``mixed_precision`` is (torchtitan's
    default: a sum of p low-precision gradients loses their low bits)."""

    #: parameters, gradients and optimizer state sharded: checkpoints through a format that keeps sharded state
    sharded: ClassVar[bool] = True

    reshard_after_forward: bool = True
    mixed_precision: Literal["none", "bf16", "fp16"] = "none"
    reduce_dtype: Literal["fp32", "bf16", "fp16"] = "fp32"
    cpu_offload: bool = False

    @model_validator(mode="after")
    def _fsdp2_here(self) -> FSDPOptions:
        """The strategy imports FSDP2 and its collectives (``hpoflow.train.strategies._fsdp``): a torch
        without them is refused at validate time, not in every trial's ranks."""
        try:
            found = importlib.util.find_spec(_FSDP2_COLLECTIVES) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            import torch

            raise ValueError(f"strategy fsdp needs FSDP2 (torch.distributed.fsdp.fully_shard) and its collectives "
                             f"({_FSDP2_COLLECTIVES}), which torch {torch.__version__} lacks. Fix: install a newer "
                             "torch (hpoflow is tested with 2.13), or use strategy allreduce or zero1")
        return self

    def oracle_plan(self) -> dict[str, Any]:
        dtype = "fp32" if self.mixed_precision == "none" else self.mixed_precision
        return {"strategy": "fsdp", "reshard_after_forward": self.reshard_after_forward, "param_dtype": dtype,
                "reduce_dtype": self.reduce_dtype, "cpu_offload": self.cpu_offload}


class MLPOptions(Options):
    """The built-in MLP: ``depth`` hidden layers of ``hidden`` units."""

    hidden: int = Field(default=128, ge=1)
    depth: int = Field(default=2, ge=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)


class CNNOptions(Options):
    """The built-in CNN: two 3x3 convolutions, a 2x2 max-pool, two linear layers."""

    channels: int = Field(default=32, ge=1)
    hidden: int = Field(default=128, ge=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)


class GPTOptions(Options):
    """The built-in GPT-style decoder: ``layers`` blocks of ``heads`` attention heads over ``width``
    channels, trained on windows of ``context`` tokens (dataset: chars)."""

    task: ClassVar[str] = "next_token"

    layers: int = Field(default=2, ge=1, le=96)
    heads: int = Field(default=4, ge=1)
    width: int = Field(default=128, ge=1)
    context: int = Field(default=64, ge=2, le=4096)
    dropout: float = Field(default=0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _heads_divide_width(self) -> GPTOptions:
        if self.width % self.heads:
            fit = self.heads * max(1, round(self.width / self.heads))
            raise ValueError(f"width must be a multiple of heads (each head takes width / heads channels), but "
                             f"got width={self.width}, heads={self.heads}. Fix: e.g. width={fit}")
        return self
