"""Data-parallel strategies: how the ranks of one trial combine their work.

``make_strategy(name, options, env)`` builds one; ``register_strategy`` adds an implementation (it
checks the class keeps the contract of ``_base.Strategy``); unknown names give an error listing the
valid ones. The spec's ``TrainConfig`` validates the options (torch-free) before a trial starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hpoflow.train.strategies._allreduce import AllReduce
from hpoflow.train.strategies._base import CommMeter, OptimizerLike, Strategy, StrategyEnv
from hpoflow.train.strategies._easgd import EASGD
from hpoflow.train.strategies._local_sgd import LocalSGD
from hpoflow.train.strategies._parameter_server import ParameterServer

__all__ = [
    "EASGD",
    "AllReduce",
    "CommMeter",
    "LocalSGD",
    "OptimizerLike",
    "ParameterServer",
    "Strategy",
    "StrategyEnv",
    "make_strategy",
    "register_strategy",
    "strategy_names",
]

_REGISTRY: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Add ``cls`` under ``cls.name``; it must subclass ``Strategy`` and have a new, valid name."""
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"a strategy must subclass hpoflow.train.strategies.Strategy, got {cls!r}")
    name = getattr(cls, "name", "")
    if not isinstance(name, str) or not name.isidentifier() or name == Strategy.name:
        raise ValueError(f"{cls.__name__}.name must be a new identifier, got {name!r}")
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise ValueError(f"strategy {name!r} is already registered ({_REGISTRY[name].__name__})")
    _REGISTRY[name] = cls
    return cls


def strategy_names() -> list[str]:
    return sorted(_REGISTRY)


def make_strategy(name: str, options: Mapping[str, Any], env: StrategyEnv) -> Strategy:
    """Build strategy ``name`` for this rank; an unknown name raises ``ValueError`` listing all."""
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown strategy {name!r}; valid strategies: "
                         f"{', '.join(strategy_names())}") from None
    return cls(options, env)


for _cls in (AllReduce, ParameterServer, EASGD, LocalSGD):
    register_strategy(_cls)
