"""Checkpoints a trial resumes from after a crash: atomic, checksummed, loaded without pickle.

Layout: one file per rank and step in the trial's checkpoint directory, ``ckpt-<step:08d>-r<rank>.pt``
(every rank writes its own: strategies keep per-rank state, and so do the RNG streams). A step is
*complete* when every rank ``0 .. world_size-1`` has a valid file for it; a resume takes the newest
step that is complete and valid for every rank (agreed by a collective in a distributed trial).

File format: a 52-byte header, then the payload. The header is ``MAGIC`` (8 bytes), the format
version (uint32), the payload length (uint64) and the SHA-256 of the payload (32 bytes); the payload
is ``torch.save`` of plain tensors, numbers, strings and containers, read back with
``torch.load(weights_only=True)``: a checkpoint never unpickles an arbitrary object. A truncated or
damaged file fails the length or checksum test and is skipped (the previous checkpoint is used).

Atomicity: a file is written to a temporary name in the same directory, flushed, ``fsync``ed, renamed
over its final name, and the directory is ``fsync``ed: a crash at any point leaves either the old
set of files or the new one, never a partial file under a final name.

Pruning: a rank deletes its file for step ``s`` only when ``s`` is not among its ``keep`` newest and
a newer step has files from every rank (seen in the directory listing), so a crash of one rank in the
middle of a write never leaves the ranks without a common checkpoint.

Elastic trials (``elastic=True``; every rank holds the same state): a step is complete when the
ranks of the world that wrote it (``world_size`` in rank 0's file) all have a valid file; it resumes
on any number of ranks, ranks beyond that world taking rank 0's state (``latest_any_world``), and
rank 0 deletes committed-over files of ranks a shrunk trial no longer has.

Threads: ``Checkpointer.save`` copies the state (CPU tensors, new containers) on the calling thread;
with ``background=True`` a writer thread serialises and writes it while training goes on. A save
first waits for the previous write. ``close()`` waits for the last one and stops the writer. One
``Checkpointer`` per rank; its methods are called from one thread.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import queue
import random
import re
import struct
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hpoflow.fileio import write_atomic

log = logging.getLogger(__name__)

__all__ = [
    "MAGIC",
    "CheckpointError",
    "Checkpointer",
    "CorruptCheckpoint",
    "UnsafeCheckpoint",
    "capture_rng",
    "checkpoint_name",
    "decode",
    "encode",
    "parse_name",
    "read_checkpoint",
    "restore_rng",
    "seed_joining_rank",
    "snapshot",
    "write_checkpoint",
]

MAGIC = b"HPOFCKPT"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sIQ32s")  # magic, version, payload length, sha256(payload)
_NAME = re.compile(r"^ckpt-(\d{8})-r(\d+)\.pt$")
_ATOMS = (bool, int, float, str, type(None))
_WRITER_IDLE_S = 10.0

Gather = Callable[[list[int]], list[list[int]]]


class CheckpointError(RuntimeError):
    """A checkpoint file cannot be used."""


class CorruptCheckpoint(CheckpointError):
    """The file is truncated, damaged or not a checkpoint (header, length or checksum test failed)."""


class UnsafeCheckpoint(CheckpointError):
    """The payload holds something other than tensors and plain data (``weights_only`` refused it)."""


# -- names ------------------------------------------------------------------------------------------
def checkpoint_name(step: int, rank: int) -> str:
    if step < 0 or rank < 0:
        raise ValueError(f"checkpoint step and rank must be >= 0, but got step={step}, rank={rank}")
    return f"ckpt-{step:08d}-r{rank}.pt"


def parse_name(name: str) -> tuple[int, int] | None:
    """``(step, rank)`` of a checkpoint file name, or ``None`` for any other file."""
    m = _NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


# -- one file -----------------------------------------------------------------------------------------
def encode(obj: Any) -> tuple[bytes, memoryview]:
    """``(header, payload)`` of ``obj``: ``torch.save`` bytes and their checked header."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    header = _HEADER.pack(MAGIC, FORMAT_VERSION, len(payload), hashlib.sha256(payload).digest())
    return header, payload


