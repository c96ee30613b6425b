"""The ``dcp`` format: ``torch.distributed.checkpoint`` (DCP), sharded writes and PyTorch's async save.

One checkpoint is a directory ``dcp-<step:08d>-<n>/`` (``n`` orders two saves of one step: a pause's
checkpoint, then that epoch's own) holding one ``__<rank>_0.distcp`` file per rank, DCP's ``.metadata``
and hpoflow's ``hpoflow-manifest.pt``. Every rank hands DCP the same tensors under the same names
(``state.<path>``: DDP's replicated model and optimizer), and DCP's planner writes each of them once,
spreading them over the ranks: each rank writes about ``1/world_size`` of the bytes, in parallel. Each
rank's own RNG states go under ``rank<r>.<path>``; what is not a tensor (numbers, strings, the
structure) is JSON (``hpoflow.train.checkpoint._tree``) in uint8 tensors, rank 0's ``hpoflow.skeleton``
and each rank's ``rank<r>.skeleton``: DCP stores no pickled object of ours.

Saving (a collective: every rank calls it at the same step): rank 0 picks the directory's number and
broadcasts it; DCP plans and writes into ``.dcp-<step>-<n>.tmp/`` over its own gloo process group
(training's collectives never interleave with the checkpoint's), every rank hashes the file it wrote
(a ``.sha256`` beside it); when DCP's coordinator (rank 0) has written ``.metadata`` every file is
on disk (``fsync``ed), and rank 0 writes the manifest (size and SHA-256 of every file, in the checked
``_file`` format), ``fsync``s and renames the directory to its final name: atomic. With ``async_save``
(default: ``training.checkpoint.async``), ``torch.distributed.checkpoint.async_save`` copies the state
on the training thread (PyTorch's staging) and writes in its own thread; rank 0 commits when that
finishes. The next save waits for the previous one.

A state sharded over the ranks (``save(..., sharded=items)``: ``fsdp``'s and ``zero1``'s model and
optimizer, ``hpoflow.train.strategies._sharded_state``) goes under ``sharded.<name>``: DCP writes each
``DTensor`` shard from its rank and each other name once, with its whole shape; no skeleton (the
names are the structure). A load reads it into the template the caller gives
(``latest(..., sharded=template)``: the tensors at this rank's sharding now, by name), so each rank
reads only what it holds, from whichever files hold it: a checkpoint written by 2 ranks resumes on 1
or on 4 (elastic trials), the shards cut anew.

Loading: rank 0 verifies the newest committed directory against its manifest (sizes, SHA-256; DCP's
``.metadata`` is read by an unpickler that builds DCP's metadata classes and nothing else), the ranks
agree on a step, and each rank reads every ``state.*`` tensor (the whole model: it is replicated) and
its own RNG states, with ``no_dist`` (a read needs no collective). That works at any world size: a
checkpoint written by 2 ranks resumes on 1 or 4 (in an elastic trial; a fixed-size trial refuses another
world size as every format does). A rank that did not exist then gets rank 0's state and seeded RNGs.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import re
import shutil
import time
import warnings
from collections.abc import Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from hpoflow.fileio import fsync_dir
from hpoflow.registry import Options
from hpoflow.train.checkpoint._base import (
    CheckpointError,
    CheckpointFormat,
    CorruptCheckpoint,
    Gather,
    Template,
    UnsafeCheckpoint,
)
from hpoflow.train.checkpoint._file import FORMAT_VERSION, read_checkpoint, write_checkpoint
from hpoflow.train.checkpoint._tree import flatten, from_json_tensor, json_tensor, unflatten

log = logging.getLogger("hpoflow.train.checkpoint")

__all__ = ["DcpCheckpointer"]

MANIFEST = "hpoflow-manifest.pt"
_FINAL = re.compile(r"^dcp-(\d{8})-(\d+)$")
_TEMP = re.compile(r"^\.dcp-(\d{8})-(\d+)\.tmp$")
_SKELETON = "hpoflow.skeleton"
_SHARDED = "sharded."
# DCP says so on every save and load of a single process (``no_dist``), from its own threads too
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized",
                        category=UserWarning)


def _sha256_file(path: Path) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


# -- DCP's metadata, unpickled without running code ------------------------------------------------
_METADATA_CLASSES = {"Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata (its dataclasses, ``torch.Size``, dtypes, layouts, a path) and refuses any
    other global: a ``.metadata`` file cannot run code (DCP itself reads it with ``pickle.load``)."""

    def find_class(self, module: str, name: str) -> Any:
        ok = ((module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES)
              or (module == "torch.distributed.checkpoint.filesystem" and name == "_StorageInfo")
              or (module == "torch.serialization" and name == "_get_layout")
              or (module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)))
              or (module == "pathlib" and name in ("PosixPath", "PurePosixPath"))
              or (module == "collections" and name == "OrderedDict"))
        if not ok:
            raise pickle.UnpicklingError(f"global {module}.{name} is not part of DCP's metadata")
        return super().find_class(module, name)


