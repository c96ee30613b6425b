"""The default storage's file: Optuna's journal (one JSON record per line), whole records only.

Optuna's ``JournalFileBackend`` appends records under a lock file (``study.journal.lock``); a reader
skips a last line without its newline (an append in progress, or a torn one). A record torn by a
node crash or a full disk mid-append is such a line, and the next append would glue onto it, making
a line in the middle that is not JSON: from then on Optuna refuses the whole file. So:

- ``check_journal(path, repair=True)`` (a run opening its journal, under the journal's lock) cuts a
  torn last record off (truncates to the last newline) with a warning naming the byte offset and the
  bytes dropped, completes a whole last record that lost only its newline, and refuses a journal
  damaged anywhere else (``JournalDamaged``: the file, line and byte offset, and the fix) before
  anything is appended. ``repair=False`` (``status``, ``report``, ``dashboard``) changes nothing: it
  warns about a torn tail (Optuna reads what is whole) and refuses damage elsewhere alike.
- ``JournalFile.append_logs`` (every append, under the same lock) checks the file still ends with a
  newline, and takes a failed write back (truncates to the size before it), so a full disk never
  leaves part of a record behind.

Durability: Optuna fsyncs every append (~1-3 ms each, several per trial). ``JournalFile`` fsyncs only
the append that finishes a trial (its final state and value), so a trial the driver counts as
finished is on disk before the driver moves on; the other appends (creation, parameters, reports,
attributes) are written under the same lock without fsync: in the kernel once the call returns, so
any process crash loses nothing, and a machine crash can lose only records of unfinished trials,
which a resume reruns. ``fsync_always=True`` (``HPOFLOW_JOURNAL_FSYNC=1``) fsyncs every append.

The file is the one opened: ``JournalFile`` notes its identity (device and inode) when it opens it, and
every read and append first checks the path still names that file. A journal deleted or replaced (moved
away, another file moved over it) while a run uses it raises ``JournalGone`` instead of reading
another file's records from this one's offsets (Optuna's replay then fails with a ``JSONDecodeError``)
or appending to a new file: nothing is written to what the path names now. A writer (``recover=True``)
keeps the file it opened open, so a deleted journal's records are still there: ``JournalGone`` copies
them to ``<journal>.recovered`` (a free name beside it) and says where; moving that back resumes.

The lock (``journal_lock``) is Optuna's lock file, which a process killed while appending left behind,
so that every other process waited Optuna's 30 s grace period for it. ``JournalLock`` creates the file
already holding an ``flock`` on it and naming its kernel (host and boot): the kernel drops the flock
when its holder dies, so a waiter on the same kernel that can take the flock of such a file removes it
at once, and waits for a live holder as long as it holds the lock. A lock file of another kernel (a
journal on a shared file system), or an empty one (Optuna's own, from another program), keeps Optuna's
grace period.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import shlex
import socket
import threading
import time
import uuid
import weakref
from collections.abc import Generator
from pathlib import Path
from typing import Any

from optuna.storages.journal import JournalFileBackend, JournalFileOpenLock
from optuna.storages.journal._file import get_lock_file
from optuna.trial import TrialState

from hpoflow.errors import RunDirError
from hpoflow.run.retry import StorageUnavailable

__all__ = ["JournalDamaged", "JournalFile", "JournalGone", "check_journal", "find_damage", "journal_lock"]

log = logging.getLogger(__name__)

_FINISHED_STATES = {TrialState.COMPLETE.value, TrialState.PRUNED.value, TrialState.FAIL.value}
_CHUNK = 1 << 16
_SETTLE_S = 0.2  # a reader that sees a partial last line looks again after this long


class JournalDamaged(RunDirError):
    """A journal line other than a torn last record is not valid JSON: Optuna cannot replay the file."""


class JournalGone(StorageUnavailable):
    """The journal a run opened was deleted or replaced since (module docstring): the driver stops
    cleanly, as for a storage that stopped answering (exit code 1)."""


def journal_lock(path: Path) -> JournalLock:
    """The lock the appends to ``path`` take (``path.lock``; ``JournalLock``)."""
    return JournalLock(str(path))


@functools.cache
def _kernel() -> bytes:
    """This kernel, as far as its flocks go: host and boot."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"hpoflow-flock {socket.gethostname()} {boot}\n".encode()


