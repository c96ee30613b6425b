"""The first module the local engine's forkserver imports: until the preload ends (``_preload_done``),
the forkserver exits as soon as the process that started it has.

multiprocessing's forkserver notices its parent's end only in its loop, after the preload (and even
there only once no fork request is queued: a request waiting on the preload holds the parent's end of
the "alive" pipe in the socket's queue). A driver killed while its forkserver imported torch
(``kill -9``, the OOM killer, a test that kills it) left the forkserver importing and warming up for
seconds more (2-2.5 CPU-s here) for a process nobody would ask to fork anything. This module checks,
before each module the preload imports (an import hook that finds nothing), whether this process was
reparented (its parent's exit hands its children to a reaper), and then exits at once.

A parent that ended before this module was imported (the interpreter's first ~50 ms) goes unnoticed:
the preload then runs to its end, as it did before, and the forkserver's loop ends it.

It also turns Python's cyclic garbage collector off for the preload (``remove``, from ``_preload_done``,
turns it back on; the warm-up, or else ``_preload_done``, collects once). Importing torch,
``torch._dynamo`` and hpoflow's trainer and warming up makes little cyclic garbage (some 9,000
unreachable objects in all, of ~300,000, freed by that one collection), while the collector's
automatic passes over the growing heap cost about 0.4 CPU-s of a 2.2-2.7-CPU-s preload (``python -c
"import gc; gc.disable(); import hpoflow.engines.local._preload"`` against the same without
``gc.disable()``). Imported anywhere but in a forkserver's preload
(``multiprocessing.forkserver.main`` on the stack), it installs nothing and leaves the collector alone.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType

__all__ = ["remove"]


class _ParentGone:
    """A meta path finder that finds nothing: it exits the process once it has another parent."""

    def __init__(self) -> None:
        self.parent = os.getppid()

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None) -> ModuleSpec | None:
        if os.getppid() != self.parent:
            os._exit(0)
        return None


def _in_forkserver_preload() -> bool:
    import multiprocessing.forkserver as fs

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is fs.main.__code__:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


_GUARD = _ParentGone()
_COLLECTOR_OFF = _in_forkserver_preload()
if _COLLECTOR_OFF:
    sys.meta_path.insert(0, _GUARD)
    gc.disable()


def remove() -> None:
    """The preload is done: the forkserver's own loop watches its parent from here on, and the cyclic
    collector is on again (the caller collects once, then freezes what is left)."""
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_GUARD)
    if _COLLECTOR_OFF:
        gc.enable()