def decode(data: bytes | memoryview, source: str = "<bytes>") -> Any:
    """The object in checkpoint bytes; ``CorruptCheckpoint`` or ``UnsafeCheckpoint`` if unusable."""
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise CorruptCheckpoint(f"{source}: {len(view)} bytes is shorter than the {_HEADER.size}-byte header "
                                "(truncated)")
    magic, version, length, digest = _HEADER.unpack(view[: _HEADER.size])
    if magic != MAGIC:
        raise CorruptCheckpoint(f"{source}: not an hpoflow checkpoint (magic {bytes(magic)!r}, expected {MAGIC!r})")
    if version != FORMAT_VERSION:
        raise CorruptCheckpoint(f"{source}: format version {version}, this hpoflow reads {FORMAT_VERSION}")
    payload = view[_HEADER.size :]
    if len(payload) != length:
        raise CorruptCheckpoint(f"{source}: payload is {len(payload)} bytes, the header says {length} (truncated "
                                "or extended)")
    if hashlib.sha256(payload).digest() != digest:
        raise CorruptCheckpoint(f"{source}: SHA-256 of the payload does not match the header (damaged)")
    try:
        return torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError (and others) for disallowed globals
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        why = next((ln for ln in lines if "Unsupported" in ln or "WeightsUnpickler" in ln), lines[0] if lines else "")
        raise UnsafeCheckpoint(f"{source}: refused by torch.load(weights_only=True) (it would run pickled "
                               f"code): {why[:300]}") from exc


def write_checkpoint(path: Path, obj: Any) -> int:
    """Encode ``obj`` and write it atomically to ``path``; returns the file's size in bytes."""
    header, payload = encode(obj)
    write_atomic(path, header, payload)
    return len(header) + len(payload)


def read_checkpoint(path: Path) -> Any:
    """Read and verify one checkpoint file (raises ``CheckpointError`` subclasses, or ``OSError``)."""
    return decode(path.read_bytes(), str(path))


# -- state ------------------------------------------------------------------------------------------
def snapshot(obj: Any, where: str = "state") -> Any:
    """A deep copy of ``obj`` that shares nothing with training: tensors are detached CPU copies,
    containers are new. Only what ``weights_only`` loads is accepted (else ``TypeError``)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to("cpu", copy=True) if t.device.type != "cpu" else t.clone()
    if type(obj) in _ATOMS:
        return obj
    for atom in (bool, int, float, str):  # subclasses (enums, torch's version string) as the plain type
        if isinstance(obj, atom):
            return atom(obj)
    if isinstance(obj, np.generic) and not isinstance(obj, np.ndarray):
        return obj.item()  # numpy scalar -> the Python number it holds
    if isinstance(obj, Mapping):
        return {k: snapshot(v, f"{where}[{k!r}]") for k, v in obj.items()}
    if isinstance(obj, list):
        return [snapshot(v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return tuple(snapshot(v, f"{where}[{i}]") for i, v in enumerate(obj))
    raise TypeError(
        f"checkpoint {where} is a {type(obj).__module__}.{type(obj).__qualname__}; a checkpoint holds only "
        "tensors, numbers, strings, None and dicts/lists/tuples of them (it is loaded with "
        "torch.load(weights_only=True), which runs no pickled code). Fix: convert it, e.g. "
        "torch.as_tensor(x) for a numpy array, or save its state_dict() instead of the object")


def capture_rng() -> dict[str, Any]:
    """This process's global RNG states (Python, NumPy's legacy global, torch CPU and CUDA) as plain data."""
    version, py_state, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    out: dict[str, Any] = {
        "python": {"version": int(version), "state": torch.tensor(py_state, dtype=torch.int64),
                   "gauss": gauss},
        "numpy": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(state: Mapping[str, Any]) -> None:
    """Set the global RNG states from ``capture_rng()``'s output."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), int(n["pos"]), int(n["has_gauss"]),
                         float(n["cached_gaussian"])))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_joining_rank(seed: int, step: int, rank: int) -> None:
    """Seed Python's, NumPy's and torch's generators for a rank that joins a resized (elastic) trial at
    ``step``, whose checkpoint holds no RNG states of its own: a function of the trial's seed, the
    step and the rank, so reruns draw the same."""
    digest = hashlib.sha256(f"{seed}:{step}:{rank}".encode()).digest()
    value = int.from_bytes(digest[:8], "little")
    random.seed(value)
    np.random.seed(value % (2**32))
    torch.manual_seed(value % (2**63))


