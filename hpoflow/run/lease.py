"""Driver leases: which drivers work on a study, and which of them are dead.

Several ``hpoflow run`` processes may work on one study (one storage URL or journal path, each its
own run directory): Optuna-style workers. Each driver holds a *lease* in the study's storage itself
(a study system attr ``hpoflow_lease:<id>``: host, pid, run directory, a beat counter and the time
of the last beat), so it works alike on a journal file, SQLite and PostgreSQL, across hosts. Each
trial a driver runs carries its id (user attr ``hpoflow_driver``).

- ``Lease``: this driver's own. Written once before the first trial is asked, then beaten every
  ``lease_s / 4`` seconds by a background thread (one small write; nothing per trial), and marked
  ended when the driver stops.
- ``LeaseWatch``: another driver's view of the leases, used to decide which RUNNING trials belong
  to a dead driver and must be rerun. A lease is dead when it is ended (in the storage, or by a
  driver of this very process whose storage could not be told: a study stopped by an outage and
  run again from the same notebook or script); when it names a process on
  this same machine (host, boot and pid namespace) that no longer exists; or when its beat counter
  has not moved for its ``lease_s`` as seen by this driver's own monotonic clock. Clocks of
  different hosts are never compared. A gap in this driver's own reads (a stalled loop, a storage
  outage), or its own beats failing, restarts the observation instead of declaring everyone dead.
- ``first_alive``: whether a driver of the study runs now, decided before this driver does anything
  (the PBT owner's guard): judged from the leases' state and from beats seen on this host's monotonic
  clock, as ``LeaseWatch`` does; a driver of another host is watched until its beat moves or has not
  moved for its ``lease_s``.
- ``lease_rows``: what ``hpoflow status`` shows. It reads once and changes nothing, so it cannot watch
  beats: a lease of another host is ``unknown`` (its ``last_beat`` is that host's clock, shown as is).

Optuna's own heartbeat (``RDBStorage(heartbeat_interval=...)`` with ``fail_stale_trials``) is not used:
the journal storage has none, it writes one heartbeat per running trial, ``Study.ask`` warns when it
is used outside ``Study.optimize``, and a stale trial is only failed, never rerun.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna

from hpoflow.run.retry import StorageUnavailable

__all__ = ["LEASE_PREFIX", "Lease", "LeaseInfo", "LeaseWatch", "WaitStopped", "first_alive", "lease_rows",
           "read_leases"]

LEASE_PREFIX = "hpoflow_lease:"
_log = logging.getLogger("hpoflow")

# The leases this process ended, whether or not the storage took the ``ended`` mark: a driver of
# this process that stopped runs nothing, even while its lease in the storage still looks alive.
_ENDED_HERE: set[str] = set()


def _storage(study: optuna.Study) -> tuple[optuna.storages.BaseStorage, int]:
    # Optuna keeps a study's storage and id private; its storage API (study system attrs) is public.
    return study._storage, study._study_id


@functools.cache
def _machine() -> str:
    """This process's machine as far as pids are comparable: host, kernel boot, pid namespace."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""  # pids of other processes cannot be judged here
    return f"{socket.gethostname()}/{boot}/{pidns}"


def _pid_start(pid: int) -> float | None:
    import psutil

    try:
        return float(psutil.Process(pid).create_time())
    except psutil.Error:
        return None


