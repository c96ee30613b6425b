"""The ``replica`` format (the default): every rank writes its whole state to its own file.

Layout: one file per rank and step in the trial's checkpoint directory, ``ckpt-<step:08d>-r<rank>.pt``
(``hpoflow.train.checkpoint._file``: a checked header, then ``torch.save`` read with ``weights_only``).
Every rank writes its own because strategies keep per-rank state (EASGD's and local SGD's worker
models, the parameter server's shards of optimizer state), and so do the RNG streams; writing needs
no collective, so it can run in a background thread. A step is *complete* when every rank
``0 .. world_size-1`` has a valid file for it; a resume takes the newest step that is complete and
valid for every rank (agreed by a collective in a distributed trial).

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

Threads: ``save`` copies the state (CPU tensors, new containers) on the calling thread; with
``background=True`` a writer thread serialises and writes it while training goes on. A save first
waits for the previous write. ``close()`` waits for the last one and stops the writer.

Subclasses change what a rank writes (``_payload``), how a rank's state is composed from the files
(``_compose``, ``needs_chief``: ``rank0``) and the file encoding (``_write_file``, ``_read_file``,
``prefix``, ``suffix``: ``safetensors``).
"""

from __future__ import annotations

import logging
import os
import queue
import re
import threading
import time
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hpoflow.registry import Options
from hpoflow.train.checkpoint._base import CheckpointError, CheckpointFormat, Gather, Template
from hpoflow.train.checkpoint._file import FORMAT_VERSION, read_checkpoint, snapshot, write_checkpoint

log = logging.getLogger("hpoflow.train.checkpoint")

__all__ = ["Checkpointer"]

_WRITER_IDLE_S = 10.0


class _Unusable(Exception):
    """A step this rank cannot resume from (the message says why)."""