class JournalLock(JournalFileOpenLock):
    """Optuna's lock file (created whole, or not at all), whose holder also holds an ``flock`` on it,
    so that a holder that died is known at once (module docstring). Where hard links or flocks fail
    (some file systems), Optuna's lock as it is."""

    def __init__(self, filepath: str) -> None:
        super().__init__(filepath)
        self._held: int | None = None  # the holder's descriptor of the lock file, with its flock
        self._plain = False

    def acquire(self) -> bool:
        if self._plain:
            return super().acquire()
        sleep_s = 0.001
        waited_on: tuple[int, float] | None = None  # the live holder's lock file (inode) and since when
        while True:
            try:
                if self._create():
                    return True
            except OSError as exc:  # no hard links or no flocks here
                log.debug("journal lock %s without flock: %s", self._lock_file, exc)
                self._plain = True
                return super().acquire()
            holder, inode = self._holder()
            if holder == "other":  # a lock file this kernel cannot judge: Optuna's wait (its grace period)
                return super().acquire()
            if holder == "alive":
                if waited_on is None or waited_on[0] != inode:
                    waited_on = (inode, time.monotonic())
                elif self.grace_period is not None and time.monotonic() - waited_on[1] > self.grace_period:
                    # held that long by a live process (a descendant that inherited its descriptor, a
                    # stuck file system): removed, as Optuna removes any lock file after its grace period
                    log.warning("the journal lock %s was held for over %s s; removed", self._lock_file,
                                self.grace_period)
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(self._lock_file)
                    waited_on = None
                    continue
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, 0.1)
            # "gone": removed here or meanwhile; try again at once

    def _create(self) -> bool:
        """Make the lock file, flocked and naming this kernel, under a private name, and link it to the
        lock's name (atomic: the file appears whole, already flocked). False: the lock is held."""
        tmp = f"{self._lock_file}.{uuid.uuid4().hex}.new"
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.write(fd, _kernel())
            os.link(tmp, self._lock_file)
        except FileExistsError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._held = fd
        return True

    def _holder(self) -> tuple[str, int]:
        """The lock file's holder and the file's inode: "alive" (this kernel's file, flocked), "other"
        (another kernel's file, or Optuna's own, empty), or "gone": the file was removed meanwhile, or
        here because its holder died (this kernel's file whose flock is free)."""
        try:
            fd = os.open(self._lock_file, os.O_RDONLY)
        except FileNotFoundError:
            return "gone", 0
        try:
            st = os.fstat(fd)
            mark = _kernel()
            if os.pread(fd, len(mark) + 1, 0) != mark:
                return "other", st.st_ino
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                return ("alive" if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else "other"), st.st_ino
            # The flock is free: its holder died, or released (unlinked) it since this open. Only
            # the file this descriptor names is removed, and no other process can remove it while
            # this one holds its flock.
            try:
                now = os.stat(self._lock_file)
            except FileNotFoundError:
                return "gone", 0
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                log.warning("the journal lock %s was left by a process that died; removed", self._lock_file)
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self._lock_file)
            return "gone", 0
        finally:
            os.close(fd)

    def release(self) -> None:
        try:
            super().release()  # (the file goes first, then its flock: a waiter never sees it free and there)
        finally:
            if self._held is not None:
                os.close(self._held)
                self._held = None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (a pickled storage) holds no lock: the descriptor is this object's."""
        return {**self.__dict__, "_held": None}