@dataclass(frozen=True)
class LeaseInfo:
    """One driver's lease as stored."""

    id: str
    host: str
    pid: int
    run_dir: str
    started: float  # wall clock (s since the epoch) of the driver's start
    beat: int  # beats so far
    time: float  # wall clock of the last beat, on the driver's host (shown, never compared with this host's)
    lease_s: float
    machine: str
    pid_start: float | None
    ended: bool  # marked ended in the storage, or ended by this very process (``_ENDED_HERE``)
    pbt: bool | None = None  # a driver of search.scheduler pbt (None: a lease written before this was kept)

    @classmethod
    def parse(cls, driver_id: str, value: Any) -> LeaseInfo | None:
        if not isinstance(value, dict):
            return None
        try:
            return cls(driver_id, str(value.get("host", "?")), int(value.get("pid", 0)), str(value.get("run_dir", "")),
                       float(value.get("started", 0.0)), int(value["beat"]), float(value.get("time", 0.0)),
                       float(value.get("lease_s", 60.0)), str(value.get("machine", "")),
                       None if value.get("pid_start") is None else float(value["pid_start"]),
                       bool(value.get("ended", False)) or driver_id in _ENDED_HERE,
                       None if value.get("pbt") is None else bool(value["pbt"]))
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def label(self) -> str:
        return f"{self.host}:{self.pid}"

    def state(self) -> str:
        """From one read, as ``status`` shows it: ``ended``; ``lost`` (its process on this machine is gone);
        ``alive`` (its process on this machine runs); ``unknown`` (a driver of another machine: only beats
        watched over time tell, and this host's clock is never compared with another's)."""
        if self.ended:
            return "ended"
        if self.process_gone():
            return "lost"
        return "alive" if self.here() else "unknown"

    def here(self) -> bool:
        """Whether the lease names a process of this machine (whose pid this host can check)."""
        return bool(self.machine) and self.machine == _machine()

    def process_gone(self) -> bool:
        """True when this lease names a process of this machine that no longer runs (or a newer one
        that reuses its pid); False when it runs or cannot be judged from here."""
        if not self.here():
            return False
        start = _pid_start(self.pid)
        return start is None or (self.pid_start is not None and abs(start - self.pid_start) > 1.0)


def read_leases(study: optuna.Study) -> dict[str, LeaseInfo]:
    """Every driver lease of the study, by driver id (reads; changes nothing)."""
    storage, study_id = _storage(study)
    out = {}
    for key, value in storage.get_study_system_attrs(study_id).items():
        if key.startswith(LEASE_PREFIX):
            info = LeaseInfo.parse(key[len(LEASE_PREFIX):], value)
            if info is not None:
                out[info.id] = info
    return out


