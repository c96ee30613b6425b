"""The checkpoint formats' contract (hpoflow.train.checkpoint._base), the same tests for every format,
in-process: round trip of every kind of value, keep, async copies, damaged and half-written files,
world sizes, what a file may hold; then what only one format does (rank0's small files, safetensors'
interoperable weights, DCP's metadata read without pickle), and the spec keys.

Real trials (2-rank DDP killed and resumed bitwise, rank0's half bytes, dcp resharded from 2 ranks to 1
and 4, pauses) are in tests/train/test_checkpoint_resharding.py.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import yaml

from hpoflow.errors import SpecError
from hpoflow.registry import CHECKPOINT_FORMATS
from hpoflow.spec import TrainConfig, load_spec
from hpoflow.train.checkpoint import CheckpointFormat, make_checkpointer

FORMATS = ["replica", "rank0", "dcp", "safetensors"]
# DCP says so on every save and load in one process; hpoflow filters it when it imports DCP's format, but
# pytest restores the filters after each test
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


def _state(i: int) -> dict[str, Any]:
    """Every kind of value a state may hold: tensors of several dtypes, an optimizer's int keys, tuples,
    None, bools, non-finite floats, a NumPy scalar (kept as the number it holds), strings."""
    return {"user": {
        "w": torch.arange(12, dtype=torch.float32).reshape(3, 4) + i, "ids": torch.tensor([i, 2], dtype=torch.int64),
        "mask": torch.tensor([True, False]), "half": torch.ones(2, dtype=torch.bfloat16) * i,
        "opt": {"state": {0: {"exp_avg": torch.full((2,), 0.5 * i), "step": torch.tensor(float(i))}},
                "param_groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0], "nesterov": False}]},
        "t": (1, 2.5, None, "x"), "inf": math.inf, "nan": math.nan, "n": np.int64(i), "epoch": i,
    }}


def _make(fmt: str, d: Path, **kw: Any) -> CheckpointFormat:
    return make_checkpointer(fmt, {}, d, **kw)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def _step_bytes(cp: CheckpointFormat, step: int) -> int:
    return sum(p.stat().st_size for p in cp.step_files(step))


@pytest.mark.parametrize("background", [False, True])
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_value_round_trips_and_keep_prunes(tmp_path: Path, fmt: str, background: bool) -> None:
    cp = _make(fmt, tmp_path, keep=2, background=background)
    for step in range(1, 5):
        cp.save(_state(step), step, {"rng": {"torch": torch.get_rng_state(), "k": step}})
    cp.close()
    assert cp.errors == 0 and cp.last_size > 0
    found = _make(fmt, tmp_path).latest()
    assert found is not None
    step, state = found
    expected = _state(4)
    expected["user"]["n"] = 4  # a NumPy scalar comes back as the number it held
    assert step == 4 and _same(state["user"], expected["user"])
    assert state["rng"]["k"] == 4 and torch.equal(state["rng"]["torch"], torch.get_rng_state())
    assert [s for s in range(1, 5) if cp.step_files(s)] == [3, 4]  # keep: 2


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_async_save_copies_the_state_before_it_returns(tmp_path: Path, fmt: str) -> None:
    cp = _make(fmt, tmp_path, background=True)
    w = torch.zeros(100_000)
    cp.save({"w": w}, 1)
    w.add_(1.0)  # training goes on while the write runs
    cp.close()
    found = _make(fmt, tmp_path).latest()
    assert found is not None and torch.equal(found[1]["w"], torch.zeros(100_000))


def _damage(cp: CheckpointFormat, step: int) -> None:
    """Flip one bit in the middle of the biggest file of ``step``."""
    path = max(cp.step_files(step), key=lambda p: p.stat().st_size)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the expected one is checked
@pytest.mark.parametrize("fmt", FORMATS)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one(tmp_path: Path, fmt: str) -> None:
    cp = _make(fmt, tmp_path, keep=3, background=False)
    for step in (1, 2, 3):
        cp.save({"w": torch.full((10_000,), float(step))}, step)
    _damage(cp, 3)
    with pytest.warns(RuntimeWarning, match="SHA-256|damaged"):
        found = _make(fmt, tmp_path, keep=3).latest()
    assert found is not None and found[0] == 2 and torch.equal(found[1]["w"], torch.full((10_000,), 2.0))
    assert not cp.step_files(3)  # newer than the one resumed from: removed
    for step in (1, 2):
        _damage(cp, step)
    assert _make(fmt, tmp_path).latest() is None  # nothing usable: a fresh start


@pytest.mark.parametrize("fmt", FORMATS)
def test_what_a_crash_in_the_middle_of_a_write_leaves_is_ignored_and_cleaned(tmp_path: Path, fmt: str) -> None:
    cp = _make(fmt, tmp_path, background=False)
    cp.save({"w": torch.ones(4)}, 1)
    if fmt == "dcp":  # a save that never committed: its temporary directory
        junk = tmp_path / ".dcp-00000002-1.tmp"
        junk.mkdir()
        (junk / "__0_0.distcp").write_bytes(b"half written")
    else:  # write_atomic's temporary file
        junk = tmp_path / f".{cp.file_name(2, 0)}.x1y2.tmp"  # type: ignore[attr-defined]
        junk.write_bytes(b"half written")
    found = _make(fmt, tmp_path).latest()
    assert found is not None and found[0] == 1 and torch.equal(found[1]["w"], torch.ones(4))
    assert not junk.exists()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the expected one is checked
@pytest.mark.parametrize("fmt", FORMATS)
def test_another_world_size_resumes_only_an_elastic_trial(tmp_path: Path, fmt: str) -> None:
    """Written by one rank: a fixed-size trial of two refuses it (its global batch would change); an
    elastic one resumes, its rank 1 with rank 0's state and no RNG states of its own."""
    cp = _make(fmt, tmp_path, background=False, elastic=True)
    cp.save({"w": torch.ones(3)}, 1, {"rng": {"k": 0}})
    grown = _make(fmt, tmp_path, rank=1, world_size=2, elastic=True).latest_any_world()
    assert grown is not None
    step, state, foreign = grown
    assert step == 1 and foreign and torch.equal(state["w"], torch.ones(3))
    own = _make(fmt, tmp_path, rank=0, world_size=2, elastic=True).latest_any_world()
    assert own is not None and not own[2] and own[1]["rng"] == {"k": 0}
    with pytest.warns(RuntimeWarning, match="same number of processes"):
        assert _make(fmt, tmp_path, world_size=2).latest() is None


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_state_holds_only_plain_data(tmp_path: Path, fmt: str) -> None:
    with pytest.raises(TypeError, match="a checkpoint holds only tensors"):
        _make(fmt, tmp_path, background=False).save({"x": _Evil(tmp_path / "pwned")}, 1)
    assert not (tmp_path / "pwned").exists()


