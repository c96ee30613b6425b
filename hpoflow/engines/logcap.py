"""Rank logs of bounded size: the first and the last part of a rank's output, with a note of how many
bytes were dropped between (standard library only: safe in any process).

A rank writes its stdout and stderr into a pipe (``LogPump.open`` gives the write end); a thread of
the process that started the rank (the local engine; a cluster node launcher) moves the bytes into
the log file. That process, not the rank, holds the read end, so a rank that dies abruptly (a C++
abort, a segfault, a kill) loses nothing it wrote, and its last words stay at the end of the log.

The cap is ``HPOFLOW_RANK_LOG_MB`` (default 16; 0: no cap): a log keeps its first half and its last
half, so it never holds more than the cap plus one note line (and up to half the cap more while the
rank still writes: the tail is trimmed each time it reaches twice its size, with an in-kernel copy).
The cap is the file's, over every attempt that appends to it: a rerun continues the earlier head,
note and tail.
Bytes move with ``splice`` and ``copy_file_range`` where the kernel has them, without passing through
Python.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import select
import selectors
import threading
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

__all__ = ["CAP_ENV", "CappedLog", "LogPump", "LogStream", "cap_bytes"]

CAP_ENV = "HPOFLOW_RANK_LOG_MB"
DEFAULT_CAP_MB = 16
_CHUNK = 1 << 20
_PIPE_SIZE = 256 << 10  # a rank may write this far ahead of the pump before it waits
_NOTE_LEN = 200  # the note is rewritten in place as more is dropped: fixed width
# After a wake-up that found little to move, the pump lets the pipes fill for this long before it
# looks again: a rank printing line by line (unbuffered) then costs one wake-up per few hundred
# lines instead of one per line, and waits only once its pipe is full.
_LINGER_S = 0.005
_LITTLE = 64 << 10
_NOTE_WORDS = "bytes of output dropped here"
_NOTE = re.compile(rb"\n\[hpoflow: (\d+) " + _NOTE_WORDS.encode() + rb";")  # an earlier writer's note


def cap_bytes(environ: dict[str, str] | None = None) -> int:
    """The rank log cap in bytes from ``HPOFLOW_RANK_LOG_MB`` (0: no cap; unset: 16 MiB);
    ``ValueError`` (rule, value, fix) for anything but a whole number."""
    raw = (os.environ if environ is None else environ).get(CAP_ENV, "").strip()
    if not raw:
        return DEFAULT_CAP_MB << 20
    if not (raw.isascii() and raw.isdigit()):
        raise ValueError(f"{CAP_ENV} must be a whole number of MiB (0: no cap), but got {raw!r}. Fix: unset it "
                         f"(default {DEFAULT_CAP_MB}) or set it to e.g. 64")
    return int(raw) << 20


def _size_text(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


class CappedLog:
    """A log file written at increasing offsets, holding at most its first ``cap // 2`` bytes, a note
    and its last ``cap // 2`` bytes (``cap`` 0: everything). The cap holds for the file, not for one
    writer: what it holds already (an earlier attempt of the trial, an elastic trial's earlier segment)
    is where the new bytes continue, as if one writer had written it all. Its first ``cap // 2`` bytes
    stay the head; a note an earlier writer left after them is taken over (its count goes on); the
    rest is part of the tail, trimmed with the new bytes."""

    def __init__(self, path: str, cap: int) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        self.pos = os.fstat(self.fd).st_size
        self.tail = cap - cap // 2
        self.head = cap // 2 if cap else self.pos  # bytes kept from the start, whatever follows
        self.start = self.head  # where the kept tail begins (after the note once one is written)
        self.dropped = 0
        self.received = 0  # bytes moved from the pipe so far
        self._splice = hasattr(os, "splice")
        self._copy = hasattr(os, "copy_file_range")
        if cap and self.pos >= self.head + _NOTE_LEN:
            earlier = _NOTE.match(os.pread(self.fd, _NOTE_LEN, self.head))
            if earlier:
                self.dropped = int(earlier.group(1))
                self.start = self.head + _NOTE_LEN

    def feed(self, src: int) -> bool:
        """Move what the pipe ``src`` holds into the log (it is readable); False at end of file."""
        n = self._move(src)
        if n == 0:
            return False
        self.pos += n
        self.received += n
        if self.tail and self.pos - self.start > 2 * self.tail + _NOTE_LEN:
            self._trim()
        return True

    def _move(self, src: int) -> int:
        if self._splice:
            try:
                return os.splice(src, self.fd, _CHUNK, offset_dst=self.pos)
            except OSError:  # a file system that cannot splice: copy through a buffer from now on
                self._splice = False
        data = os.read(src, _CHUNK)
        view = memoryview(data)
        while view:
            view = view[os.pwrite(self.fd, view, self.pos + len(data) - len(view)):]
        return len(data)

    def _trim(self) -> None:
        """Keep the last ``tail`` bytes (from the first line that starts there), after the note."""
        src = self.pos - self.tail
        with contextlib.suppress(OSError):  # begin the kept tail at a line start when one is near
            nl = os.pread(self.fd, 4096, src).find(b"\n")
            if nl >= 0:
                src += nl + 1
        dst = self.head + _NOTE_LEN
        self.dropped += src - self.start
        self._copy_range(src, dst, self.pos - src)
        self.pos = dst + (self.pos - src)
        self.start = dst
        os.ftruncate(self.fd, self.pos)
        note = (f"\n[hpoflow: {self.dropped} {_NOTE_WORDS}; a rank log keeps its first "
                f"{_size_text(self.head)} and its last {_size_text(self.tail)} ({CAP_ENV})]")
        os.pwrite(self.fd, note.encode()[: _NOTE_LEN - 1].ljust(_NOTE_LEN - 1) + b"\n", self.head)

    def _copy_range(self, src: int, dst: int, count: int) -> None:
        """Copy ``count`` bytes from offset ``src`` down to ``dst`` (``dst < src``; the ranges may
        overlap: ``copy_file_range`` refuses that, a forward copy through a buffer does it)."""
        overlap = dst + count > src
        while count > 0:
            n = 0
            if self._copy and not overlap:
                try:
                    n = os.copy_file_range(self.fd, self.fd, count, src, dst)
                except OSError:
                    self._copy = False
            if not n:  # no copy_file_range here (or it copied nothing): through a buffer
                data = os.pread(self.fd, min(count, _CHUNK), src)
                if not data:
                    return
                n = os.pwrite(self.fd, data, dst)
            src, dst, count = src + n, dst + n, count - n

    def close(self) -> None:
        """Trim to the cap (the tail may hold up to twice its size while written; a few bytes over
        it are not worth a note), then close."""
        try:
            if self.tail and self.pos - self.start > self.tail + _NOTE_LEN:
                self._trim()
        except OSError as exc:  # a full disk: the log stays as it is
            log.warning("rank log %s not trimmed: %s", self.path, exc)
        finally:
            os.close(self.fd)


@dataclass
class LogStream:
    """One rank's output on its way into its log; ``done`` is set when the pipe reached end of file
    (every process holding the write end has closed it or died) and the log is closed."""

    path: str
    read_fd: int
    done: threading.Event = field(default_factory=threading.Event)


class LogPump:
    """A daemon thread moving bytes from rank pipes into ``CappedLog`` files; see the module
    docstring. ``open`` and ``wait`` may be called from any thread."""

    def __init__(self, cap: int | None = None) -> None:
        self.cap = cap_bytes() if cap is None else cap
        self._lock = threading.Lock()
        self._pending: list[tuple[LogStream, CappedLog]] = []
        self._abandoned: list[LogStream] = []
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._closed = False

    def open(self, path: str) -> tuple[int, LogStream]:
        """A pipe whose bytes go to the log at ``path`` (appended to what it holds); returns the
        write end, for the rank's stdout and stderr (the caller closes its copy once handed on),
        and the stream to ``wait`` for."""
        r, w = os.pipe()
        with contextlib.suppress(OSError, AttributeError):
            import fcntl

            fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
        try:
            capped = CappedLog(path, self.cap)
        except OSError:
            os.close(r)
            os.close(w)
            raise
        stream = LogStream(path, r)
        with self._lock:
            if self._closed:
                raise RuntimeError("the log pump is closed")
            self._pending.append((stream, capped))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="hpoflow-log-pump", daemon=True)
                self._thread.start()
        self._wake()
        return w, stream

    def wait(self, streams: list[LogStream], timeout_s: float) -> bool:
        """Block until every stream in ``streams`` is at end of file, or ``timeout_s``; streams still
        open then are abandoned (their read end closed: a process that kept the write end gets
        EPIPE). True if all ended by themselves."""
        if any(not s.done.is_set() for s in streams):
            self._wake()  # out of its linger: the pipes' ends are there to be seen now
        ok = True
        for s in streams:
            if not s.done.wait(timeout_s):
                ok = False
        if not ok:
            with self._lock:
                self._abandoned.extend(s for s in streams if not s.done.is_set())
            self._wake()
        return ok

    def close(self, timeout_s: float = 5.0) -> None:
        """Move what is left, close every log and stop the thread."""
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake()
        if thread is not None:
            thread.join(timeout_s)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # full (a wake-up is pending anyway) or closed
            os.write(self._wake_w, b"x")

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        sel.register(self._wake_r, selectors.EVENT_READ)
        linger = select.poll()
        linger.register(self._wake_r, select.POLLIN)
        logs: dict[int, tuple[LogStream, CappedLog]] = {}
        dropping: set[int] = set()  # logs that cannot be written (a full disk): drained and discarded, so
        # the rank's writes still succeed and it runs on

        def finish(fd: int) -> None:
            dropping.discard(fd)
            stream, capped = logs.pop(fd)
            sel.unregister(fd)
            with contextlib.suppress(OSError):
                os.close(fd)
            with contextlib.suppress(OSError):
                capped.close()
            stream.done.set()

        try:
            while True:
                with self._lock:
                    pending, self._pending = self._pending, []
                    abandoned, self._abandoned = self._abandoned, []
                    closed = self._closed
                for stream, capped in pending:
                    logs[stream.read_fd] = (stream, capped)
                    sel.register(stream.read_fd, selectors.EVENT_READ)
                for stream in abandoned:
                    if stream.read_fd in logs:
                        finish(stream.read_fd)
                if closed:
                    for fd in list(logs):  # what the pipes hold now, then done
                        with contextlib.suppress(OSError):
                            while fd not in dropping and _readable(fd) and logs[fd][1].feed(fd):
                                pass
                        finish(fd)
                    return
                moved = 0
                for key, _ in sel.select():
                    fd = int(key.fd)
                    if fd == self._wake_r:
                        with contextlib.suppress(OSError):
                            os.read(fd, 4096)
                        moved = _LITTLE
                        continue
                    if fd not in logs:
                        continue
                    capped = logs[fd][1]
                    if fd in dropping:
                        try:
                            more = bool(os.read(fd, _CHUNK))
                        except OSError:
                            more = False
                        if not more:
                            finish(fd)
                        moved = _LITTLE
                        continue
                    try:
                        before = capped.received
                        more = capped.feed(fd)
                        moved = max(moved, capped.received - before)
                    except Exception as exc:  # a full disk: the rest of this rank's output is lost
                        log.warning("rank log %s: %s; the rest of its output is dropped", logs[fd][0].path, exc)
                        dropping.add(fd)
                        more = True
                    if not more:
                        finish(fd)
                        moved = _LITTLE
                if moved < _LITTLE:  # linger, unless someone waits for a stream (``wait`` wakes us)
                    linger.poll(_LINGER_S * 1000)
        finally:
            for fd in list(logs):
                finish(fd)
            sel.close()


def _readable(fd: int) -> bool:
    """Whether ``fd`` can be read without blocking (or is at end of file)."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))
