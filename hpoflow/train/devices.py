"""The GPUs a command trial's program sees (``hpoflow.train.command``): torchrun's device view.

Every engine gives each rank its own GPUs in the rank process's ``CUDA_VISIBLE_DEVICES`` (the local
engine's slots, a node agent's, a cluster node launcher's share, a SLURM step task's binding), and a
function trial keeps that view (``ctx.device``). torchrun instead leaves the node's GPUs visible and
a program picks ``cuda:LOCAL_RANK``. So a command trial's program gets the trial's GPUs on its node:

- ``CUDA_VISIBLE_DEVICES``: the own GPUs of the trial's ranks on this node, local rank 0's first,
  each GPU once (CUDA refuses a list that names a device twice). With whole GPUs per rank
  (``gpus_per_process: g``) entries ``g*LOCAL_RANK`` .. ``g*LOCAL_RANK+g-1`` are the rank's own, so
  ``cuda:LOCAL_RANK`` (``g`` = 1) is its GPU, as under torchrun.
- ``HPOFLOW_CUDA_DEVICE``: the index in that list of the rank's own (first) GPU, and
  ``HPOFLOW_CUDA_DEVICES`` of all of them (comma-separated). They equal ``LOCAL_RANK`` (``g*LOCAL_RANK``
  ..) wherever no two ranks of the trial on the node share a GPU. Where some do (a launcher with fewer
  GPUs than ranks shares them round-robin) the list still names each GPU once, ``cuda:LOCAL_RANK``
  no longer is the rank's own GPU, and ``HPOFLOW_CUDA_DEVICE`` is.
- A share ``1/k`` of a GPU (the local engine: the ranks of one trial are on different GPUs, each shared
  with ranks of other trials) is a GPU like any other here; the MPS memory limit the engine set for the
  rank's own device (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``, ``0=<MiB>M`` in the rank's view) is moved to
  that device's index in the program's list.
- MIG instances: CUDA enumerates one MIG instance per process, so a rank whose node has several keeps
  its own view (its instance, ``HPOFLOW_CUDA_DEVICE=0``).
- One rank, a rank without a GPU, ranks of a node that are not one block of ranks ``k*L`` ..
  ``k*L+L-1`` on one host (``L``: ``LOCAL_WORLD_SIZE``; every engine places ranks so; an ``srun
  --distribution`` of a site's could break it): the rank's own view, ``HPOFLOW_CUDA_DEVICE=0``.

The node's lists come from the ranks themselves: each publishes its own GPUs (as its
``CUDA_VISIBLE_DEVICES`` names them: every rank of a node names them in one numbering, the engine's
or the step's) and its host in the store of the process group the ranks of a command trial keep,
and reads its node's peers' (``gather_node_gpus``). No engine passes anything for it.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch._C._distributed_c10d import Store

log = logging.getLogger(__name__)

__all__ = ["DEVICES_ENV", "DEVICE_ENV", "DeviceView", "gather_node_gpus", "node_view", "own_view", "program_devices",
           "visible_ids"]

DEVICE_ENV = "HPOFLOW_CUDA_DEVICE"
DEVICES_ENV = "HPOFLOW_CUDA_DEVICES"
_KEY = "hpoflow/command/gpus/"
_MPS_LIMIT = "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"
_UUID_PREFIXES = ("GPU-", "MIG-")


def visible_ids(text: str | None) -> list[str]:
    """The devices a ``CUDA_VISIBLE_DEVICES`` value names, as written (indices, ``GPU-``/``MIG-`` UUIDs),
    each once; CUDA stops at the first entry that is neither (``-1``, a typo), and so does this."""
    out: list[str] = []
    for raw in (text or "").split(","):
        part = raw.strip()
        if not ((part.isascii() and part.isdigit()) or (part.startswith(_UUID_PREFIXES) and len(part) > 4
                                                         and part.isascii() and part.isprintable())):
            break
        if part not in out:
            out.append(part)
    return out


@dataclass(frozen=True)
class DeviceView:
    """What a program sees: ``visible`` (its ``CUDA_VISIBLE_DEVICES``, in order) and ``own`` (the indices in
    it of the rank's own GPUs)."""

    visible: tuple[str, ...]
    own: tuple[int, ...]

    def env(self, rank_env: Mapping[str, str], own_ids: Sequence[str]) -> dict[str, str]:
        """The variables that give a program this view, for a rank whose environment is ``rank_env`` and
        whose own GPUs are ``own_ids``: ``CUDA_VISIBLE_DEVICES``, ``HPOFLOW_CUDA_DEVICE(S)``, and an MPS
        memory limit of the rank's view moved to the program's indices."""
        out = {"CUDA_VISIBLE_DEVICES": ",".join(self.visible), DEVICE_ENV: str(self.own[0]),
               DEVICES_ENV: ",".join(str(i) for i in self.own)}
        limit = rank_env.get(_MPS_LIMIT)
        if limit is not None:
            out[_MPS_LIMIT] = _moved_limit(limit, own_ids, self)
        return out


def _moved_limit(limit: str, own_ids: Sequence[str], view: DeviceView) -> str:
    """``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`` of the rank's view (``0=2048M,1=1G``: ordinals of its own GPUs)
    in the program's: each ordinal becomes that GPU's index in ``view``; a bare value (every device)
    stays; an ordinal the rank did not have is dropped."""
    parts: list[str] = []
    for raw in limit.split(","):
        item = raw.strip()
        ordinal, sep, value = item.partition("=")
        if not sep:
            if item:
                parts.append(item)
            continue
        ordinal = ordinal.strip()
        if ordinal.isascii() and ordinal.isdigit() and int(ordinal) < len(own_ids):
            parts.append(f"{view.visible.index(own_ids[int(ordinal)])}={value.strip()}")
    return ",".join(parts)


def own_view(own: Sequence[str]) -> DeviceView | None:
    """A rank's own GPUs as the whole view (one rank; MIG; no node list): None without a GPU."""
    return DeviceView(tuple(own), tuple(range(len(own)))) if own else None


def node_view(peers: Sequence[Sequence[str]], local_rank: int) -> DeviceView | None:
    """The view of local rank ``local_rank`` of a node whose ranks' own GPUs are ``peers`` (local rank
    ``k``'s at ``peers[k]``): every GPU of the node's ranks once, in local-rank order, and the indices of
    its own in it. None when the rank has no GPU (its view is left as it is). ``ValueError`` for a local
    rank ``peers`` does not hold. Several MIG instances on the node: the rank's own view (see the
    module docstring)."""
    if not 0 <= local_rank < len(peers):
        raise ValueError(f"local rank {local_rank} is not one of the node's {len(peers)} rank(s)")
    own = list(peers[local_rank])
    if not own:
        return None
    visible = list(dict.fromkeys(g for p in peers for g in p))
    if len(visible) > 1 and any(g.startswith("MIG-") for g in visible):
        return own_view(own)
    return DeviceView(tuple(visible), tuple(visible.index(g) for g in own))


def _node_name(env: Mapping[str, str]) -> str:
    return env.get("SLURMD_NODENAME") or env.get("HPOFLOW_NODE_NAME") or socket.gethostname()


def gather_node_gpus(store: Store, rank: int, local_rank: int, world: int, local_world: int, own: Sequence[str],
                     node: str) -> list[list[str]] | None:
    """Publish this rank's own GPUs in ``store`` and read those of the other ranks of its node, the block
    of ``local_world`` ranks that holds ``rank`` (waiting for each as long as the store waits: every rank
    of a command trial publishes before it reads). The node's lists by local rank, or None (logged)
    where the block is not one node's ranks in local-rank order (its own view then)."""
    store.set(f"{_KEY}{rank}", json.dumps({"node": node, "local_rank": local_rank, "gpus": list(own)}))
    first = rank - rank % local_world
    peers: list[list[str]] = []
    for r in range(first, min(world, first + local_world)):
        seen = json.loads(store.get(f"{_KEY}{r}").decode())
        if seen.get("node") != node or seen.get("local_rank") != r - first:
            log.warning("command: rank %d: rank %d is local rank %s on %s, not local rank %d on %s: the ranks of "
                        "a node are not one block of LOCAL_WORLD_SIZE=%d ranks; the program sees this rank's own "
                        "GPUs only", rank, r, seen.get("local_rank"), seen.get("node"), r - first, node, local_world)
            return None
        peers.append([str(g) for g in seen.get("gpus") or []])
    return peers


def program_devices(rank: int, local_rank: int, world: int, local_world: int, gpus_per_process: float,
                    rank_env: Mapping[str, str] | None = None, store: Store | None = None) -> dict[str, str]:
    """The device variables of a command trial's program (see the module docstring), from this rank's
    environment (``rank_env``, default ``os.environ``: its ``CUDA_VISIBLE_DEVICES`` names its own GPUs)
    and, for a trial of several ranks with GPUs, its node's peers' GPUs through ``store`` (default: the
    store of this process's group, ``hpoflow.train.dist.group_store``). Empty for a rank without a GPU:
    its environment stays as it is."""
    env = os.environ if rank_env is None else rank_env
    own = visible_ids(env.get("CUDA_VISIBLE_DEVICES"))
    if gpus_per_process <= 0:
        return {}
    view = own_view(own)
    if world > 1 and local_world > 1:
        if store is None:
            from hpoflow.train.dist import group_store

            store = group_store()
        peers = gather_node_gpus(store, rank, local_rank, world, local_world, own, _node_name(env))
        if peers is not None:
            view = node_view(peers, local_rank)
    if view is None:
        return {}
    log.info("command: rank %d (local rank %d) has GPU(s) %s; its program sees CUDA_VISIBLE_DEVICES=%s, its own "
             "at %s", rank, local_rank, ",".join(own), ",".join(view.visible), ",".join(str(i) for i in view.own))
    return view.env(env, own)