def test_dcp_metadata_is_read_without_running_pickled_code(tmp_path: Path) -> None:
    cp = _make("dcp", tmp_path, background=False)
    cp.save({"w": torch.ones(3)}, 1)
    meta = next(p for p in cp.step_files(1) if p.name == ".metadata")
    marker = tmp_path / "pwned"
    evil = pickle.dumps(_Evil(marker))
    meta.write_bytes(evil)
    # and a manifest that vouches for it, as someone who can write the directory could write
    from hpoflow.train.checkpoint import UnsafeCheckpoint, read_checkpoint, write_checkpoint
    from hpoflow.train.checkpoint._dcp import MANIFEST, read_metadata

    manifest = read_checkpoint(meta.parent / MANIFEST)
    manifest["files"][".metadata"] = {"sha256": hashlib.sha256(evil).hexdigest(), "size": len(evil)}
    write_checkpoint(meta.parent / MANIFEST, manifest)
    with pytest.warns(RuntimeWarning, match="refused"):
        assert _make("dcp", tmp_path).latest() is None
    assert not marker.exists()
    meta.parent.mkdir(exist_ok=True)
    meta.write_bytes(evil)
    with pytest.raises(UnsafeCheckpoint, match=r"global pathlib.*touch is not part of DCP's metadata"):
        read_metadata(meta.parent)
    assert not marker.exists()


def test_dcp_writes_each_tensor_once_with_a_manifest(tmp_path: Path) -> None:
    cp = _make("dcp", tmp_path, background=False)
    cp.save({"w": torch.zeros(250_000)}, 1, {"rng": {"t": torch.zeros(10)}})
    names = sorted(p.name for p in cp.step_files(1))
    assert names == [".metadata", "__0_0.distcp", "hpoflow-manifest.pt"]
    assert 1_000_000 < _step_bytes(cp, 1) < 1_020_000  # one copy of 1 MB, plus metadata and manifest


def test_rank0_other_ranks_write_only_their_rng_states(tmp_path: Path) -> None:
    big = {"w": torch.zeros(250_000)}
    r0 = _make("rank0", tmp_path, rank=0, world_size=2, background=False)
    r1 = _make("rank0", tmp_path, rank=1, world_size=2, background=False)
    r0.save(big, 1, {"rng": {"k": 0}})
    r1.save(big, 1, {"rng": {"k": 1}})
    sizes = {p.name: p.stat().st_size for p in r0.step_files(1)}
    assert sizes["rank0-00000001-r0.pt"] > 1_000_000 > 2_000 > sizes["rank0-00000001-r1.pt"]
    lists = {0: [1], 1: [1]}
    a = _make("rank0", tmp_path, rank=0, world_size=2).latest(lambda mine: [lists[0], lists[1]])
    b = _make("rank0", tmp_path, rank=1, world_size=2).latest(lambda mine: [lists[0], lists[1]])
    assert a is not None and b is not None
    assert a[1]["rng"] == {"k": 0} and b[1]["rng"] == {"k": 1}  # each rank its own RNG states
    assert torch.equal(b[1]["w"], big["w"])  # and rank 0's state


