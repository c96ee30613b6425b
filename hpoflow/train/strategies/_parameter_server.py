"""``parameter_server``: synchronous parameter server with the parameters sharded over servers.

Roles: every rank is a worker, and ranks ``0 .. servers-1`` also each serve one shard of the
parameters (co-located servers: the local engine and ``srun`` start exactly ``processes`` ranks, and
a dedicated server would idle a core while the workers compute). Parameters are assigned whole to
the least-loaded server, largest first, so shards are balanced in bytes and the same on every rank.

One step, with point-to-point messages over the trial's process group:
1. push: every worker sends its gradients of shard ``s`` to server ``s`` (a server keeps its own);
2. update: server ``s`` averages the ``p`` gradients of its shard and runs the optimizer on the
   shard only (optimizer state for a parameter lives on its server alone);
3. pull: server ``s`` sends the updated shard to every worker, which copies it into its model.
A worker sends ``M - M_own`` bytes, a server additionally ``(p - 1) * M_s``: with one server it
sends ``(p - 1) * M`` per step against ``2 (p - 1) / p * M`` for a ring all-reduce: the
bottleneck the research measures. Each worker moves ``2 M`` (push + pull) when it serves nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from hpoflow.train.strategies._base import OptimizerLike, Strategy

__all__ = ["ParameterServer", "shard_parameters"]


def shard_parameters(sizes: list[int], servers: int) -> list[int]:
    """Server of each parameter: largest first onto the least-loaded server (ties: lowest rank)."""
    load = [0] * servers
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(servers), key=lambda s: (load[s], s))
        owner[i] = s
        load[s] += sizes[i]
    return owner


class ParameterServer(Strategy):
    """Options: ``servers`` (how many of the first ranks also serve a shard; default 1)."""

    name = "parameter_server"

    def wrap(self, model: nn.Module) -> nn.Module:
        self._attach(model)
        world = self.env.world_size
        self.servers = int(self.options.get("servers", 1))
        if self.distributed and self.servers > world:
            raise ValueError(
                f"parameter_server: servers <= processes must hold, but got servers={self.servers} "
                f"with {world} processes (servers are the first ranks). Fix: lower "
                "training.strategy_options.servers or raise resources.processes")
        self.servers = min(self.servers, world)
        sizes = [p.numel() * p.element_size() for p in self.params]
        self.owner = shard_parameters(sizes, self.servers)
        self.shards = [[p for p, o in zip(self.params, self.owner, strict=True) if o == s]
                       for s in range(self.servers)]
        self._broadcast_params()
        return model

    def state_dict(self) -> dict[str, Any]:
        """The shard layout, to check a resume against (a shard's optimizer state lives in its
        server rank's optimizer, which that rank checkpoints)."""
        return {**super().state_dict(), "servers": self.servers, "owner": list(self.owner)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        saved = (int(state["servers"]), [int(o) for o in state["owner"]])
        if saved != (self.servers, self.owner):
            raise ValueError(
                f"checkpoint: parameter_server state has servers={saved[0]} and shard owners {saved[1]}, but "
                f"this trial has servers={self.servers} and {self.owner}. Fix: resume with the same model, "
                "strategy_options.servers and processes")

    def _shard_bytes(self, s: int) -> int:
        return sum(p.numel() * p.element_size() for p in self.shards[s])

    @staticmethod
    def _flat_grads(params: list[nn.Parameter]) -> torch.Tensor:
        return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                          for p in params])

    def after_backward(self) -> None:
        """Push: gradients to their servers; each server averages its shard's gradients."""
        if not self.distributed:
            return
        rank, world = self.env.rank, self.env.world_size
        estimate = sum(self._shard_bytes(s) for s in range(self.servers) if s != rank)
        with self.meter.timed(estimate):
            works, inbox = [], []
            own: torch.Tensor | None = None
            for s, shard in enumerate(self.shards):
                if not shard:
                    continue
                flat = self._flat_grads(shard)
                if rank == s:
                    for w in range(world):
                        if w != s:
                            buf = torch.empty_like(flat)
                            inbox.append(buf)
                            works.append(dist.irecv(buf, src=w, tag=s))
                    own = flat
                else:
                    works.append(dist.isend(flat, dst=s, tag=s))
            for work in works:
                if work is not None:  # None only for ranks outside the group
                    work.wait()
        if own is not None:
            total = own.clone()
            for buf in inbox:
                total += buf
            total /= world
            i = 0
            for p in self.shards[rank]:
                n = p.numel()
                p.grad = total[i : i + n].view_as(p).clone()
                i += n

    def step(self, optimizer: OptimizerLike) -> None:
        """Update on the servers (their shard only), then pull the new parameters everywhere."""
        rank, world = self.env.rank, self.env.world_size
        if not self.distributed:
            optimizer.step()
            return
        if rank < self.servers:
            mine = {id(p) for p in self.shards[rank]}
            for p in self.params:
                if id(p) not in mine:
                    p.grad = None  # only the shard's owner updates it
            optimizer.step()
        estimate = (world - 1) * self._shard_bytes(rank) if rank < self.servers else 0
        with self.meter.timed(estimate):
            works, pulls = [], []
            for s, shard in enumerate(self.shards):
                if not shard:
                    continue
                if rank == s:
                    flat = torch.cat([p.detach().reshape(-1) for p in shard])
                    works += [dist.isend(flat, dst=w, tag=self.servers + s)
                              for w in range(world) if w != s]
                else:
                    buf = torch.empty(sum(p.numel() for p in shard), dtype=shard[0].dtype)
                    pulls.append((shard, buf))
                    works.append(dist.irecv(buf, src=s, tag=self.servers + s))
            for work in works:
                if work is not None:  # None only for ranks outside the group
                    work.wait()
        with torch.no_grad():
            for shard, buf in pulls:
                i = 0
                for p in shard:
                    n = p.numel()
                    p.copy_(buf[i : i + n].view_as(p))
                    i += n

    def theoretical_bytes_per_step(self) -> float:
        if not self.distributed:
            return 0.0
        rank, world = self.env.rank, self.env.world_size
        push = sum(self._shard_bytes(s) for s in range(self.servers) if s != rank)
        serve = (world - 1) * self._shard_bytes(rank) if rank < self.servers else 0
        return float(push + serve)