def _is_record(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:  # not JSON, or not UTF-8
        return False


def _tail(fd: int, size: int) -> tuple[int, bytes]:
    """(offset, bytes) of the end of the file holding its last two newlines (or all of it)."""
    want = _CHUNK
    while True:
        start = max(0, size - want)
        data = os.pread(fd, size - start, start)
        if start == 0 or data.count(b"\n") >= 2:
            return start, data
        want *= 4


def _line_number(fd: int, offset: int) -> int:
    """The 1-based line number of the line starting at ``offset``."""
    lines, pos = 1, 0
    while pos < offset:
        chunk = os.pread(fd, min(_CHUNK * 16, offset - pos), pos)
        if not chunk:
            break
        lines += chunk.count(b"\n")
        pos += len(chunk)
    return lines


def _damaged(path: Path, fd: int, offset: int, what: str, note: str = "") -> JournalDamaged:
    line = _line_number(fd, offset)
    quoted = shlex.quote(str(path))
    note = note or (", so Optuna cannot read the study past it (a torn last record is cut off on resume; this is not "
                    "one)")
    return JournalDamaged(
        f"{path} is damaged: line {line} (byte offset {offset}) {what}{note}. Nothing was written to it. Fix: restore "
        f"the file from a backup, or keep the records before the damage with `head -c {offset} {quoted} > "
        f"{quoted}.fixed` and move that over it (trials recorded after it are lost; a resume reruns unfinished ones)")


def find_damage(path: Path) -> JournalDamaged | None:
    """The first line of ``path``, other than a last line without its newline, that is not a JSON
    record, as the error to raise; None if there is none. Reads the whole file."""
    with open(path, "rb") as f:
        offset = 0
        for line in f:
            if line.endswith(b"\n") and not _is_record(line):
                return _damaged(path, f.fileno(), offset, "is not a valid JSON record")
            offset += len(line)
    return None


def _check_tail(path: Path, fd: int, repair: bool) -> None:
    """The tail check of the module docstring on an open file (``fd``, read-write when ``repair``)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return
    base, data = _tail(fd, size)
    nl = data.rfind(b"\n")
    partial_at = base + nl + 1
    partial = data[nl + 1:]
    if nl >= 0:  # the last whole line must be a record: garbage with a newline is not a torn append
        start = data.rfind(b"\n", 0, nl) + 1
        if not _is_record(data[start:nl + 1]):
            if repair or partial:
                raise _damaged(path, fd, base + start, "is not a valid JSON record")
            log.warning("%s", _damaged(path, fd, base + start, "is not a valid JSON record", note=(
                "; it is the last line, so the study is read without it here (as Optuna does), but `hpoflow run` "
                "refuses to resume until it is fixed")))
            return
    if not partial:
        return
    if _is_record(partial):  # a whole record that lost only its newline
        if repair:
            os.pwrite(fd, b"\n", size)
            log.warning("%s: the last record (byte offset %d) had no newline; added it", path, partial_at)
        return
    if repair:
        os.ftruncate(fd, partial_at)
        log.warning("%s: cut off a torn last record (a crash or a full disk during an append): %d byte(s) dropped "
                    "at byte offset %d; the records before it are intact", path, len(partial), partial_at)
        return
    time.sleep(_SETTLE_S)  # a reader holds no lock: this may be an append in progress
    if os.fstat(fd).st_size == size:
        log.warning("%s ends with a torn record (%d byte(s) at byte offset %d, no newline): it is ignored here, and "
                    "the next `hpoflow run` on this directory cuts it off", path, len(partial), partial_at)


def check_journal(path: Path, *, repair: bool) -> None:
    """Check ``path``'s tail (module docstring). ``repair=True`` takes the journal's lock and may cut a torn
    last record off; ``repair=False`` reads only. ``JournalDamaged`` when the last whole line is not a
    record. Damage further up is found by Optuna's replay (``find_damage`` then names it)."""
    if not repair:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            _check_tail(path, fd, repair=False)
        finally:
            os.close(fd)
        return
    with get_lock_file(journal_lock(path)):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            _check_tail(path, fd, repair=True)
        finally:
            os.close(fd)


def _save_copy(fd: int, path: Path) -> tuple[Path | None, str]:
    """Copy the open file ``fd`` to a free ``<path>.recovered[.N]`` beside ``path``: (the copy, '') or
    (None, why not)."""
    for n in range(1, 100):
        target = path.with_name(f"{path.name}.recovered" + (f".{n}" if n > 1 else ""))
        try:
            out = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        except OSError as exc:
            return None, f"{target}: {exc.strerror or exc}"
        try:
            offset, size = 0, os.fstat(fd).st_size
            while offset < size:
                chunk = os.pread(fd, min(_CHUNK * 16, size - offset), offset)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view):]
                offset += len(chunk)
            os.fsync(out)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(target)
            return None, f"{target}: {exc.strerror or exc}"
        finally:
            os.close(out)
        return target, ""
    return None, f"{path.name}.recovered to {path.name}.recovered.99 all exist"


