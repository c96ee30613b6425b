"""RAPL, the CPU energy counters of Linux's powercap (``/sys/class/powercap/intel-rapl:<n>``): the zones
counted, chosen by their ``name`` file, and a reader that adds what they advanced (docs/energy.md).

Part of ``hpoflow.train.energy`` (which re-exports ``Rapl``); ``HPOFLOW_POWERCAP_ROOT`` (a test hook)
replaces ``/sys/class/powercap`` with a directory tree of the same shape.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["POWERCAP_ROOT", "Rapl"]

POWERCAP_ROOT = Path("/sys/class/powercap")
_UJ_PER_J = 1_000_000.0


@dataclass
class _Zone:
    path: Path
    max_uj: int | None
    last: int
    total_uj: int = 0

    def advance(self) -> None:
        value = _read_int(self.path / "energy_uj")
        if value is None:
            return
        if value >= self.last:
            self.total_uj += value - self.last
        elif self.max_uj:  # wrapped around once since the last sample
            self.total_uj += self.max_uj - self.last + value
        self.last = value


class Rapl:
    """The RAPL counters under ``root`` (``/sys/class/powercap``): ``start`` reads them, ``sample`` adds
    what each advanced since (once around the counter where it wrapped), ``joules`` is the packages' sum
    so far and ``dram_joules`` the DRAM zones'. ``readable`` is False where no package counter could be
    read (none, or root only)."""

    def __init__(self, root: Path | str | None = None) -> None:
        self.root = Path(root) if root is not None else _powercap_root()
        self._zones: list[_Zone] = []
        self._dram: list[_Zone] = []

    @staticmethod
    def zones(root: Path) -> dict[str, list[Path]]:
        """The zones counted, by their ``name`` file: ``package``, the top-level zones ``intel-rapl:<n>``
        named ``package-<n>`` (``package-<n>-die-<m>`` on parts with several dies); ``dram``, the zones
        named ``dram`` (a subzone of a package on servers, measured apart from it). Everything else is
        left out: ``psys`` (the platform, which includes the packages), ``core`` and ``uncore`` (parts of
        a package), ``intel-rapl-mmio:*`` (a package again, through MMIO), a zone whose name is unreadable."""
        out: dict[str, list[Path]] = {"package": [], "dram": []}
        try:
            entries = sorted(root.iterdir())
        except OSError:
            return out
        for zone in entries:
            if not zone.name.startswith("intel-rapl:"):
                continue
            try:
                name = (zone / "name").read_text().strip()
            except OSError:
                continue
            if name.startswith("package-") and zone.name.count(":") == 1:
                out["package"].append(zone)
            elif name == "dram":
                out["dram"].append(zone)
        return out

    @staticmethod
    def packages(root: Path) -> list[Path]:
        """The package zones (``zones(root)["package"]``)."""
        return Rapl.zones(root)["package"]

    def start(self) -> Rapl:
        found = self.zones(self.root)
        self._zones = _open_zones(found["package"])
        self._dram = _open_zones(found["dram"])
        return self

    @property
    def readable(self) -> bool:
        return bool(self._zones)

    @property
    def dram_readable(self) -> bool:
        return bool(self._dram)

    def sample(self) -> None:
        for z in (*self._zones, *self._dram):
            z.advance()

    def joules(self) -> float:
        return sum(z.total_uj for z in self._zones) / _UJ_PER_J

    def dram_joules(self) -> float:
        return sum(z.total_uj for z in self._dram) / _UJ_PER_J

    def idle_w(self, seconds: float) -> float | None:
        """The packages' mean power (W) over the next ``seconds``, after which every count starts again
        from 0; None where the window measured nothing (no counter advanced: unreadable meanwhile)."""
        t0 = time.monotonic()
        time.sleep(seconds)
        self.sample()
        elapsed = time.monotonic() - t0
        joules = self.joules()
        for z in (*self._zones, *self._dram):
            z.total_uj = 0
        return joules / elapsed if elapsed > 0 and joules > 0 else None


def _open_zones(paths: list[Path]) -> list[_Zone]:
    out = []
    for zone in paths:
        value = _read_int(zone / "energy_uj")
        if value is not None:
            out.append(_Zone(zone, _read_int(zone / "max_energy_range_uj"), value))
    return out


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):  # absent, root only (kernels >= 5.10), or not a number
        return None


def _powercap_root() -> Path:
    return Path(os.environ.get("HPOFLOW_POWERCAP_ROOT") or POWERCAP_ROOT)
