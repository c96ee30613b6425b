"""Wall time and the machine's busy CPU time (``/proc/stat``) around one command: how much of the
machine a run used, whoever in it did the work (the test suite's workers, daemons, trials).

    python bench/busy.py python -m pytest
    python bench/busy.py --processes python -m pytest    # and the CPU of every process that ended
    python bench/busy.py --kinds python -m pytest        # and that CPU by kind of process

Prints the command's own output, then one JSON line: wall seconds, busy and idle core-seconds, and the
mean number of busy cores. Exits with the command's exit code. Linux only.

``--processes`` turns on the kernel's process accounting (``acct(2)``: root, a kernel with BSD process
accounting) for the command's run and turns it off after, so it also counts what no sampler sees: every
process that ended meanwhile, killed ones included, whoever started it (on a busy machine, other work's
too). It prints the CPU by command name, exec'd programs apart from processes forked without an exec
(``python*``: a forkserver's workers and ranks), and how the CPU of the largest group is spread over
per-process bands (a forkserver's torch preload is one of 2.5-6 CPU-s); the JSON line gets the same as
``processes``. Processes still running at the end (daemons) are not counted. The machine's accounting is
off afterwards, whatever it was before, and there is one per machine: two ``--processes`` runs at once
spoil each other's counts.

``--kinds`` (implies ``--processes``) also samples every process's command line from ``/proc`` (every 50 ms,
in a thread of this script: 0.7 % of a core with a hundred processes running) and prints the CPU by kind
of process, read from the command line that ran: a forkserver (``multiprocessing.forkserver``), a
pytest-xdist worker, ``hpoflow run``, a module run with ``-m`` (and its first argument:
``hpoflow.engines.cluster.node rank``), a script by its file name; a process forked without an exec by its
parent's kind (``forked from forkserver``: the local engine's workers and what they fork). A process that
ended within 50 ms of its start may go unseen (``python (unseen)``); one that is not Python by its name
(``srun``, ``postgres``).
"""

from __future__ import annotations

import ctypes
import errno
import itertools
import json
import os
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

_HZ = os.sysconf("SC_CLK_TCK")
_AHZ = 100  # the unit of acct_v3's CPU times (linux/acct.h)
_AFORK = 0x01  # ac_flag: forked, never exec'd
# struct acct_v3: flag, version, tty, exitcode, uid, gid, pid, ppid, btime, etime (float), then utime,
# stime, mem, io, rw, minflt, majflt, swaps (comp_t), comm
_V3 = struct.Struct("=BBHIIIIIIf8H16s")
BANDS = (0.5, 1.0, 2.5, 6.0)  # CPU-s per process: the edges of the bands ``--processes`` prints


@dataclass(frozen=True)
class Ended:
    """One process as the kernel's accounting recorded it when it ended."""

    command: str  # its name (the first 15 bytes)
    forked: bool  # forked and never exec'd
    cpu_s: float  # user + system
    pid: int = 0
    ppid: int = 0
    began: int = 0  # when it began (seconds since the epoch)


def comp_t(value: int) -> int:
    """A ``comp_t`` (13-bit mantissa, 3-bit base-8 exponent) as an integer."""
    return (value & 0x1FFF) << (3 * ((value >> 13) & 0x7))


def read_accounting(data: bytes) -> Iterator[Ended]:
    """The records of an ``acct_v3`` file (what Linux writes); others are skipped."""
    for off in range(0, len(data) - _V3.size + 1, _V3.size):
        (flag, version, _tty, _exit, _uid, _gid, pid, ppid, began, _etime, utime, stime, _mem, _io, _rw, _minflt,
         _majflt, _swaps, comm) = _V3.unpack_from(data, off)
        if version & 0x7F != 3:
            continue
        yield Ended(comm.split(b"\0", 1)[0].decode(errors="replace"), bool(flag & _AFORK),
                    (comp_t(utime) + comp_t(stime)) / _AHZ, pid, ppid, began)


