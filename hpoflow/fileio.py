"""Atomic files: readers see the old file or the whole new one, never a part.

Every file hpoflow writes that another process may read while it is written (results, reports'
answers, checkpoints, ``trials.csv``, ``best.yaml``, ``run.json``) goes through ``write_atomic``.
Standard library only.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["append_jsonl", "fsync_dir", "read_json", "umask", "write_atomic", "write_json_atomic"]


def umask() -> int:
    """The process umask, read without changing it (``os.umask`` sets it, a race for other threads)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)  # no /proc (not Linux): the set-and-restore dance is the only way
    os.umask(old)
    return old


def fsync_dir(directory: Path) -> None:
    """fsync a directory so a rename inside it survives a crash (no-op where that is unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some filesystems cannot open a directory: nothing more to do
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, *chunks: str | bytes | memoryview, mode: int = 0o666, durable: bool = True) -> None:
    """Write ``chunks`` (text is UTF-8 encoded) to ``path`` atomically.

    The data goes to a temporary file in the same directory, is fsynced, then renamed over ``path``
    (atomic on POSIX, also on NFS/GPFS for a rename within one directory); the directory is fsynced
    so the rename survives a crash of the node. The file gets ``mode`` less the process umask, like
    any file ``open()`` creates. Missing parent directories are created. A crash can leave the
    temporary file behind, named ``.<name>.<random>.tmp`` beside ``path``. ``durable=False`` skips
    both fsyncs (still atomic for readers; a crash of the node may lose the file, never show a part).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        try:
            os.fchmod(fd, mode & ~umask())
            for chunk in chunks:
                view = memoryview(chunk.encode("utf-8") if isinstance(chunk, str) else chunk)
                while view:
                    view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if durable:
        fsync_dir(path.parent)


def write_json_atomic(path: Path, data: Any) -> None:
    write_atomic(path, json.dumps(data, sort_keys=True, default=str))


def read_json(path: Path) -> Any | None:
    """The JSON in ``path``, or ``None`` if it does not exist (yet) or is not valid JSON."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def append_jsonl(path: Path, record: Any) -> None:
    """Append ``record`` as one JSON line to ``path`` and fsync it (a reader uses whole lines only)."""
    line = json.dumps(record, sort_keys=True) + "\n"
    with open(path, "a", encoding="utf-8") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())
