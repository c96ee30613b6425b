"""This rank's shard of a sharded model and optimizer, as plain tensors for a per-rank checkpoint.

``fsdp`` keeps parameters, gradients and optimizer state as ``DTensor`` shards. Its checkpoint state
comes from ``torch.distributed.checkpoint.state_dict.get_state_dict`` (sharded, not gathered:
``full_state_dict=False``), with every ``DTensor`` replaced by its local shard (``to_local()``), so it
is plain tensors keyed by parameter name that ``hpoflow.train.checkpoint`` writes into this rank's
file and reads back with ``torch.load(weights_only=True)``. Loading takes the state the model and
optimizer have now as the template (``get_state_dict`` again: it also creates the optimizer's state
if no step has run), rebuilds each ``DTensor`` from the saved shard with the template's mesh,
placements, shape and stride, and hands the result to ``set_state_dict``. A shard whose shape is not
the template's (another world size, another model) is refused with ``ValueError``.

Both functions are collectives where DCP's are (every rank calls them at the same point). A
checkpoint format that writes DCP itself (``torch.distributed.checkpoint.save``) can take
``get_state_dict``'s output directly: these two are the only places the trainer's sharded state goes
through.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

__all__ = ["check_same_world", "load_sharded_state", "sharded_state"]

_OPTIONS = StateDictOptions(full_state_dict=False, cpu_offload=False)


def _local(tree: Any) -> Any:
    """``tree`` with every DTensor replaced by this rank's shard."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, Mapping):
        return {k: _local(v) for k, v in tree.items()}
    if isinstance(tree, list | tuple):
        return type(tree)(_local(v) for v in tree)
    return tree


def _rebuild(saved: Any, template: Any, where: str) -> Any:
    """``saved`` (local shards) as the template's DTensors; plain values as saved."""
    if isinstance(template, DTensor):
        if not isinstance(saved, torch.Tensor):
            raise ValueError(f"checkpoint: {where} is {type(saved).__name__}, expected this rank's tensor shard")
        local = template.to_local()
        if tuple(saved.shape) != tuple(local.shape):
            raise ValueError(
                f"checkpoint: the shard of {where} has shape {tuple(saved.shape)}, but this rank's shard is "
                f"{tuple(local.shape)} (written on another number of ranks or by another model). Fix: resume "
                "with the same resources.processes and model, or delete the checkpoint directory to start over")
        return DTensor.from_local(saved.to(local.device, local.dtype), template.device_mesh, template.placements,
                                  run_check=False, shape=template.shape, stride=template.stride())
    if isinstance(template, Mapping) and isinstance(saved, Mapping):
        missing = sorted(str(k) for k in template if k not in saved)
        if missing and all(isinstance(template[k], DTensor) for k in missing):
            raise ValueError(f"checkpoint: {where} lacks {', '.join(missing[:5])}: written by another model")
        return {k: _rebuild(v, template.get(k), f"{where}.{k}") for k, v in saved.items()}
    return saved


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optimizer": ...}``: this rank's shards, plain tensors keyed by parameter name."""
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
    return {"model": _local(msd), "optimizer": _local(osd)}


def load_sharded_state(state: Mapping[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Restore ``sharded_state``'s output into the same sharding of the same model."""
    msd, osd = get_state_dict(model, optimizer, options=_OPTIONS)
    set_state_dict(model, optimizer, model_state_dict=_rebuild(state["model"], msd, "model"),
                   optim_state_dict=_rebuild(state["optimizer"], osd, "optimizer"), options=_OPTIONS)


def check_same_world(strategy: str, state: Mapping[str, Any], world: int) -> None:
    """``ValueError`` (rule, values, fix) when a strategy state saved with ``"ranks"`` (its shards' world
    size) is loaded into a trial of another world size."""
    if int(state.get("ranks", world)) != world:
        raise ValueError(
            f"checkpoint: {strategy} state was sharded over {state.get('ranks')} ranks, but this trial has "
            f"{world}. Fix: resume with the same resources.processes, or delete the checkpoint directory to "
            "start over")
