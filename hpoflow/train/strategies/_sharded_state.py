"""A sharded model's and optimizer's state for a checkpoint: ``fsdp`` and ``zero1`` through
``torch.distributed.checkpoint`` (DCP; the ``dcp`` checkpoint format writes and reads it).

``sharded_items(model, optimizer)`` is this rank's part of the state as one flat mapping of names to
tensors: ``model.<fqn>`` (``fsdp``: ``DTensor`` shards; ``zero1``: the replicated tensors, the same on
every rank) and ``optimizer.<fqn>.<key>`` (each parameter's optimizer state under the parameter's name,
``step`` included: ``fsdp``'s ``DTensor`` shards; ``zero1``: the parameters of this rank's share only),
from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (``full_state_dict=False``). DCP
writes each name once (a name several ranks hold from one of them; a ``DTensor`` each shard from its
rank) with its whole shape, so a load may split it otherwise.

``ShardedTemplate(model, optimizer)`` is what a resume reads into: the same names at this rank's
sharding now (another world size reshards: DCP reads the part of each saved chunk that overlaps each
local one), built on the first ``items()`` call with the optimizer's state created if no step has run
(``get_state_dict``'s zero-gradient step at lr 0); ``apply()`` hands what was read to
``set_state_dict``, and ``discard()`` drops a created optimizer state again when no checkpoint was read
after all. The optimizer's parameter groups (learning rate, betas ...) are not saved: the built-in
trainer sets them from the config at every epoch and step.

These functions are local (no collective): the same calls work on 1 rank, where the model and the
optimizer are plain ones, so a checkpoint of any world size resumes on any other.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

__all__ = ["ShardedTemplate", "sharded_items"]

_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)


def _flat(tree: Mapping[str, Any], prefix: str, out: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of ``tree`` by dotted path (what is not a tensor is left out)."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            _flat(value, f"{prefix}{key}.", out)
        elif isinstance(value, torch.Tensor):
            out[f"{prefix}{key}"] = value
    return out


def _items(model_state: Mapping[str, Any], optim_state: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    out = _flat(model_state, "model.", {})
    return _flat(optim_state.get("state", {}), "optimizer.", out)


def sharded_items(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's part of the model's and the optimizer's state, flat by name (module docs)."""
    model_state, optim_state = get_state_dict(model, optimizer, options=_OPTIONS)
    return _items(model_state, optim_state)


class ShardedTemplate:
    """What a resume reads into, at this rank's current sharding (module docs)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._state: tuple[dict[str, Any], Any] | None = None
        self._created = False

    def items(self) -> dict[str, torch.Tensor]:
        """The tensors to read, by name; reading into them (in place) fills the template."""
        if self._state is None:
            self._created = not self.optimizer.state
            self._state = get_state_dict(self.model, self.optimizer, options=_OPTIONS)
        return _items(*self._state)

    def apply(self) -> None:
        """Load what was read into the model and the optimizer."""
        if self._state is None:
            raise RuntimeError("ShardedTemplate.apply() before items(): nothing was read")
        model_state, optim_state = self._state
        set_state_dict(self.model, self.optimizer, model_state_dict=model_state, optim_state_dict=optim_state,
                       options=_OPTIONS)
        self._created = False

    def discard(self) -> None:
        """No checkpoint was read: forget the optimizer state ``items()`` created (a fresh start)."""
        if self._created:
            self.optimizer.state.clear()
        self._state, self._created = None, False
