"""Peak memory of one rank's training: the ``peak_memory_mb`` metric of the built-in trainer.

On the CPU it is the rank's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``) minus
its resident set when the meter started, and minus the file-backed pages it has mapped since
(``RssFile``), in MiB: the meter starts after the data set is loaded and before the model is built,
and resets the high-water mark there (writing ``5`` to ``/proc/self/clear_refs``, Linux >= 4.0), so
the figure is what training added at its peak: weights, gradients, optimizer state, activations,
communication buffers, checkpoint snapshots and the allocator's slack, and not the interpreter,
torch's libraries or the data set (nor what an earlier trial in the same warm worker left behind;
nor ``torch._dynamo``, about 70 MB of code and tables that the first optimizer a process builds
imports, which the meter imports before it starts). On a CUDA device it is torch's peak allocation
on that device since the start (``torch.cuda.max_memory_allocated``), in MiB. ``None`` where neither
can be read (another system).

Library code is mapped page by page as it first runs (the local engine's forkserver lets go of the
pages its imports touched, ``hpoflow.engines.local._pages``, and a forked process maps its own
anyway): the first training steps of the built-in ``gpt`` map ~30 MB of ``libtorch_cpu.so`` and
``libtorch_python.so`` that the resident set, and so its high-water mark, count, about as much for
every strategy (measured on 2 gloo ranks: allreduce 29.7, zero1 27.4, fsdp 31.7 MiB), which is no
memory training holds. File-backed pages only grow while nothing reclaims them, so the growth read
at the end is what they added at the peak whenever the peak comes after the code ran (any step after
the first: the first has no optimizer state yet); a peak before the last new code ran is read low by
what that code mapped. A file a trial maps itself (``np.load(mmap_mode=...)``,
``torch.load(mmap=True)``) is left out the same way: page cache, which the kernel may reclaim.

For the resident set to follow the tensors that are alive, the meter sets glibc's allocator (where it
is glibc) to give every allocation of ``MMAP_THRESHOLD`` (256 KiB) or more its own mapping, returned to
the kernel when the tensor is freed (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc raising that
threshold as it would after the first large frees), and hands the heap's free pages back to the
kernel first (``malloc_trim(0)``). Without that, glibc keeps freed blocks of up to 32 MiB in its heap
and the resident set shows the most the heap ever held, allocation pattern included: FSDP's
all-gather buffers, freed and taken again per block, then look larger than DDP's whole replica
(bench/strategies.py prints the figures with it). A tensor under 256 KiB stays in the heap; the
setting stays for the worker's later trials.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import re

import torch

__all__ = ["MMAP_THRESHOLD", "PeakMemory"]

_MIB = 1024 * 1024
_STATUS = "/proc/self/status"


def _status_kib(*fields: str) -> list[int | None]:
    """The ``/proc/self/status`` fields in kB, read at one instant (``None`` for each missing)."""
    try:
        with open(_STATUS) as f:
            text = f.read()
    except OSError:
        return [None] * len(fields)
    found = (re.search(rf"^{field}:\s+(\d+) kB", text, re.MULTILINE) for field in fields)
    return [int(m.group(1)) if m else None for m in found]


MMAP_THRESHOLD = 256 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def _own_mappings() -> None:
    """Large allocations in their own mappings, and the heap's free pages returned (glibc only;
    elsewhere nothing happens)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakMemory:
    """Started at construction; ``mb()`` is the peak since then (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        import torch._dynamo  # a one-time import of torch.optim's, not training memory

        self.device = device
        self._base_kib: int | None = None
        self._base_file_kib: int | None = None
        self._reset = False
        if device.type == "cuda":
            # CUDA's caching allocator exists only once CUDA is initialised: before (a whole GPU's first
            # trial, nothing on the device yet) the reset raised "Invalid device argument" (torch 2.11)
            torch.cuda.init()
            torch.cuda.reset_peak_memory_stats(device)
            return
        _own_mappings()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._reset = True
        except OSError:
            self._reset = False
        if self._reset:
            self._base_kib, self._base_file_kib = _status_kib("VmRSS", "RssFile")

    def mb(self) -> float | None:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / _MIB
        if self._base_kib is None:
            return None
        peak, file = _status_kib("VmHWM", "RssFile")
        if peak is None:
            return None
        mapped = max(0, file - self._base_file_kib) if file is not None and self._base_file_kib is not None else 0
        return max(0, peak - self._base_kib - mapped) / 1024