class JournalFile(JournalFileBackend):
    """Optuna's journal file with whole-record appends, fewer fsyncs, and a check that the path still
    names the file opened (module docstring). ``recover``: keep that file open (a writer), so its
    records can be saved if the path stops naming it."""

    def __init__(self, file_path: str, *, fsync_always: bool = False, recover: bool = False) -> None:
        super().__init__(file_path, lock_obj=journal_lock(Path(file_path)))
        self.fsync_always = fsync_always
        self._held: int | None = None
        self._identity = self._open(recover)
        self._gone: tuple[str, str] | None = None  # JournalGone's message and cause, once made
        self._gone_lock = threading.Lock()

    def _open(self, recover: bool) -> tuple[int, int]:
        """The identity (device, inode) of the file the path names now; a writer (``recover``) keeps it open."""
        fd = os.open(self._file_path, os.O_RDONLY)
        try:
            st = os.fstat(fd)
        except OSError:
            os.close(fd)
            raise
        if recover:
            self._held = fd
            weakref.finalize(self, os.close, fd)
        else:
            os.close(fd)
        return st.st_dev, st.st_ino

    # A pickled storage (Optuna's JournalStorage pickles its backend: joblib, Dask and multiprocessing
    # hand storages to other processes) is a new opener of the path: no lock or descriptor is shared.
    def __getstate__(self) -> dict[str, Any]:
        state = {**self.__dict__, "_held": None, "_gone": None}
        del state["_gone_lock"]
        state["_recover"] = self._held is not None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        recover = state.pop("_recover")
        self.__dict__.update(state)
        self._gone_lock = threading.Lock()
        try:  # the file the path names where the copy is opened (its device differs on another node)
            self._identity = self._open(recover)
        except FileNotFoundError:  # gone already: the copy's first read or append says so (JournalGone)
            pass

    def _check_same(self, fd: int | None = None) -> None:
        """``JournalGone`` unless the path (or ``fd``, opened from it) is the file opened at first."""
        try:
            st: os.stat_result | None = os.fstat(fd) if fd is not None else os.stat(self._file_path)
        except FileNotFoundError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._identity:
            # (raised outside the except clause: an outage's error as its context would have it retried)
            raise self._gone_error(replaced=st is not None)

    def _gone_error(self, replaced: bool) -> JournalGone:
        """``JournalGone`` for this file; its message is made once (several threads may find the file
        gone), with the records saved first when this writer holds them."""
        with self._gone_lock:
            if self._gone is None:
                self._gone = self._gone_message(replaced)
            message, cause = self._gone
        return JournalGone(message, cause)

    def _gone_message(self, replaced: bool) -> tuple[str, str]:
        path = Path(self._file_path)
        head = f"the study's journal {path} was {'replaced' if replaced else 'deleted'} while this run was using it"
        if replaced:
            head += " (another file moved over it, or it was deleted and written anew); this run wrote nothing to "\
                    "the new file"
        if self._held is None:
            return f"{head}. Fix: rerun this command once the journal is back", "journal gone"
        size = os.fstat(self._held).st_size
        saved, why = _save_copy(self._held, path)
        if saved is None:
            return (f"{head}; the records of the journal it opened could not be saved beside it ({why}), so what was "
                    "recorded is lost. Fix: rerun the same command to start the study again (in a new --run-dir if "
                    "the run directory is gone)"), "journal gone"
        keep = " (keep the file now there elsewhere if you need it)" if replaced else ""
        return (f"{head}; the records of the journal it opened ({size} bytes: every trial recorded until then) are "
                f"saved in {saved}. Fix: move {saved} to {path}{keep} and rerun the same command to resume"), \
            "journal gone"

    def read_logs(self, log_number_from: int) -> Generator[dict[str, Any], None, None]:
        self._check_same()
        error: Exception | None = None
        try:
            yield from super().read_logs(log_number_from)
        except (OSError, ValueError) as exc:
            error = exc
        if error is not None:
            self._check_same()  # replaced while it was read: say that, not what the other file holds
            raise error

    def append_logs(self, logs: list[dict[str, Any]]) -> None:
        data = "".join(json.dumps(log, separators=(",", ":")) + "\n" for log in logs).encode("utf-8")
        durable = self.fsync_always or any(log.get("state") in _FINISHED_STATES and "values" in log for log in logs)
        path = Path(self._file_path)
        self._check_same()  # (before the lock: a deleted directory has no room for the lock file)
        with get_lock_file(self._lock):
            try:
                fd: int | None = os.open(path, os.O_RDWR | os.O_APPEND)  # never created here: missing is gone
            except FileNotFoundError:
                fd = None
            if fd is None:
                raise self._gone_error(replaced=False)
            try:
                self._check_same(fd)
                size = os.fstat(fd).st_size
                if size and os.pread(fd, 1, size - 1) != b"\n":  # another writer died mid-append
                    _check_tail(path, fd, repair=True)
                    size = os.fstat(fd).st_size
                try:
                    view = memoryview(data)
                    while view:
                        view = view[os.write(fd, view):]
                    if durable:
                        os.fsync(fd)
                except BaseException:
                    os.ftruncate(fd, size)  # never leave part of a record (a full disk, a signal)
                    raise
            finally:
                os.close(fd)