class Checkpointer(CheckpointFormat):
    """The ``replica`` format: saves and finds this rank's checkpoints in ``directory``; see the
    module docstring."""

    name = "replica"
    prefix: ClassVar[str] = "ckpt"
    suffix: ClassVar[str] = ".pt"
    #: a rank's state needs rank 0's file too (``rank0``: the state is there, the rank's file holds its RNG)
    needs_chief: ClassVar[bool] = False

    def __init__(self, directory: Path, rank: int = 0, world_size: int = 1, keep: int = 2,
                 background: bool = True, elastic: bool = False, options: Options | None = None) -> None:
        super().__init__(directory, rank, world_size, keep, background, elastic, options)
        self._name_re = re.compile(rf"^{re.escape(self.prefix)}-(\d{{8}})-r(\d+){re.escape(self.suffix)}$")
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

    # -- what a rank writes, how a rank's state is made from files, the file encoding ------------------
    def file_name(self, step: int, rank: int) -> str:
        if step < 0 or rank < 0:
            raise ValueError(f"checkpoint step and rank must be >= 0, but got step={step}, rank={rank}")
        return f"{self.prefix}-{step:08d}-r{rank}{self.suffix}"

    def parse(self, name: str) -> tuple[int, int] | None:
        """``(step, rank)`` of one of this format's file names, or ``None`` for any other file."""
        m = self._name_re.match(name)
        return (int(m.group(1)), int(m.group(2))) if m else None

    def _payload(self, state: Mapping[str, Any], private: Mapping[str, Any]) -> dict[str, Any]:
        """What this rank's file holds beside the header fields (copied now: training goes on)."""
        return {"state": snapshot({**state, **private})}

    def _compose(self, chief: dict[str, Any], own: dict[str, Any] | None) -> dict[str, Any]:
        """This rank's state from rank 0's payload and its own (``None``: it was not in that world)."""
        state: dict[str, Any] = (own if own is not None else chief)["state"]
        return state

    def _write_file(self, path: Path, payload: dict[str, Any]) -> int:
        return write_checkpoint(path, payload)

    def _read_file(self, path: Path) -> Any:
        return read_checkpoint(path)

    # -- saving -----------------------------------------------------------------------------------
    def save(self, state: Mapping[str, Any], step: int, private: Mapping[str, Any] | None = None, *,
             sharded: Mapping[str, Any] | None = None) -> None:
        """Checkpoint ``state`` as ``step``: waits for the previous write, copies ``state`` now,
        writes it now or in the background. A failed write warns and is counted (training goes on)."""
        self._no_sharded(sharded)
        self.wait()
        payload = {"format": FORMAT_VERSION, "step": int(step), "rank": self.rank, "world_size": self.world_size,
                   "torch": str(torch.__version__), "time": time.time(), **self._payload(state, private or {})}
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
            self.last_size = self._write_file(self.directory / self.file_name(step, self.rank), payload)
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

    def step_files(self, step: int) -> list[Path]:
        return [self.directory / self.file_name(step, r) for r, steps in sorted(self._listing().items())
                if step in steps]

    # -- the directory ----------------------------------------------------------------------------
    def _listing(self) -> dict[int, set[int]]:
        """rank -> steps with a file under its final name."""
        out: dict[int, set[int]] = {}
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return out
        for name in names:
            parsed = self.parse(name)
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
                (self.directory / self.file_name(step, self.rank)).unlink(missing_ok=True)
        if self.elastic and self.rank == 0:  # files of ranks a shrunk trial no longer has
            for r, steps in listing.items():
                if r >= self.world_size:
                    for step in steps:
                        if step < committed:
                            (self.directory / self.file_name(step, r)).unlink(missing_ok=True)

    def _read_checked(self, step: int, rank: int) -> dict[str, Any]:
        """Rank ``rank``'s payload for ``step``, checked against its name and (not elastic) this world."""
        path = self.directory / self.file_name(step, rank)
        try:
            payload = self._read_file(path)
        except (CheckpointError, OSError) as exc:
            raise _Unusable(str(exc)) from exc
        problem = self._mismatch(payload, step, rank)
        if problem:
            raise _Unusable(f"{path}: {problem}")
        return dict(payload)

    def _scan(self) -> dict[int, dict[str, Any]]:
        """This rank's usable checkpoints, step -> state; warns once per unusable file."""
        found: dict[int, dict[str, Any]] = {}
        for step in sorted(self._listing().get(self.rank, set()), reverse=True):
            try:
                own = self._read_checked(step, self.rank)
                chief = self._read_checked(step, 0) if self.needs_chief and self.rank != 0 else own
                found[step] = self._compose(chief, own)
            except _Unusable as exc:
                warnings.warn(f"hpoflow: rank {self.rank}: skipping checkpoint {exc}", RuntimeWarning, stacklevel=3)
        return found

    def _mismatch(self, payload: Any, step: int, rank: int) -> str | None:
        if not isinstance(payload, dict) or "state" not in payload:
            return "not an hpoflow checkpoint payload (no 'state')"
        got = (payload.get("step"), payload.get("rank"), payload.get("world_size"))
        if self.elastic:  # any world size resumes; it must be a number
            if got[:2] != (step, rank) or not isinstance(got[2], int) or got[2] < 1:
                return (f"it holds step={got[0]}, rank={got[1]}, world_size={got[2]} but its name says "
                        f"step={step}, rank={rank}")
            return None
        if got != (step, rank, self.world_size):
            return (f"it holds step={got[0]}, rank={got[1]}, world_size={got[2]} but this rank expects "
                    f"step={step}, rank={rank}, world_size={self.world_size} (a checkpoint resumes "
                    "only with the same number of processes)")
        return None

    def _scan_elastic(self) -> dict[int, tuple[dict[str, Any], bool]]:
        """Elastic: step -> (this rank's state for it, whether it is another rank's), for every step
        whose writers (ranks ``0 .. W-1`` of the world ``W`` that wrote it) all left a file under its
        final name and whose files this rank reads (its own if it was among them, and rank 0's)."""
        listing = self._listing()
        found: dict[int, tuple[dict[str, Any], bool]] = {}
        for step in sorted(listing.get(0, set()), reverse=True):
            try:
                chief = self._read_checked(step, 0)
                world = int(chief["world_size"])
                if any(step not in listing.get(r, set()) for r in range(world)):
                    continue  # not written by every rank yet (or a crash in the middle): not a step
                own = chief if self.rank == 0 else self._read_checked(step, self.rank) if self.rank < world else None
                found[step] = (self._compose(chief, own), own is None)
            except _Unusable as exc:
                warnings.warn(f"hpoflow: rank {self.rank}: skipping checkpoint step {step} in {self.directory}: "
                              f"{exc}", RuntimeWarning, stacklevel=3)
        return found

    def latest_any_world(self, gather: Gather | None = None, *,
                         sharded: Template | None = None) -> tuple[int, dict[str, Any], bool] | None:
        """Elastic ``latest``: the newest step usable on every rank, this rank's state for it, and
        whether that state is rank 0's (this rank did not exist when it was written: its RNG states
        are not its own)."""
        self._no_sharded(sharded)
        self.wait()
        self._remove_temp_files()
        found = self._scan_elastic()
        chosen, _, _ = self._agree(sorted(found), gather)
        if chosen is None:
            return None
        self.last_step = chosen
        state, foreign = found[chosen]
        return chosen, state, foreign

    def latest(self, gather: Gather | None = None, *,
               sharded: Template | None = None) -> tuple[int, dict[str, Any]] | None:
        """The newest step valid on every rank and this rank's state for it, or ``None``.

        ``gather(my_valid_steps)`` returns every rank's list (a collective in a distributed trial);
        without it only this rank's files count. Files of this rank newer than the chosen step (an
        abandoned future of a crashed run) and stale temporary files are deleted; a warning says
        when files exist but none is usable.
        """
        self._no_sharded(sharded)
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
        return chosen, found[chosen]

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
                (self.directory / self.file_name(step, self.rank)).unlink(missing_ok=True)
        return chosen, lists, own_files

    def _remove_temp_files(self) -> None:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return
        mine = f"-r{self.rank}{self.suffix}."  # write_atomic's temp files: .<name>.<random>.tmp
        for name in names:
            if name.startswith(f".{self.prefix}-") and mine in name and name.endswith(".tmp"):
                (self.directory / name).unlink(missing_ok=True)