def test_rank0_resumes_no_step_whose_state_file_is_gone(tmp_path: Path) -> None:
    r0 = _make("rank0", tmp_path, rank=0, world_size=2, keep=3, background=False)
    r1 = _make("rank0", tmp_path, rank=1, world_size=2, keep=3, background=False)
    for step in (1, 2):
        r0.save({"s": step}, step)
        r1.save({"s": step}, step)
    (tmp_path / "rank0-00000002-r0.pt").unlink()
    with pytest.warns(RuntimeWarning, match="rank0-00000002-r0.pt"):
        b = _make("rank0", tmp_path, rank=1, world_size=2).latest()
    assert b is not None and b[0] == 1 and b[1]["s"] == 1


@pytest.mark.filterwarnings("ignore:hpoflow.*no checkpoint:RuntimeWarning")  # after the expected one
def test_safetensors_files_are_plain_safetensors_with_the_weights_by_name(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    cp = _make("safetensors", tmp_path, background=False)
    model = torch.nn.Linear(3, 2)
    cp.save({"user": {"model": model.state_dict(), "epoch": 1}}, 1, {"rng": {"torch": torch.get_rng_state()}})
    (path,) = cp.step_files(1)
    tensors = load_file(path)
    assert torch.equal(tensors["state.user.model.weight"], model.weight.detach())
    assert set(tensors) == {"state.user.model.weight", "state.user.model.bias", "state.rng.torch"}
    data = bytearray(path.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = bytes(data[8 : 8 + n]).replace(b'\\"epoch\\",1', b'\\"epoch\\",2')
    assert len(header) == n and header != bytes(data[8 : 8 + n])
    path.write_bytes(bytes(data[:8]) + header + bytes(data[8 + n :]))  # metadata changed, checksum not
    with pytest.warns(RuntimeWarning, match="SHA-256"):
        assert _make("safetensors", tmp_path).latest() is None


# -- the spec ------------------------------------------------------------------------------------------
def test_the_spec_keys_and_their_defaults() -> None:
    c = TrainConfig.model_validate({"checkpoint": {"every": 1, "format": "dcp", "options": {"thread_count": 2}}})
    assert c.checkpoint.format == "dcp" and c.checkpoint.options == {"async_save": None, "thread_count": 2}
    assert TrainConfig().checkpoint.format == "replica"
    assert set(CHECKPOINT_FORMATS.names()) >= set(FORMATS)
    for fmt in FORMATS:
        TrainConfig.model_validate({"checkpoint": {"format": fmt}})


@pytest.mark.parametrize(("training", "where", "words"), [
    ({"checkpoint": {"every": 1, "format": "dpc"}}, "training.checkpoint.format",
     "unknown checkpoint format 'dpc' (did you mean 'dcp'?); valid checkpoint formats: dcp, rank0, replica, "
     "safetensors"),
    ({"checkpoint": {"format": "dcp", "options": {"threads": 2}}}, "training.checkpoint.options.threads",
     "did you mean 'thread_count'"),
    ({"checkpoint": {"format": "dcp", "options": {"thread_count": 0}}}, "training.checkpoint.options.thread_count",
     "must be >= 1"),
    ({"checkpoint": {"format": "replica", "options": {"x": 1}}}, "training.checkpoint.options.x",
     "replica takes no options"),
    ({"strategy": "easgd", "checkpoint": {"format": "rank0"}}, "training.checkpoint.format",
     "rank0 keeps one copy of the state for every rank"),
    ({"strategy": "parameter_server", "checkpoint": {"format": "dcp"}}, "training.checkpoint.format",
     "Fix: use format replica or safetensors, or strategy allreduce"),
])
def test_a_bad_format_or_option_is_one_line_at_its_key(tmp_path: Path, training: dict[str, Any], where: str,
                                                       words: str) -> None:
    spec = {"study": {"name": "c", "metric": "val_accuracy", "direction": "maximize"},
            "search": {"algorithm": "random", "n_trials": 1},
            "training": {"model": "mlp", "dataset": "synthetic", "epochs": 1, **training}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    with pytest.raises(SpecError) as info:
        load_spec(path)
    issue = info.value.issues[0]
    assert issue.path == where and words in issue.message and issue.line is not None, str(issue)


def test_a_user_function_may_pick_any_format() -> None:
    """The strategy rule is the built-in trainer's (its strategies decide what the ranks hold)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        c = TrainConfig.model_validate({"function": "m:f", "strategy": "easgd", "checkpoint": {"format": "rank0"}})
    assert c.checkpoint.format == "rank0"
