"""The engine contract: how trials run, separate from what runs next (the driver and the search).

An engine takes ``TrialRequest``s and hands back, in whatever order they happen, ``TrialReport``s
(an intermediate metric from a running trial) and ``TrialResult``s (a trial has ended). The driver
is the only caller and calls from one thread; engines need not be thread safe.

Contract, for every engine:
- ``submit(request)`` starts the trial or raises ``EngineError`` if it can never fit; it returns
  quickly (it never waits for the trial).
- ``poll(timeout)`` waits up to ``timeout`` seconds (``None``: until something happens) and returns
  every event that has happened since the last call, in the order they happened; ``[]`` on timeout.
  Each submitted trial produces exactly one ``TrialResult``, after all of its ``TrialReport``s.
- A trial never raises through the engine: failures (exceptions in user code, a rank that died or
  hung, a timeout) come back as a ``TrialResult`` with status ``failed`` and the error and stderr tail.
- ``answer(number, prune, pause=False)`` replies to a report that asked for a pruning decision. An
  engine may hold the reply until its next ``poll`` (the local and compss engines do for elastic
  trials: by then the driver has submitted what it could, and the reply adds the number of ranks to
  continue with). ``pause=True`` (a scheduler, docs/schedulers.md) asks the trial to checkpoint at this
  step and stop: its result is ``cancelled`` ("paused ..."), and a later ``submit`` of the same trial
  number with its checkpoint directory resumes it from there.
- ``cancel(number, reason)`` stops a running trial; its result arrives later with status
  ``cancelled`` (or whatever it had already finished with).
- ``pause(number, reason)`` asks a running trial to stop at its next step with a checkpoint (a
  walltime warning, a preemption): its ranks get SIGUSR1 (or see a ``PAUSE`` file) and agree on a step;
  its result arrives later with status ``cancelled`` ("paused ..."), or ``cancelled`` by a kill if it
  did not stop within the engine's grace. The default cancels.
- ``interrupt()`` says a stop has begun (the driver's ``request_stop``, maybe from a signal handler, so
  it only sets flags and sends signals: no lock, no wait): from then on the engine starts no helper
  process again (no restart of anything that died), and a ``submit`` it cannot serve without starting
  or waiting for one returns at once, the trial's result ``cancelled``. The default does nothing.
- ``close()`` cancels what is running, reaps every process, and is idempotent.

Built from a spec: an engine registered in ``hpoflow.registry.ENGINES`` is made by
``cls.from_options(options, run_dir)`` with its validated options model, and ``hpoflow validate`` asks
``cls.check_fit(options, request)`` whether a trial of the spec's shape can ever run on it, before
anything starts.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from hpoflow.trial import Event, TrialReport, TrialRequest, TrialResult, TrialStatus

if TYPE_CHECKING:
    from hpoflow.engines.machine import GpuId

__all__ = [
    "Engine",
    "Event",
    "Placement",
    "TrialReport",
    "TrialRequest",
    "TrialResult",
    "TrialStatus",
]

@dataclass(frozen=True)
class Placement:
    """Where one rank of a trial runs on this machine: cores and GPUs it may use (GPU indices or UUIDs, as
    ``CUDA_VISIBLE_DEVICES`` names them: ``hpoflow.engines.machine.GpuId``); ``share``: the part of its one
    GPU the rank may use when it shares the GPU with ranks of other trials (None: its GPUs are whole)."""

    rank: int
    cores: tuple[int, ...]
    gpus: tuple[GpuId, ...] = ()
    share: Fraction | None = None


class Engine(abc.ABC):
    """Runs trials. See the module docstring for the contract every implementation keeps."""

    name: str = "engine"

    @classmethod
    def from_options(cls, options: Any, run_dir: Path | None = None) -> Self:
        """The engine a spec asks for: ``options`` is its validated options model (``engine_options``)."""
        raise NotImplementedError(f"{cls.__name__} cannot be built from a spec: it defines no from_options()")

    @classmethod
    def check_fit(cls, options: Any, request: TrialRequest) -> None:
        """Raise ``EngineError`` (the numbers and the fix) when a trial shaped like ``request`` can never
        run on an engine built from ``options``; called by ``hpoflow validate`` without starting
        anything. The default knows nothing before the engine runs."""
        return None

    @abc.abstractmethod
    def capacity(self, request: TrialRequest) -> int:
        """How many trials shaped like ``request`` can run at once (0: it can never fit)."""

    @abc.abstractmethod
    def submit(self, request: TrialRequest) -> None: ...

    def prepare(self, request: TrialRequest) -> None:
        """``request`` will be submitted when a slot frees (the driver asked for it ahead, while every slot
        is busy): an engine may make ready now what its start needs on disk, off the path from one trial's
        end to the next one's start. It may never be submitted (the study stopped); what was made for it
        is then removed by ``close``. The default does nothing."""
        return None

    @abc.abstractmethod
    def poll(self, timeout: float | None) -> list[Event]: ...

    @abc.abstractmethod
    def answer(self, number: int, prune: bool, pause: bool = False) -> None: ...

    @abc.abstractmethod
    def cancel(self, number: int, reason: str) -> None: ...

    def pause(self, number: int, reason: str) -> None:
        """Ask trial ``number`` to stop at its next step with a checkpoint (see the module docstring)."""
        self.cancel(number, reason)

    def expect_runs(self, runs: int, worst: int) -> None:
        """Before its first trial the driver says how many trial runs the study may start: ``runs``
        (every trial, each rung or interval a run of its own) and ``worst`` (each run also retried
        ``resources.max_retries`` times). An engine with a limit on them warns; the default does nothing."""
        return None

    def interrupt(self) -> None:
        """A stop has begun: start nothing more, wait for nothing (see the module docstring)."""
        return None

    @abc.abstractmethod
    def running(self) -> list[int]:
        """Numbers of the trials submitted whose result has not been returned by ``poll`` yet."""

    @abc.abstractmethod
    def close(self) -> None: ...

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
