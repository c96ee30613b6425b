"""``fsdp`` sharded from the start (``hpoflow.train.strategies._sharded_init``), in one process: each
rank's build holds only its rows of every tensor, and the rows of all ranks put together are bitwise
a replica's build with the same seed (the built-in models, even and uneven splits); the generator
ends where a replica's build leaves it; an initialisation that needs a whole tensor is refused with
the generator restored. With real ranks: tests/train/test_strategies_sharded.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from hpoflow.train.models import build_model
from hpoflow.train.strategies._sharded_init import NotShardable, build_sharded, shard_rows

BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "gpt": lambda: build_model("gpt", (16,), 56, layers=2, heads=2, width=24, context=16),
    "cnn": lambda: build_model("cnn", (1, 8, 8), 10, channels=6, hidden=20),
    "mlp": lambda: build_model("mlp", (1, 8, 8), 10, hidden=30, depth=2),
}


def test_shard_rows_are_fsdp2s_chunks() -> None:
    for n in (1, 5, 8, 13):
        for world in (1, 2, 3, 4, 7):
            chunks = torch.arange(n).chunk(world)  # what fully_shard keeps on each rank (dim 0)
            for rank in range(world):
                a, b = shard_rows(n, world, rank)
                want = chunks[rank].tolist() if rank < len(chunks) else []
                assert list(range(a, b)) == want, (n, world, rank)


@pytest.mark.parametrize("model", list(BUILDERS))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_ranks_rows_put_together_are_a_replicas_build(model: str, world: int) -> None:
    build = BUILDERS[model]
    torch.manual_seed(11)
    replica = build()
    after = torch.get_rng_state()
    rows: list[dict[str, torch.Tensor]] = []
    for rank in range(world):
        torch.manual_seed(11)
        built = build_sharded(build, world, rank)
        assert torch.equal(torch.get_rng_state(), after)  # the generator advanced as in the replica's build
        assert all(t.is_meta for t in built.model.parameters())
        assert not built.whole  # every tensor of these models is built in rows
        for name, t in built.rows.items():
            a, b = shard_rows(replica.get_parameter(name).shape[0], world, rank)
            assert t.shape[0] == b - a, (name, rank)
        rows.append(built.rows)
    for name, p in replica.named_parameters():
        assert torch.equal(torch.cat([r[name] for r in rows]), p.detach()), name


def test_buffers_and_tensors_given_by_value_are_built_too() -> None:
    def build() -> nn.Module:
        m = nn.Linear(6, 5)
        m.register_buffer("scale", torch.ones(5, 6) * 2)
        m.register_buffer("index", torch.arange(5))  # integers: kept whole
        m.offset = nn.Parameter(torch.tensor([0.5, 1.5]))  # given by value: kept whole
        return m

    torch.manual_seed(0)
    replica = build()
    torch.manual_seed(0)
    built = build_sharded(build, 2, 1)
    assert torch.equal(built.rows["scale"], replica.get_buffer("scale")[3:])
    assert torch.equal(built.rows["weight"], replica.get_parameter("weight")[3:])
    assert torch.equal(built.whole["index"], replica.get_buffer("index"))
    assert torch.equal(built.whole["offset"], replica.get_parameter("offset"))


@pytest.mark.parametrize("init", [
    nn.init.trunc_normal_,  # torchtitan's and timm's default: a rejection loop over the whole tensor
    lambda w: nn.init.trunc_normal_(w, std=0.02, a=-0.04, b=0.04),
    lambda w: nn.init.orthogonal_(w),  # a QR of the whole tensor (looked up when called, as a model does)
    lambda w: nn.init.sparse_(w, 0.5),  # a scatter into it
], ids=["trunc_normal", "trunc_normal_std", "orthogonal", "sparse"])
@pytest.mark.parametrize("world", [2, 3])
def test_an_initialisation_that_reads_the_whole_tensor_runs_on_a_scratch_and_gives_a_replicas_rows(
        init: Callable[[torch.Tensor], object], world: int) -> None:
    def build() -> nn.Module:
        first = nn.Linear(8, 7)
        init(first.weight)
        return nn.Sequential(first, nn.Linear(7, 5))

    torch.manual_seed(5)
    replica = build()
    after = torch.get_rng_state()
    rows = []
    for rank in range(world):
        torch.manual_seed(5)
        built = build_sharded(build, world, rank)
        assert torch.equal(torch.get_rng_state(), after)
        rows.append(built.rows)
    for name, p in replica.named_parameters():
        assert torch.equal(torch.cat([r[name] for r in rows]), p.detach()), name
    assert nn.init.trunc_normal_.__name__ == "trunc_normal_"  # torch's own again after the build


@pytest.mark.parametrize(("init", "op"), [
    (lambda w: w.sub_(w.mean()), "aten.mean"),  # reads every row: no scratch stands in for it
    (lambda w: nn.init.orthogonal_(w[2:]), "part of a tensor"),  # a scratch stands in for a whole tensor only
])
def test_an_initialisation_that_needs_the_whole_tensor_is_refused_with_the_generator_restored(
        init: Callable[[torch.Tensor], object], op: str) -> None:
    def build() -> nn.Module:
        m = nn.Linear(8, 8)
        with torch.no_grad():
            init(m.weight)
        return m

    torch.manual_seed(3)
    before = torch.get_rng_state()
    with pytest.raises(NotShardable, match=op):
        build_sharded(build, 2, 0)
    assert torch.equal(torch.get_rng_state(), before)
