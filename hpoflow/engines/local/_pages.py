"""The forkserver lets go of the library pages it touched only while importing.

Importing torch runs its static initialisers, which touch much of ``libtorch_cpu.so``'s code; a
training step later needs a fraction of it. The forkserver keeps every page it touched mapped: ~45 MB
of torch's code that no worker maps, counted to the study's memory for as long as it runs. A worker
forked afterwards maps library code itself, from the page cache, as it first runs it (``fork`` does not
copy the page tables of a file mapping without private copies), whatever the forkserver holds.

``drop_clean_file_pages`` unmaps (``madvise(MADV_DONTNEED)``) the pages of every read-only file
mapping that holds no private copy: code and read-only data, exactly as the file has them. The pages
stay in the page cache; the kernel keeps or reclaims them like any cached file, and a later touch maps
them again. A writable mapping, or one with a private copy (relocated data: ``Anonymous`` above zero in
``/proc/self/smaps``), is left alone: dropping it would lose what was written. Linux only; elsewhere,
and wherever ``/proc`` or ``madvise`` is not there, nothing is done.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass

__all__ = ["drop_clean_file_pages"]

_MADV_DONTNEED = 4  # the same value on every Linux architecture


@dataclass
class _Mapping:
    start: int
    end: int
    perms: str
    path: str
    rss_kb: int = 0
    anon_kb: int = -1  # not read: never dropped


def _mappings() -> list[_Mapping]:
    out: list[_Mapping] = []
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(None, 5)
            if not head:
                continue
            if head[0].endswith(":"):  # a field of the mapping above
                if out and head[0] == "Rss:":
                    out[-1].rss_kb = int(head[1])
                elif out and head[0] == "Anonymous:":
                    out[-1].anon_kb = int(head[1])
                continue
            start, _, end = head[0].partition("-")
            path = head[5].strip() if len(head) > 5 else ""
            out.append(_Mapping(int(start, 16), int(end, 16), head[1], path))
    return out


def _droppable(m: _Mapping) -> bool:
    return (m.path.startswith("/") and not m.path.endswith("(deleted)") and "w" not in m.perms
            and m.anon_kb == 0 and m.rss_kb > 0)


def drop_clean_file_pages() -> int:
    """Unmap the pages of this process's read-only file mappings that hold no private copy (see the
    module docstring); returns the resident kB they held (0 where nothing could be done)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        madvise = libc.madvise
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        madvise.restype = ctypes.c_int
        maps = _mappings()
    except (OSError, AttributeError, ValueError):
        return 0
    dropped = 0
    for m in maps:
        if _droppable(m) and madvise(m.start, m.end - m.start, _MADV_DONTNEED) == 0:
            dropped += m.rss_kb
    return dropped
