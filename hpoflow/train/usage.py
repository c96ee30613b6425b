"""System usage of one rank while its trial runs: CPU, memory, network, disk, GPU.

Sized to the trial: ``start`` only reads the counters' starting values (no sample, no thread), and
``stop`` takes one sample, so a trial shorter than ``quiet_s`` (1 s) is measured by that one sample at
its end (~0.1 ms in all). One daemon thread per process (``_Ticker``, started with the first sampler
and kept for the trials after it) samples each running sampler every ``interval_s`` (0.5 s) once it
has run ``quiet_s``, so a long trial's peak and mean memory are seen while it runs:

- ``cpu_percent``: CPU time of the process (all its threads) over wall time, in % of one core;
- ``rss_peak_mb`` / ``rss_mean_mb``: resident memory, peak and mean over the samples;
- with ``tree`` (a command trial's rank, whose program runs in processes of its own): the CPU time of
  the descendants that ended (the program and what it started, from the kernel's accounting of waited-for
  children) is added, the resident memory of the live descendants is added to each sample, the peak is
  at least the largest a descendant reached (where it rose during the trial), and the bytes the
  descendants wrote, as sampled, are added to ``disk_write_mb``; network bytes stay the rank process's;
- ``net_sent_mb`` / ``net_recv_mb``: bytes this process's TCP connections sent (acknowledged by the
  peer) and received, read from the kernel's per-socket counters (``TCP_INFO``: ``tcpi_bytes_acked``,
  ``tcpi_bytes_received``; Linux >= 4.2) of every TCP socket the process holds: the process group's
  traffic (gloo/NCCL pairs, the TCP store), not the machine's;
- ``disk_write_mb``: bytes the process caused to be written to storage (``/proc/self/io``);
- ``gpu_peak_mem_mb`` (torch's peak allocation on the rank's device) and ``gpu_util_percent``
  (NVML's mean utilisation over the samples, where pynvml is installed, of the device that
  ``CUDA_VISIBLE_DEVICES`` names for the rank: ``hpoflow.train.energy.visible_gpus``), on GPU only;
- the energy figures, where an ``EnergyMeter`` (``hpoflow.train.energy``) is given: the attributed
  ``energy_j``, ``cpu_energy_j``, ``gpu_energy_j`` and their shares, the raw counters beside them
  (``*_raw``), and the idle powers and figures above idle where measured; its counters are read at
  start, at each sample, and at stop.

``HPOFLOW_USAGE=0`` in the workers' environment turns sampling off.
``hpoflow.trial.aggregate_usage`` merges a trial's ranks: CPU and mean RSS averaged, peaks maxed,
bytes summed.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hpoflow.train.energy import EnergyMeter

__all__ = ["UsageSampler"]

_TCP_INFO_LEN = 232
_BYTES_ACKED = 120  # offsetof(struct tcp_info, tcpi_bytes_acked)
_BYTES_RECEIVED = 128  # offsetof(struct tcp_info, tcpi_bytes_received)
_MB = 1024 * 1024


def _tcp_counters() -> dict[str, tuple[int, int]]:
    """(bytes acked, bytes received) of each TCP socket of this process, by socket inode."""
    out: dict[str, tuple[int, int]] = {}
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return out
    for name in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:"):
            continue
        try:
            dup = os.dup(int(name))
        except OSError:  # closed since the listing
            continue
        try:
            s = socket.socket(fileno=dup)
        except OSError:  # no longer a socket (the number was reused): close the duplicate
            os.close(dup)
            continue
        try:
            if s.type != socket.SOCK_STREAM or s.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            raw = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
            if len(raw) >= _BYTES_RECEIVED + 8:
                acked, received = struct.unpack_from("=QQ", raw, _BYTES_ACKED)
                out[target] = (acked, received)
        except OSError:
            pass
        finally:
            s.close()  # closes the dup only: the connection lives on through the original fd
    return out


class _Ticker:
    """The one sampling thread of this process: every ``interval`` it samples the running samplers
    that have run their quiet time. Started with the first sampler, it stays (a worker runs trial after
    trial: no thread to start and join per trial); a forked child starts its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.samplers: list[UsageSampler] = []
        self.pid = -1

    def add(self, sampler: UsageSampler) -> None:
        with self.lock:
            self.samplers.append(sampler)
            if self.pid != os.getpid():  # none yet, or the thread of the process this one forked from
                self.pid = os.getpid()
                threading.Thread(target=self._loop, name="hpoflow-usage", daemon=True).start()

    def remove(self, sampler: UsageSampler) -> None:
        with self.lock:
            if sampler in self.samplers:
                self.samplers.remove(sampler)

    def _loop(self) -> None:
        pid = os.getpid()
        while self.pid == pid:
            with self.lock:
                running = list(self.samplers)
            step = min((s.interval_s for s in running), default=0.5)
            time.sleep(step)
            now = time.monotonic()
            for s in running:
                if now - s._t0 >= s.quiet_s and not s._stop.is_set():
                    s._sample()


