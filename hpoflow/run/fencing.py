"""Fencing: every attempt of a trial checkpoints where no other attempt writes.

A *chain* of attempts shares one checkpoint root: a trial's retries and promotions, and the reruns of an
interrupted trial (which inherit its checkpoint directory, ``ATTR_CHECKPOINTS``). Every attempt carries a
token that only grows along its chain, and that the storage hands out: (its trial number, its attempt).
A rerun's number is above the interrupted trial's; a retry or a promotion takes the next attempt.

- The chain's first attempt (attempt 0 of the trial whose directory holds the root,
  ``trials/<n>/checkpoints``) writes in the root itself.
- Every later attempt writes in a directory of its own beside the root, ``<root>.<number>.<attempt>``,
  made just before it is submitted by *moving* the newest older attempt's directory there (one rename,
  within one directory of the file system): it starts with that attempt's checkpoints, and that attempt's
  files are no longer where that attempt writes. With nothing to move it starts empty.
- An attempt resumes from its own directory only, and the newest token's directory is where the next
  attempt takes its checkpoints from; the older paths are never read again.

So an attempt given up for dead that still runs (its driver cut off from the storage by a network
partition while another driver reran its trial) cannot reach what a newer attempt reads: every checkpoint
format writes a file beside its final name and renames it into place, so its writes after the move land
in a directory it recreates at its old path, which no newer attempt reads, or fail (the file it was
writing moved away). Only bytes written in place into a file that was open across the move could follow
it; hpoflow writes no file in place in a checkpoint directory.

``link_tree`` copies a finished attempt's checkpoints for another chain (PBT's exploit, ``hpoflow.search.pbt``)
as hard links: no data is copied, and no file is written in place, so the two never change each other's.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import shutil
from pathlib import Path

__all__ = ["attempt_dir", "current", "link_tree"]

_log = logging.getLogger("hpoflow")
_TOKEN = re.compile(r"(\d+)\.(\d+)")


def _attempts(root: Path) -> dict[tuple[int, int], Path]:
    """The directories of later attempts beside ``root``, by token (number, attempt)."""
    try:
        names = os.listdir(root.parent)
    except OSError:
        return {}
    prefix = root.name + "."
    out = {}
    for name in names:
        m = _TOKEN.fullmatch(name[len(prefix):]) if name.startswith(prefix) else None
        if m:
            out[(int(m.group(1)), int(m.group(2)))] = root.parent / name
    return out


def current(root: Path, below: tuple[int, int] | None = None) -> Path:
    """The directory of the newest attempt of the chain with checkpoint root ``root`` (of the newest
    before the token ``below``, when given): the highest token's beside it, else the root."""
    older = {t: p for t, p in _attempts(root).items() if below is None or t < below}
    return older[max(older)] if older else root


def attempt_dir(root: Path, trial_dir: Path, number: int, attempt: int) -> Path:
    """The checkpoint directory of attempt ``attempt`` of trial ``number`` (run in ``trial_dir``) in the
    chain with root ``root``, made ready (module docstring): the root for the chain's first attempt,
    else its own directory, holding the checkpoints of the newest older attempt (moved there)."""
    if attempt == 0 and root == trial_dir / "checkpoints":
        return root
    own = root.with_name(f"{root.name}.{number}.{attempt}")
    if own.is_dir():  # made already: this very attempt, submitted again
        return own
    src = current(root, below=(number, attempt))
    try:
        os.rename(src, own)
        return own
    except FileNotFoundError:
        pass  # nothing checkpointed yet: it starts empty (still newer than any older path)
    except OSError as exc:
        why = exc
        if exc.errno == errno.EXDEV:  # the root is a mount point: copy (as links where it can)
            try:
                link_tree(src, own)
                return own
            except OSError as again:
                why = again
        _log.warning("attempt %d of trial %d starts without the checkpoints in %s, which it cannot take: %s",
                     attempt, number, src, why)
    with contextlib.suppress(OSError):  # (a directory this host cannot write: the trial's own writes say so)
        own.mkdir(parents=True, exist_ok=True)
    return own


def link_tree(src: Path, dst: Path) -> None:
    """``src``'s files into ``dst`` (made if need be; a file there of the same name is replaced): as hard
    links, copied where a link cannot be made (another file system, or one without hard links)."""
    shutil.copytree(src, dst, copy_function=_link_or_copy, dirs_exist_ok=True)


def _link_or_copy(src: str, dst: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(dst)  # a file of that name: never written through (it may be a link another directory shares)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
