"""A state split into its tensors and a JSON *skeleton*: how ``safetensors`` and ``dcp`` store what is
not a tensor without pickle.

``flatten(state, prefix)`` returns ``(tensors, skeleton)``: every tensor under a unique dotted name
built from its path (``prefix.model.conv1.weight``), and the rest of the state as JSON-able nodes:
``None``, ``bool``, ``int``, ``float`` (``NaN`` and infinities included), ``str`` as themselves; a tensor
as ``{"T": name}``; a dict as ``{"D": [[key, value], ...]}`` (keys of any atom type: an optimizer's
state is keyed by ints); a list as ``{"L": [...]}``, a tuple as ``{"U": [...]}``. ``unflatten``
rebuilds the state exactly (types, key order, tuples). A state may hold what ``snapshot`` accepts
(tensors, numbers, strings, ``None`` and dicts/lists/tuples of them; NumPy scalars become numbers);
anything else is refused with the same ``TypeError``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import torch

from hpoflow.train.checkpoint._base import CorruptCheckpoint
from hpoflow.train.checkpoint._file import plain_atom

__all__ = ["flatten", "from_json_tensor", "json_tensor", "unflatten"]



def _refuse(obj: Any, where: str) -> TypeError:
    return TypeError(
        f"checkpoint {where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds only "
        "tensors, numbers, strings, None and dicts/lists/tuples of them (it is loaded without running any "
        "pickled code). Fix: convert it, e.g. torch.as_tensor(x) for a numpy array, or save its state_dict() "
        "instead of the object")




def flatten(state: Any, prefix: str) -> tuple[dict[str, torch.Tensor], Any]:
    """``(tensors by name, skeleton)`` of ``state``; names start with ``prefix`` (and a dot, unless it is empty)."""
    tensors: dict[str, torch.Tensor] = {}

    def name_for(path: str) -> str:
        name, n = path, 1
        while name in tensors:
            n += 1
            name = f"{path}#{n}"
        return name

    def walk(obj: Any, path: str, where: str) -> Any:
        if isinstance(obj, torch.Tensor):
            name = name_for(path)
            tensors[name] = obj
            return {"T": name}
        atom = plain_atom(obj)
        if atom is not NotImplemented:
            return atom
        if isinstance(obj, Mapping):
            items = []
            for k, v in obj.items():
                key = plain_atom(k)
                if key is NotImplemented:
                    raise _refuse(k, f"{where} key {k!r}")
                items.append([key, walk(v, f"{path}.{k}" if path else str(k), f"{where}[{k!r}]")])
            return {"D": items}
        if isinstance(obj, list | tuple):
            return {"L" if isinstance(obj, list) else "U":
                    [walk(v, f"{path}.{i}" if path else str(i), f"{where}[{i}]") for i, v in enumerate(obj)]}
        raise _refuse(obj, where)

    return tensors, walk(state, prefix, "state")


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The state ``flatten`` split into ``skeleton`` and ``tensors`` (``CorruptCheckpoint`` if they do not fit)."""
    if skeleton is None or isinstance(skeleton, bool | int | float | str):
        return skeleton
    if isinstance(skeleton, dict) and len(skeleton) == 1:
        (tag, body), = skeleton.items()
        if tag == "T" and isinstance(body, str):
            if body not in tensors:
                raise CorruptCheckpoint(f"the checkpoint names tensor {body!r}, which it does not hold")
            return tensors[body]
        if tag == "D" and isinstance(body, list):
            return {unflatten(k, tensors): unflatten(v, tensors) for k, v in body}
        if tag == "L" and isinstance(body, list):
            return [unflatten(v, tensors) for v in body]
        if tag == "U" and isinstance(body, list):
            return tuple(unflatten(v, tensors) for v in body)
    raise CorruptCheckpoint(f"the checkpoint's skeleton holds {str(skeleton)[:80]!r}, which is not a state node")


def json_tensor(obj: Any) -> torch.Tensor:
    """``obj`` (JSON-able) as a uint8 tensor of its UTF-8 JSON text."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def from_json_tensor(t: torch.Tensor, source: str) -> Any:
    try:
        return json.loads(bytes(t.numpy().tobytes()).decode())
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpoint(f"{source}: its JSON skeleton does not parse ({exc})") from exc