class Lease:
    """This driver's lease: ``start()`` before the first trial, ``end()`` when the driver stops."""

    def __init__(self, study: optuna.Study, run_dir: Path, lease_s: float, *, pbt: bool = False) -> None:
        self.study = study
        self.id = uuid.uuid4().hex[:12]
        self.lease_s = lease_s
        self.beat_s = lease_s / 4
        self._record: dict[str, Any] = {
            "host": socket.gethostname(), "pid": os.getpid(), "run_dir": str(run_dir), "started": time.time(),
            "beat": 0, "time": time.time(), "lease_s": lease_s, "machine": _machine(),
            "pid_start": _pid_start(os.getpid()), "ended": False, "pbt": pbt,
        }
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.failed_beats = 0

    def start(self) -> None:
        """Write the lease (raises if the storage cannot take it) and start beating."""
        self._write()
        self._thread = threading.Thread(target=self._beat_loop, name="hpoflow-lease", daemon=True)
        self._thread.start()

    def end(self) -> None:
        """Stop beating and mark the lease ended (best effort: a dead storage cannot be told; this
        process knows it all the same)."""
        _ENDED_HERE.add(self.id)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        with contextlib.suppress(Exception):
            self._write(ended=True)

    def _beat_loop(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._write()
                self.failed_beats = 0
            except Exception as exc:  # a storage hiccup: the next beat tries again
                self.failed_beats += 1
                # an outage the storage itself announced ("storage unreachable, retrying ...") is not said twice
                if self.failed_beats == 1 and not isinstance(exc, StorageUnavailable):
                    _log.warning("driver lease %s: cannot write its beat to the storage (%s: %s); retrying",
                                 self.id, type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")

    def _write(self, ended: bool = False) -> None:
        with self._lock:
            self._record["beat"] += 1
            self._record["time"] = time.time()
            self._record["ended"] = ended
            storage, study_id = _storage(self.study)
            storage.set_study_system_attr(study_id, LEASE_PREFIX + self.id, dict(self._record))


class LeaseWatch:
    """Which leases are dead, as one driver sees them over time (see the module docstring)."""

    def __init__(self, own_id: str, own_lease_s: float) -> None:
        self.own_id = own_id
        self.own_lease_s = own_lease_s
        self.leases: dict[str, LeaseInfo] = {}
        self._since: dict[str, tuple[int, float]] = {}  # id -> (beat seen, when first seen at that beat)
        self._unowned: dict[int, float] = {}  # trial number -> when first seen RUNNING without a driver
        self._last: float | None = None

    def forget(self) -> None:
        """Start every observation over (this driver cannot trust what it saw: a gap, an outage)."""
        self._since.clear()
        self._unowned.clear()
        self._last = None

    def update(self, leases: dict[str, LeaseInfo], now: float) -> None:
        """A new read of the leases, made at monotonic time ``now``."""
        if self._last is not None and now - self._last > self.own_lease_s / 2:
            self.forget()  # this driver did not look for a while: do not judge across the gap
        self._last = now
        self.leases = leases
        for i, info in leases.items():
            seen = self._since.get(i)
            if seen is None or seen[0] != info.beat:
                self._since[i] = (info.beat, now)

    def dead(self, driver_id: str, now: float) -> bool:
        info = self.leases.get(driver_id)
        if driver_id == self.own_id or info is None:
            return False
        if info.ended or info.process_gone():
            return True
        seen = self._since.get(driver_id)
        return seen is not None and now - seen[1] >= info.lease_s

    def any_other_alive(self, now: float) -> bool:
        """Whether a driver other than this one may be alive."""
        return any(not self.dead(i, now) for i in self.leases if i != self.own_id)

    def orphaned(self, number: int, owner: str | None, now: float, running: set[int]) -> bool:
        """Whether the RUNNING trial ``number`` (run by ``owner``, or by no recorded driver: a run written
        before leases, or a trial being decided) has nobody left to finish it."""
        for n in list(self._unowned):
            if n not in running:
                del self._unowned[n]
        if owner and owner in self.leases:
            return self.dead(owner, now)
        if not self.any_other_alive(now):
            return True
        first = self._unowned.setdefault(number, now)
        return now - first >= self.own_lease_s


class WaitStopped(Exception):
    """``first_alive`` stopped waiting: its caller is stopping (a signal came)."""


def first_alive(study: optuna.Study, pick: Callable[[LeaseInfo], bool], own_id: str,
                waiting: Callable[[list[LeaseInfo]], None] | None = None,
                stopping: Callable[[], bool] | None = None) -> LeaseInfo | None:
    """A lease of the study (not ``own_id``) that ``pick`` selects and whose driver runs now, or None when
    every one of them is dead. Ended, or its process on this machine gone: dead at once; its process on
    this machine runs: alive at once; a driver of another machine: its beats are watched on this host's
    monotonic clock until the counter moves (alive) or has not moved for its ``lease_s`` (dead), so a
    driver of another host that stopped without ending its lease costs a wait of its ``lease_s``.
    ``waiting`` is told once which leases it waits for; ``WaitStopped`` is raised as soon as ``stopping()``."""
    watch = LeaseWatch(own_id, math.inf)  # read at every poll below: no gap to forget across
    first: dict[str, int] = {}  # id -> the beat counter at the first read
    told = False
    while True:
        now = time.monotonic()
        leases = {i: info for i, info in read_leases(study).items() if i != own_id and pick(info)}
        watch.update(leases, now)
        pending = []
        for i, info in leases.items():
            if watch.dead(i, now):
                continue
            if info.here() or first.setdefault(i, info.beat) != info.beat:
                return info
            pending.append(info)
        if not pending:
            return None
        if waiting is not None and not told:
            waiting(pending)
            told = True
        if stopping is not None and stopping():
            raise WaitStopped
        time.sleep(min(0.5, max(0.05, min(info.lease_s for info in pending) / 8)))


def lease_rows(study: optuna.Study, running_by_driver: dict[str, int]) -> list[dict[str, Any]]:
    """The drivers of a study for ``status``: id, host, pid, run_dir, started, last_beat (ISO times, each
    of its driver's clock), state (``LeaseInfo.state``: ``alive``, ``ended``, ``lost``, or ``unknown`` for
    a driver of another machine) and the trials it has running."""
    rows = []
    for info in sorted(read_leases(study).values(), key=lambda i: i.started):
        rows.append({"id": info.id, "host": info.host, "pid": info.pid, "run_dir": info.run_dir,
                     "started": _iso(info.started), "last_beat": _iso(info.time), "state": info.state(),
                     "trials_running": running_by_driver.get(info.id, 0)})
    return rows


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t))