# -- the per-rank manager ------------------------------------------------------------------------------
class Checkpointer:
    """Saves and finds this rank's checkpoints in ``directory``; see the module docstring."""

    def __init__(self, directory: Path, rank: int = 0, world_size: int = 1, keep: int = 2,
                 background: bool = True, elastic: bool = False) -> None:
        if keep < 1:
            raise ValueError(f"checkpoint keep >= 1 must hold, but got keep={keep}. Fix: set training.checkpoint.keep")
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.keep = keep
        self.background = background
        # Elastic (every rank holds the same state, e.g. DDP's model and optimizer): a step written by
        # W ranks resumes on any number of ranks; ranks >= W take rank 0's state (``latest``).
        self.elastic = elastic
        self.last_step: int | None = None  # newest step saved (or resumed from) by this rank
        self.last_size = 0  # bytes of the newest file written
        self.write_s = 0.0  # seconds the writes took (in the background thread when background)
        self.errors = 0
        self.last_error: BaseException | None = None
        # Background writes: one long-lived writer thread fed by a queue (starting a thread per save
        # would hand it the GIL for a switch interval, ~5 ms, on the training thread). The writer
        # exits after _WRITER_IDLE_S without work, so an unclosed Checkpointer leaks no thread in a
        # warm worker; ``_lock`` makes "exit when idle" and "queue a job" exclusive.
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[tuple[dict[str, Any], int] | None] = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._idle = threading.Event()
        self._idle.set()
        if background:
            with self._lock:
                self._start_writer()

    # -- saving -----------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int) -> None:
        """Checkpoint ``state`` as ``step``: waits for the previous write, copies ``state`` now,
        writes it now or in the background. A failed write warns and is counted (training goes on)."""
        self.wait()
        payload = {"format": FORMAT_VERSION, "step": int(step), "rank": self.rank, "world_size": self.world_size,
                   "torch": str(torch.__version__), "time": time.time(), "state": snapshot(state)}
        self.last_step = int(step)
        if self.background:
            with self._lock:
                self._idle.clear()
                if self._writer is None:
                    self._start_writer()
                self._jobs.put((payload, int(step)))
        else:
            self._write(payload, int(step))

    def _start_writer(self) -> None:
        self._writer = threading.Thread(target=self._serve, name=f"hpoflow-checkpoint-r{self.rank}", daemon=True)
        self._writer.start()

    def _serve(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_WRITER_IDLE_S)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._writer = None
                        return
                continue
            if job is None:
                return
            try:
                self._write(*job)
            finally:
                self._idle.set()

    def _write(self, payload: dict[str, Any], step: int) -> None:
        t0 = time.perf_counter()
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self.last_size = write_checkpoint(self.directory / checkpoint_name(step, self.rank), payload)
            self._prune()
        except Exception as exc:  # a checkpoint is a safety net: losing one must not fail the trial
            self.errors += 1
            self.last_error = exc
            log.warning("rank %d could not write checkpoint step %d in %s: %s: %s. Training goes on; a crash "
                        "would resume from an older checkpoint", self.rank, step, self.directory,
                        type(exc).__name__, exc)
        finally:
            self.write_s += time.perf_counter() - t0

    def wait(self) -> None:
        """Block until the background write (if any) has finished."""
        self._idle.wait()

    def close(self) -> None:
        """Flush: wait for the last write and stop the writer thread. Idempotent; a later save
        starts a new writer."""
        self.wait()
        with self._lock:
            writer, self._writer = self._writer, None
            if writer is not None:
                self._jobs.put(None)
        if writer is not None:
            writer.join()

    # -- the directory ----------------------------------------------------------------------------
    def _listing(self) -> dict[int, set[int]]:
        """rank -> steps with a file under its final name."""
        out: dict[int, set[int]] = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return out
        for name in names:
            parsed = parse_name(name)
            if parsed is not None:
                out.setdefault(parsed[1], set()).add(parsed[0])
        return out

    def _prune(self) -> None:
        listing = self._listing()
        own = sorted(listing.get(self.rank, set()))
        everyone = set(own)
        for r in range(self.world_size):
            everyone &= listing.get(r, set())
        if not everyone:
            return
        committed = max(everyone)
        for step in own[: -self.keep]:
            if step < committed:
                (self.directory / checkpoint_name(step, self.rank)).unlink(missing_ok=True)
        if self.elastic and self.rank == 0:  # files of ranks a shrunk trial no longer has
            for r, steps in listing.items():
                if r >= self.world_size:
                    for step in steps:
                        if step < committed:
                            (self.directory / checkpoint_name(step, r)).unlink(missing_ok=True)

    def _scan(self) -> dict[int, dict[str, Any]]:
        """This rank's usable checkpoints, step -> payload; warns once per unusable file."""
        found: dict[int, dict[str, Any]] = {}
        for step in sorted(self._listing().get(self.rank, set()), reverse=True):
            path = self.directory / checkpoint_name(step, self.rank)
            try:
                payload = read_checkpoint(path)
                problem = self._mismatch(payload, step)
            except (CheckpointError, OSError) as exc:
                problem = str(exc)
            if problem:
                where = "" if problem.startswith(str(path)) else f"{path}: "
                warnings.warn(f"hpoflow: rank {self.rank}: skipping checkpoint {where}{problem}", RuntimeWarning,
                              stacklevel=3)
                continue
            found[step] = payload
        return found

    def _mismatch(self, payload: Any, step: int, rank: int | None = None) -> str | None:
        if not isinstance(payload, dict) or "state" not in payload:
            return "not an hpoflow checkpoint payload (no 'state')"
        rank = self.rank if rank is None else rank
        got = (payload.get("step"), payload.get("rank"), payload.get("world_size"))
        if self.elastic:  # any world size resumes; it must be a number
            if got[:2] != (step, rank) or not isinstance(got[2], int) or got[2] < 1:
                return (f"it holds step={got[0]}, rank={got[1]}, world_size={got[2]} but its name says "
                        f"step={step}, rank={rank}")
            return None
        if got != (step, self.rank, self.world_size):
            return (f"it holds step={got[0]}, rank={got[1]}, world_size={got[2]} but this rank expects "
                    f"step={step}, rank={self.rank}, world_size={self.world_size} (a checkpoint resumes "
                    "only with the same number of processes)")
        return None

    def _scan_elastic(self) -> dict[int, tuple[dict[str, Any], bool]]:
        """Elastic: step -> (this rank's state for it, whether it is another rank's), for every step
        whose writers (ranks ``0 .. W-1`` of the world ``W`` that wrote it) all left a file under its
        final name and whose file this rank reads (its own if it was among them, else rank 0's)."""
        listing = self._listing()
        found: dict[int, tuple[dict[str, Any], bool]] = {}
        for step in sorted(listing.get(0, set()), reverse=True):
            try:
                chief = read_checkpoint(self.directory / checkpoint_name(step, 0))
                problem = self._mismatch(chief, step, 0)
                if problem is None:
                    world = int(chief["world_size"])
                    missing = [r for r in range(world) if step not in listing.get(r, set())]
                    if missing:
                        continue  # not written by every rank yet (or a crash in the middle): not a step
                    own: Any = chief
                    if 0 < self.rank < world:
                        own = read_checkpoint(self.directory / checkpoint_name(step, self.rank))
                        problem = self._mismatch(own, step)
            except (CheckpointError, OSError) as exc:
                problem = str(exc)
            if problem:
                warnings.warn(f"hpoflow: rank {self.rank}: skipping checkpoint step {step} in {self.directory}: "
                              f"{problem}", RuntimeWarning, stacklevel=3)
                continue
            found[step] = (own, self.rank >= world)
        return found

    def latest_any_world(self, gather: Gather | None = None) -> tuple[int, dict[str, Any], bool] | None:
        """Elastic ``latest``: the newest step usable on every rank, this rank's state for it, and
        whether that state is rank 0's (this rank did not exist when it was written: its RNG states
        are not its own)."""
        self.wait()
        self._remove_temp_files()
        found = self._scan_elastic()
        chosen, _, _ = self._agree(sorted(found), gather)
        if chosen is None:
            return None
        self.last_step = chosen
        payload, foreign = found[chosen]
        return chosen, payload["state"], foreign

    def latest(self, gather: Gather | None = None) -> tuple[int, dict[str, Any]] | None:
        """The newest step valid on every rank and this rank's state for it, or ``None``.

        ``gather(my_valid_steps)`` returns every rank's list (a collective in a distributed trial);
        without it only this rank's files count. Files of this rank newer than the chosen step (an
        abandoned future of a crashed run) and stale temporary files are deleted; a warning says
        when files exist but none is usable.
        """
        self.wait()
        self._remove_temp_files()
        found = self._scan()
        mine = sorted(found)
        chosen, lists, own_files = self._agree(mine, gather)
        if chosen is None:
            if own_files:
                warnings.warn(
                    f"hpoflow: rank {self.rank}: no checkpoint in {self.directory} is valid on every rank "
                    f"(this rank's valid steps: {mine}; all ranks': {lists}); starting from scratch",
                    RuntimeWarning, stacklevel=2)
            return None
        self.last_step = chosen
        return chosen, found[chosen]["state"]

    def _agree(self, mine: list[int], gather: Gather | None) -> tuple[int | None, list[list[int]], set[int]]:
        """The newest of this rank's usable ``mine`` that every rank has (``gather``: every rank's
        list; None: this rank's only), every rank's lists, and this rank's files before this rank's
        files newer than the chosen step (an abandoned future of a crashed run) were deleted."""
        lists = gather(mine) if gather is not None else [mine]
        common = set(mine)
        for steps in lists:
            common &= set(steps)
        chosen = max(common) if common else None
        own_files = self._listing().get(self.rank, set())
        for step in own_files:
            if chosen is None or step > chosen:
                (self.directory / checkpoint_name(step, self.rank)).unlink(missing_ok=True)
        return chosen, lists, own_files

    def _remove_temp_files(self) -> None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        mine = f"-r{self.rank}.pt."  # write_atomic's temp files: .<name>.<random>.tmp
        for name in names:
            if name.startswith(".ckpt-") and mine in name and name.endswith(".tmp"):
                (self.directory / name).unlink(missing_ok=True)