_TICKER = _Ticker()
_PROC: tuple[int, Any] = (-1, None)  # this process's psutil.Process, made once per process


def _process() -> Any:
    global _PROC
    pid = os.getpid()
    if _PROC[0] != pid:
        import psutil

        _PROC = (pid, psutil.Process())
    return _PROC[1]


class UsageSampler:
    """Start with ``start()``, end with ``stop()`` (returns the summary; idempotent). ``quiet_s``: no
    sample before the trial has run that long (the one at ``stop`` measures a short trial)."""

    def __init__(self, interval_s: float = 0.5, cuda_device: int | None = None, quiet_s: float = 1.0,
                 energy: EnergyMeter | None = None, tree: bool = False) -> None:
        self.interval_s = interval_s
        self.tree = tree
        self._tree_io: dict[int, tuple[int, int]] = {}  # descendant pid -> (write bytes at first sight, last)
        self._maxrss0 = 0.0
        self.energy = energy
        self._energy_lock = threading.Lock()
        self.quiet_s = quiet_s
        self.cuda_device = cuda_device
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._rss: list[float] = []
        self._gpu_util: list[float] = []
        self._sockets: dict[str, tuple[int, int]] = {}
        self._base: dict[str, tuple[int, int]] = {}
        self._summary: dict[str, float] | None = None
        self._proc: Any = None
        self._t0 = 0.0
        self._cpu0 = 0.0
        self._io0 = 0
        self._nvml: tuple[Any, Any] | None = None  # (NVML, the rank's device handle)

    def start(self) -> UsageSampler:
        try:
            self._proc = _process()
        except ImportError:  # psutil is a dependency; a stripped environment still runs trials
            return self
        self._t0 = time.monotonic()
        self._cpu0 = _cpu_s(self.tree)
        self._maxrss0 = _children_maxrss_mb()
        self._tree_io = {}
        self._io0 = self._write_bytes()
        self._sockets = {}  # sockets of an earlier trial in this worker count only what they add now
        self._base = _tcp_counters()
        if self.cuda_device is not None:
            self._nvml = _nvml_handle(self.cuda_device)
        if self.energy is not None:
            self.energy.start()
        _TICKER.add(self)
        return self

    def _write_bytes(self) -> int:
        try:
            return int(self._proc.io_counters().write_bytes)
        except (AttributeError, OSError, NotImplementedError):
            return 0

    def _sample(self) -> None:
        if self.energy is not None:
            with self._energy_lock:
                self.energy.sample()
        try:
            rss = self._proc.memory_info().rss / _MB
        except Exception:  # the process is going away
            return
        if self.tree:
            rss += self._descendants()
        counters = _tcp_counters()
        util = None
        if self._nvml is not None:
            nvml, handle = self._nvml
            try:
                util = float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu)
            except Exception:  # not supported (a MIG instance, an old GPU): no figure
                util = None
        with self._lock:
            self._rss.append(rss)
            if util is not None:
                self._gpu_util.append(util)
            for key, (acked, received) in counters.items():
                a0, r0 = self._base.get(key, (0, 0))
                old = self._sockets.get(key, (0, 0))
                self._sockets[key] = (max(old[0], acked - a0), max(old[1], received - r0))

    def _descendants(self) -> float:
        """The resident memory (MB) of this process's live descendants now; notes their bytes written."""
        total = 0.0
        try:
            children = self._proc.children(recursive=True)
        except Exception:  # the process is going away
            return 0.0
        for child in children:
            try:
                total += child.memory_info().rss / _MB
                written = int(child.io_counters().write_bytes)
            except Exception:  # gone meanwhile, or not ours to read
                continue
            first, _ = self._tree_io.get(child.pid, (written, written))
            self._tree_io[child.pid] = (first, written)
        return total

    def stop(self) -> dict[str, float]:
        """Take a last sample, leave the sampling thread, return the summary (``{}`` without psutil)."""
        if self._summary is not None:
            return self._summary
        if self._proc is None:
            self._summary = {}
            return self._summary
        self._stop.set()
        _TICKER.remove(self)
        self._sample()
        energy: dict[str, float] = {}
        if self.energy is not None:
            with self._energy_lock:
                energy = self.energy.stop()
        wall = max(1e-9, time.monotonic() - self._t0)
        cpu_s = max(0.0, _cpu_s(self.tree) - self._cpu0)
        peak = max(self._rss, default=0.0)
        if self.tree and (maxrss := _children_maxrss_mb()) > self._maxrss0:  # a descendant's peak, once reaped
            peak = max(peak, maxrss)
        with self._lock:
            sent = sum(a for a, _ in self._sockets.values())
            recv = sum(r for _, r in self._sockets.values())
            summary = {"cpu_percent": round(100.0 * cpu_s / wall, 1),
                       "rss_peak_mb": round(peak, 1),
                       "rss_mean_mb": round(sum(self._rss) / len(self._rss), 1) if self._rss else 0.0,
                       "net_sent_mb": round(sent / _MB, 3), "net_recv_mb": round(recv / _MB, 3),
                       "disk_write_mb": round((max(0, self._write_bytes() - self._io0)
                                               + sum(last - first for first, last in self._tree_io.values())) / _MB, 3)}
            if self._gpu_util:
                summary["gpu_util_percent"] = round(sum(self._gpu_util) / len(self._gpu_util), 1)
        torch = sys.modules.get("torch")
        if self.cuda_device is not None and torch is not None and torch.cuda.is_available():
            summary["gpu_peak_mem_mb"] = round(torch.cuda.max_memory_allocated(self.cuda_device) / _MB, 1)
        summary.update(energy)
        self._summary = summary
        return summary


def _cpu_s(tree: bool = False) -> float:
    """CPU time of this process, all its threads (user + system); with ``tree``, also of the descendants it
    (and they, recursively) waited for: a command trial's program and what it started, once ended."""
    t = os.times()
    return t.user + t.system + ((t.children_user + t.children_system) if tree else 0.0)


def _children_maxrss_mb() -> float:
    """The largest resident memory any waited-for descendant of this process reached (MB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # (Linux: kB)


def _nvml_handle(index: int) -> tuple[Any, Any] | None:
    """NVML (``load_nvml``) and its handle of the rank's CUDA device ``index`` (``cuda:index``): the
    device ``CUDA_VISIBLE_DEVICES`` names at that place (an index or a UUID), not NVML's device of that
    number; None where there is none (no pynvml, no driver, no such device)."""
    from hpoflow.train.energy import device_handle, load_nvml, visible_gpus

    devices = visible_gpus(index + 1)
    nvml = load_nvml()
    if nvml is None or index >= len(devices):
        return None
    try:
        return nvml, device_handle(nvml, devices[index])
    except Exception:  # NVMLError (no such device) or the fixture's: utilisation is simply not reported
        return None