def read_metadata(path: Path) -> Any:
    try:
        with open(path / ".metadata", "rb") as f:
            return _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as exc:
        raise UnsafeCheckpoint(f"{path}/.metadata: refused ({exc})") from exc
    except (OSError, EOFError, ValueError, TypeError, AttributeError) as exc:
        raise CorruptCheckpoint(f"{path}/.metadata: unreadable ({type(exc).__name__}: {exc})") from exc


def _reader_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_metadata(Path(self.path))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _writer_class() -> type:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    class HashingWriter(FileSystemWriter):
        """DCP's file writer; then each file this rank wrote gets ``<file>.sha256`` beside it."""

        written = 0

        def write_data(self, plan: Any, planner: Any) -> Any:
            fut = super().write_data(plan, planner)
            for rel in sorted({r.storage_data.relative_path for r in fut.wait()}):
                digest, size = _sha256_file(Path(self.path) / rel)
                self.written += size
                (Path(self.path) / f"{rel}.sha256").write_text(f"{digest} {size}\n")
            return fut

    return HashingWriter


class DcpCheckpointer(CheckpointFormat):
    """The ``dcp`` format; see the module docstring."""

    name = "dcp"
    shared_state = True
    sharded_state = True

    def __init__(self, directory: Path, rank: int = 0, world_size: int = 1, keep: int = 2,
                 background: bool = True, elastic: bool = False, options: Options | None = None) -> None:
        super().__init__(directory, rank, world_size, keep, background, elastic, options)
        chosen = getattr(options, "async_save", None)
        self.async_save = background if chosen is None else bool(chosen)
        self.thread_count = int(getattr(options, "thread_count", 1))
        self._group: Any = None
        self._future: Future[None] | None = None

    # -- process group ------------------------------------------------------------------------
    @property
    def _distributed(self) -> bool:
        return self.world_size > 1 and dist.is_available() and dist.is_initialized()

    def _pg(self) -> Any:
        """DCP's own gloo group (created on first use, a collective: at a save or a load)."""
        if self._group is None and self._distributed:
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _number(self, step: int) -> int:
        """The number of this save's directory: rank 0's, broadcast to every rank."""
        taken = [n for s, n, _ in self._committed() if s == step]
        value = max([time.time_ns(), *(n + 1 for n in taken)])
        if self._distributed:
            t = torch.tensor([value], dtype=torch.int64)
            dist.broadcast(t, src=0, group=self._pg())
            value = int(t.item())
        return value

    # -- saving -----------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, private: Mapping[str, Any] | None = None, *,
             sharded: Mapping[str, Any] | None = None) -> None:
        """Every rank, at the same step (collective); see the module docstring."""
        from torch.distributed.checkpoint.state_dict_saver import async_save, save

        self.wait()
        step = int(step)
        t0 = time.perf_counter()
        tensors, skeleton = flatten(state, "state")
        own, own_skeleton = flatten(dict(private or {}), f"rank{self.rank}")
        items: dict[str, Any] = {**tensors, **own, f"rank{self.rank}.skeleton": json_tensor(own_skeleton),
                                 **{f"{_SHARDED}{name}": t for name, t in (sharded or {}).items()}}
        if self.rank == 0:
            items[_SKELETON] = json_tensor({"format": FORMAT_VERSION, "step": step, "world_size": self.world_size,
                                            "torch": str(torch.__version__), "time": time.time(), "state": skeleton})
        number = self._number(step)
        temp = self.directory / f".dcp-{step:08d}-{number}.tmp"
        if self.rank == 0:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._remove_temp_dirs(keep=temp.name)
        writer = _writer_class()(str(temp), single_file_per_rank=True, sync_files=True,
                                 thread_count=self.thread_count)
        self.last_step = step
        group, local = self._pg(), not self._distributed
        try:
            if self.async_save:
                response = async_save(items, storage_writer=writer, process_group=group, no_dist=local)
                future = response if isinstance(response, Future) else response.upload_completion
                done: Future[None] = Future()  # set once the commit is done, not only DCP's write

                def finished(f: Future[Any]) -> None:
                    try:
                        self._finish(f, writer, temp, step, number, t0)
                    finally:
                        done.set_result(None)

                self._future = done
                future.add_done_callback(finished)
                return
            save(items, storage_writer=writer, process_group=group, no_dist=local)
        except Exception as exc:
            self._failed(step, exc)
            self.write_s += time.perf_counter() - t0
            return
        self._finish(None, writer, temp, step, number, t0)

    def _finish(self, future: Future[Any] | None, writer: Any, temp: Path, step: int, number: int,
                t0: float) -> None:
        try:
            if future is not None:
                future.result()
            self.last_size = int(writer.written)
            if self.rank == 0:
                self._commit(temp, step, number)
        except Exception as exc:  # a checkpoint is a safety net: losing one must not fail the trial
            self._failed(step, exc)
        finally:
            self.write_s += time.perf_counter() - t0

    def _failed(self, step: int, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = exc
        log.warning("rank %d could not write checkpoint step %d in %s: %s: %s. Training goes on; a crash would "
                    "resume from an older checkpoint", self.rank, step, self.directory, type(exc).__name__, exc)

    def _commit(self, temp: Path, step: int, number: int) -> None:
        """Rank 0, once every rank's file and DCP's metadata are on disk: manifest, rename, prune."""
        files: dict[str, dict[str, Any]] = {}
        for side in sorted(temp.glob("*.sha256")):
            hex_digest, length = side.read_text().split()
            files[side.name.removesuffix(".sha256")] = {"sha256": hex_digest, "size": int(length)}
            side.unlink()
        digest, size = _sha256_file(temp / ".metadata")
        files[".metadata"] = {"sha256": digest, "size": size}
        write_checkpoint(temp / MANIFEST, {"format": FORMAT_VERSION, "step": step, "world_size": self.world_size,
                                           "files": files})
        fsync_dir(temp)
        os.replace(temp, self.directory / f"dcp-{step:08d}-{number}")
        fsync_dir(self.directory)
        self._prune()

    def wait(self) -> None:
        future, self._future = self._future, None
        if future is not None:
            future.result()  # _finish counted and logged any failure

    def close(self) -> None:
        self.wait()

    # -- the directory ----------------------------------------------------------------------------
    def _committed(self) -> list[tuple[int, int, Path]]:
        """(step, number, path) of every committed directory, newest first."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        out = []
        for name in names:
            m = _FINAL.match(name)
            if m:
                out.append((int(m.group(1)), int(m.group(2)), self.directory / name))
        return sorted(out, reverse=True)

    def _newest_per_step(self) -> dict[int, Path]:
        out: dict[int, Path] = {}
        for step, _, path in self._committed():
            out.setdefault(step, path)
        return out

    def step_files(self, step: int) -> list[Path]:
        path = self._newest_per_step().get(step)
        return sorted(p for p in path.iterdir() if p.is_file()) if path is not None else []

    def _prune(self) -> None:
        """Rank 0: keep the ``keep`` newest steps (each its newest directory); delete the rest."""
        kept = sorted(self._newest_per_step().items(), reverse=True)[: self.keep]
        keep = {path for _, path in kept}
        for _, _, path in self._committed():
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def _remove_temp_dirs(self, keep: str = "") -> None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        for name in names:
            if _TEMP.match(name) and name != keep:
                shutil.rmtree(self.directory / name, ignore_errors=True)

    def _verify(self, path: Path) -> str | None:
        """Why the committed directory ``path`` cannot be used (``None``: its manifest checks out)."""
        try:
            manifest = read_checkpoint(path / MANIFEST)
            files = manifest["files"]
            for name, want in files.items():
                digest, size = _sha256_file(path / name)
                if size != want["size"]:
                    return f"{path / name}: {size} bytes, the manifest says {want['size']} (truncated or extended)"
                if digest != want["sha256"]:
                    return f"{path / name}: SHA-256 does not match the manifest (damaged)"
            metadata = read_metadata(path)
            missing = {info.relative_path for info in metadata.storage_data.values()} - set(files)
            if missing:
                return f"{path}: DCP's metadata names files the manifest does not list: {sorted(missing)}"
        except (CheckpointError, OSError, KeyError, TypeError, AttributeError) as exc:
            return str(exc)
        return None

    # -- resuming -----------------------------------------------------------------------------------
    def latest(self, gather: Gather | None = None, *,
               sharded: Template | None = None) -> tuple[int, dict[str, Any]] | None:
        found = self._latest(gather, sharded)
        return None if found is None else found[:2]

    def latest_any_world(self, gather: Gather | None = None, *,
                         sharded: Template | None = None) -> tuple[int, dict[str, Any], bool] | None:
        return self._latest(gather, sharded)

    def _latest(self, gather: Gather | None, sharded: Template | None) -> tuple[int, dict[str, Any], bool] | None:
        self.wait()
        newest = self._newest_per_step()
        if self.rank == 0:
            self._remove_temp_dirs()
            mine: list[int] = []
            for step in sorted(newest, reverse=True):  # rank 0 verifies, newest first, until one checks out
                problem = self._verify(newest[step])
                if problem is None:
                    mine = [s for s in sorted(newest) if s <= step]
                    break
                warnings.warn(f"hpoflow: rank 0: skipping checkpoint {problem}", RuntimeWarning, stacklevel=3)
        else:
            mine = sorted(newest)
        lists = gather(mine) if gather is not None else [mine]
        common = set(mine)
        for steps in lists:
            common &= set(steps)
        if self.rank == 0:  # steps newer than the one every rank can use: an abandoned future
            for step, path in newest.items():
                if not common or step > max(common):
                    shutil.rmtree(path, ignore_errors=True)
        if not common:
            return None
        step = max(common)
        try:
            return self._load(step, newest[step], sharded)
        except (CheckpointError, OSError, KeyError, RuntimeError, ValueError) as exc:
            warnings.warn(f"hpoflow: rank {self.rank}: could not read checkpoint {newest[step]}: {exc}; starting "
                          "from scratch", RuntimeWarning, stacklevel=3)
            return None

    def _read(self, path: Path, template: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict_loader import load

        load(template, storage_reader=_reader_class()(str(path)), no_dist=True)

    def _load(self, step: int, path: Path, sharded: Template | None) -> tuple[int, dict[str, Any], bool] | None:
        metadata = read_metadata(path).state_dict_metadata
        head = {_SKELETON: torch.empty(metadata[_SKELETON].size, dtype=torch.uint8)}
        self._read(path, head)
        info = from_json_tensor(head[_SKELETON], str(path))
        world = info.get("world_size")
        if not isinstance(world, int) or info.get("step") != step:
            raise CorruptCheckpoint(f"{path}: it holds step={info.get('step')}, world_size={world}")
        if not self.elastic and world != self.world_size:
            warnings.warn(
                f"hpoflow: rank {self.rank}: skipping checkpoint {path}: it holds world_size={world} but this "
                f"trial has world_size={self.world_size} (a checkpoint resumes only with the same number of "
                "processes)", RuntimeWarning, stacklevel=4)
            return None
        own = f"rank{self.rank}."
        foreign = f"{own}skeleton" not in metadata
        template = {name: torch.empty(meta.size, dtype=meta.properties.dtype) for name, meta in metadata.items()
                    if name.startswith("state.") or (not foreign and name.startswith(own))}
        if sharded is not None:  # this rank's part, read into the caller's tensors at their sharding now
            wanted = {f"{_SHARDED}{name}": t for name, t in sharded().items()}
            missing = sorted(name for name in wanted if name not in metadata)
            if missing:
                raise CorruptCheckpoint(f"{path}: it holds no {', '.join(missing[:3])} (written by another model, "
                                        "optimizer or strategy)")
            template.update(wanted)
        self._read(path, template)
        state = unflatten(info["state"], {k: v for k, v in template.items() if not k.startswith(_SHARDED)})
        private = {} if foreign else unflatten(from_json_tensor(template[f"{own}skeleton"], str(path)), template)
        self.last_step = step
        return step, {**state, **private}, foreign