class Sightings:
    """The command line of each process seen running, read from ``/proc`` every ``every_s`` by a thread
    (``start``/``stop``): what the kernel's accounting does not record. A process is keyed by its pid and
    when it began, so a pid used again later in the run is another process."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.every_s = every_s
        self.argv: dict[int, list[tuple[float, list[str]]]] = defaultdict(list)  # pid -> (began, argv) of each
        self._live: set[int] = set()
        self._boot = _boot_time()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="busy-sightings", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._done.set()
        self._thread.join()
        self.scan()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            self.scan()

    def scan(self) -> None:
        """Note the processes started since the last scan."""
        now = {int(name) for name in os.listdir("/proc") if name.isdigit()}
        for pid in now - self._live:
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    raw = f.read()
            except OSError:  # ended meanwhile
                continue
            argv = [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]]
            if argv:  # (a kernel thread has none)
                started = int(stat.rsplit(b")", 1)[1].split()[19])  # field 22: clock ticks after boot
                self.argv[pid].append((self._boot + started / _HZ, argv))
        self._live = now

    def find(self, pid: int, began: int, parent: bool = False) -> list[str] | None:
        """The command line of process ``pid`` that began at ``began`` (whole seconds, as the accounting
        records it); with ``parent``, of the one that was ``pid`` then (the latest to begin before it)."""
        best = None
        for t, argv in self.argv.get(pid, ()):
            if (t <= began + 1) if parent else (abs(t - began) <= 1.5):
                best = argv
        return best


def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


_PY_FLAGS_WITH_VALUE = {"-W", "-X", "-Q"}


def kind(argv: list[str]) -> str:
    """The kind of a process, from its command line (see the module docstring); another program than Python
    by its name."""
    line = " ".join(argv)
    if "multiprocessing.forkserver import main" in line:
        return "forkserver"
    if "multiprocessing.resource_tracker" in line:
        return "resource tracker"
    if "multiprocessing.spawn" in line:
        return "spawned (multiprocessing)"
    if "exec(eval(sys.stdin.readline()))" in line:
        return "pytest-xdist worker"
    if not os.path.basename(argv[0]).startswith("python"):  # not Python (a script's is: its interpreter's)
        return os.path.basename(argv[0])
    args = argv[1:]
    while args and args[0].startswith("-") and args[0] not in ("-m", "-c", "-"):
        args = args[2:] if args[0] in _PY_FLAGS_WITH_VALUE else args[1:]
    if not args:
        return os.path.basename(argv[0])
    if args[0] == "-c" or args[0] == "-":
        return f"python {args[0]}"
    if args[0] == "-m":
        name, rest = (args[1] if len(args) > 1 else "?"), args[2:]
    else:
        name, rest = os.path.basename(args[0]), args[1:]
    if name == "pytest":
        return "pytest"
    if name.startswith("hpoflow") and rest and not rest[0].startswith("-"):
        return f"{name} {rest[0]}"  # hpoflow run, hpoflow.engines.cluster.node rank
    return name


def _python_like(command: str, argv: list[str]) -> bool:
    """Whether ``argv`` is the command line of the process the accounting names ``command`` (and not of
    its parent, seen before it exec'd another program)."""
    return command.startswith("python") or any(os.path.basename(a)[:15] == command for a in argv[:3])


def summarize_kinds(ended: list[Ended], seen: Sightings, top: int = 20) -> list[dict[str, Any]]:
    """The CPU by kind of process (see the module docstring), the largest first."""
    groups: dict[str, list[float]] = defaultdict(list)
    for e in ended:
        if e.forked:
            parent = seen.find(e.ppid, e.began, parent=True)
            name = f"forked from {kind(parent)}" if parent else f"{e.command}* (parent unseen)"
        else:
            argv = seen.find(e.pid, e.began)
            if argv and _python_like(e.command, argv):
                name = kind(argv)
            else:
                name = f"{e.command} (unseen)" if e.command.startswith("python") else e.command
        groups[name].append(e.cpu_s)
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return [{"kind": name, "processes": len(cpu), "cpu_s": round(sum(cpu), 1)} for name, cpu in ranked[:top]]


def _acct(path: str | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.acct(path.encode() if path else None) != 0:
        err = ctypes.get_errno()
        why = {errno.EPERM: "it needs root (CAP_SYS_PACCT)",
               errno.ENOSYS: "this kernel has no BSD process accounting"}.get(err, os.strerror(err))
        raise OSError(err, f"cannot turn process accounting {'on' if path else 'off'}: {why}")


def summarize(ended: list[Ended], top: int = 12) -> dict[str, Any]:
    """The CPU by command name (exec'd apart from forked), and the largest group's per-process bands."""
    groups: dict[str, list[float]] = defaultdict(list)  # by name, "name*" for the forked-only
    for e in ended:
        groups[e.command + ("*" if e.forked else "")].append(e.cpu_s)
    ranked = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    by_command = [{"command": name, "processes": len(cpu), "cpu_s": round(sum(cpu), 1)} for name, cpu in ranked[:top]]
    bands: list[dict[str, Any]] = []
    if ranked:
        name, cpu = ranked[0]
        for lo, hi in itertools.pairwise((0.0, *BANDS, float("inf"))):
            inside = [c for c in cpu if lo <= c < hi]
            bands.append({"command": name, "band_s": [lo, hi if hi != float("inf") else None],
                          "processes": len(inside), "cpu_s": round(sum(inside), 1)})
    return {"processes": len(ended), "cpu_s": round(sum(e.cpu_s for e in ended), 1), "by_command": by_command,
            "largest_by_band": bands}


def _print_table(summary: dict[str, Any]) -> None:
    print(f"processes that ended: {summary['processes']}, {summary['cpu_s']} CPU-s "
          "(name* = forked, never exec'd)")
    for row in summary["by_command"]:
        print(f"  {row['cpu_s']:9.1f} CPU-s  {row['processes']:6d}  {row['command']}")
    for row in summary["largest_by_band"]:
        lo, hi = row["band_s"]
        print(f"  {row['command']} of {lo:g}-{'' if hi is None else f'{hi:g}'} CPU-s each: "
              f"{row['processes']} processes, {row['cpu_s']} CPU-s")


def _cpu() -> tuple[float, float]:
    """Busy and idle core-seconds since boot, from the first line of /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, idle, iowait, irq, softirq = fields[:7]
    return (user + nice + system + irq + softirq) / _HZ, (idle + iowait) / _HZ


def main(argv: list[str]) -> int:
    kinds = bool(argv) and argv[0] == "--kinds"
    processes = kinds or (bool(argv) and argv[0] == "--processes")
    if processes:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    log = None
    if processes:
        fd, log = tempfile.mkstemp(prefix="hpoflow-busy-", suffix=".acct")
        os.close(fd)
        try:
            _acct(log)
        except OSError as exc:
            os.unlink(log)
            print(f"busy.py: {exc.strerror}. Fix: run it as root, or leave out --processes", file=sys.stderr)
            return 2
    seen = Sightings() if kinds else None
    try:
        if seen is not None:
            seen.start()
        busy0, idle0 = _cpu()
        t0 = time.monotonic()
        code = subprocess.call(argv)
        wall = time.monotonic() - t0
        busy1, idle1 = _cpu()
    finally:
        if log is not None:
            _acct(None)
        if seen is not None:
            seen.stop()
    busy = busy1 - busy0
    figures: dict[str, Any] = {"command": argv, "exit": code, "wall_s": round(wall, 1), "busy_core_s": round(busy, 1),
                               "idle_core_s": round(idle1 - idle0, 1), "mean_busy_cores": round(busy / wall, 2)}
    if log is not None:
        with open(log, "rb") as f:
            data = f.read()
        os.unlink(log)
        ended = list(read_accounting(data))
        figures["processes"] = summarize(ended)
        _print_table(figures["processes"])
        if seen is not None:
            figures["processes"]["by_kind"] = summarize_kinds(ended, seen)
            print("by kind of process (see busy.py's docstring):")
            for row in figures["processes"]["by_kind"]:
                print(f"  {row['cpu_s']:9.1f} CPU-s  {row['processes']:6d}  {row['kind']}")
    print(json.dumps(figures))
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
