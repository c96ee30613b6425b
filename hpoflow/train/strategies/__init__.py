"""Data-parallel strategies: how the ranks of one trial combine their work.

``make_strategy(name, options, env)`` builds one from ``hpoflow.registry.STRATEGIES``;
``register_strategy(cls, options_model)`` adds an implementation (it checks the class keeps the
contract of ``_base.Strategy``); unknown names give an error listing the valid ones. The spec's
``TrainConfig`` validates the options through the registry's options model (torch-free, built-ins in
``hpoflow.train.options``) before a trial starts.

``ZeRO1`` and ``FSDP`` are imported on first use (``torch.distributed.optim``, ``.fsdp`` and
``.checkpoint`` take about a second to import), so a trial of another strategy never pays for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from hpoflow.registry import STRATEGIES, NoOptions, Options
from hpoflow.train.strategies._allreduce import AllReduce
from hpoflow.train.strategies._base import CommMeter, OptimizerLike, Strategy, StrategyEnv
from hpoflow.train.strategies._easgd import EASGD
from hpoflow.train.strategies._local_sgd import LocalSGD
from hpoflow.train.strategies._parameter_server import ParameterServer

if TYPE_CHECKING:
    from hpoflow.train.strategies._fsdp import FSDP
    from hpoflow.train.strategies._sharded_state import ShardedTemplate
    from hpoflow.train.strategies._zero1 import ZeRO1

__all__ = [
    "EASGD",
    "FSDP",
    "AllReduce",
    "CommMeter",
    "LocalSGD",
    "OptimizerLike",
    "ParameterServer",
    "ShardedTemplate",
    "Strategy",
    "StrategyEnv",
    "ZeRO1",
    "make_strategy",
    "register_strategy",
    "strategy_names",
]

_LAZY = {"ZeRO1": "hpoflow.train.strategies._zero1", "FSDP": "hpoflow.train.strategies._fsdp",
         "ShardedTemplate": "hpoflow.train.strategies._sharded_state"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def register_strategy(cls: type[Strategy], options: type[Options] = NoOptions) -> type[Strategy]:
    """Register ``cls`` under ``cls.name`` in ``hpoflow.registry.STRATEGIES`` with its options model;
    it must subclass ``Strategy`` and have a valid name that no other strategy holds."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"a strategy must subclass hpoflow.train.strategies.Strategy, got {cls!r}")
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name.isidentifier() or name == Strategy.name:
        raise ValueError(f"{cls.__name__}.name must be a new identifier, got {name!r}")
    STRATEGIES.register(name, cls, options)
    return cls


def strategy_names() -> list[str]:
    return STRATEGIES.names()


def make_strategy(name: str, options: Mapping[str, Any], env: StrategyEnv) -> Strategy:
    """Build strategy ``name`` for this rank; an unknown name raises ``ValueError`` listing all."""
    if name not in STRATEGIES:
        raise ValueError(STRATEGIES.unknown(name))
    return STRATEGIES.get(name)(options, env)
