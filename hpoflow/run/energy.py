"""A trial's energy over all its runs: what a study's energy objective reads and what its energy budget
counts (docs/energy.md).

A trial may run more than once: a scheduler pauses it at a rung and promotes it later (its segments, all
of one Optuna trial); a failed attempt is retried (the same trial again); a cancelled run is rerun as a new
trial (``ATTR_REPLACES``), which resumes from the cancelled one's checkpoints. Each run measures its own
energy (``hpoflow.train.energy``: the figures in its result's ``system``). Two sums are kept:

- **The trial's energy**, its ``system`` figures as recorded (``energy_j`` and every other additive figure,
  ``ADDITIVE``), which objectives and constraints read: the runs its result builds on, every segment that
  ended in a pause (its own, and those of the trial it reruns: ``ATTR_ENERGY_CARRIED``) and its final run.
  A figure is summed only where every one of those runs has it (a partial sum is no total);
  ``energy_runs`` says how many runs the figures add up, where more than one.
- **The energy spent** (``system.energy_spent_j``; ``ATTR_ENERGY_SPENT`` while the trial runs or is
  paused): every run's ``energy_j``, its segments, its failed attempts that were retried, and the run that
  ended it (complete, pruned, failed or cancelled). ``search.energy_budget_kwh`` and ``hpoflow status``'s
  ``energy_kwh`` add it up over every trial of the study that ran, an interrupted one included
  (``spent_j``). A run without a measured ``energy_j`` adds nothing: the sum is what was measured, never a
  guess.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import optuna

from hpoflow.run.ledger import ATTR_IMPORTED, ATTR_SEGMENTS, ATTR_UNUSED

__all__ = ["ADDITIVE", "ATTR_ENERGY_CARRIED", "ATTR_ENERGY_SPENT", "SEGMENT_ENERGY", "carried_energy", "record_run",
           "run_energy", "spent_j", "trial_energy"]

ATTR_ENERGY_SPENT = "hpoflow_energy_spent_j"  # user attr: J measured by the trial's runs that did not end it
ATTR_ENERGY_CARRIED = "hpoflow_energy_carried"  # user attr of a rerun: the replaced trial's segments' figures
SEGMENT_ENERGY = "energy"  # key of a segment record (ATTR_SEGMENTS): the additive figures of that run
_RUNS = "runs"  # key of ATTR_ENERGY_CARRIED: how many runs its figures add up

ADDITIVE = ("energy_j", "cpu_energy_j", "gpu_energy_j", "cpu_energy_j_raw", "gpu_energy_j_raw", "dram_energy_j_raw",
            "energy_above_idle_j", "cpu_energy_above_idle_j", "gpu_energy_above_idle_j")
"""The ``system`` figures of a run that add up over runs (joules); shares and powers do not."""


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) else None


def run_energy(system: Mapping[str, Any] | None) -> dict[str, float]:
    """The additive figures of one run's ``system``."""
    if not isinstance(system, Mapping):
        return {}
    return {k: v for k in ADDITIVE if (v := _number(system.get(k))) is not None}


def _earlier(attrs: Mapping[str, Any]) -> tuple[list[dict[str, float]], int]:
    """The figures of the runs a trial's result builds on before its last run, and how many runs they are:
    its paused segments, and what a rerun carries of the replaced trial's."""
    runs: list[dict[str, float]] = []
    for seg in attrs.get(ATTR_SEGMENTS) or []:
        if isinstance(seg, Mapping):
            runs.append(run_energy(seg.get(SEGMENT_ENERGY)))
    count = len(runs)
    carried = attrs.get(ATTR_ENERGY_CARRIED)
    if isinstance(carried, Mapping) and (n := _number(carried.get(_RUNS))):
        runs.append(run_energy(carried))
        count += int(n)
    return runs, count


def trial_energy(system: Mapping[str, Any], attrs: Mapping[str, Any]) -> dict[str, Any]:
    """The ``system`` a trial's last run is recorded with (``attrs``: the trial's user attrs before it):
    each additive figure summed over the runs the result builds on (module docstring), ``energy_runs``
    where they are more than one, and ``energy_spent_j``. ``system`` itself where no run measured energy."""
    earlier, count = _earlier(attrs)
    spent_before = _number(attrs.get(ATTR_ENERGY_SPENT)) or 0.0
    mine = run_energy(system)
    if not mine and not spent_before and not any(earlier):
        return dict(system)
    out = dict(system)
    for key in ADDITIVE:
        if key in mine and all(key in run for run in earlier):
            out[key] = round(mine[key] + sum(run[key] for run in earlier), 3)
        else:
            out.pop(key, None)  # a run without it: the sum would pass a part for the whole
    if count:
        out["energy_runs"] = count + 1
    if spent_before or "energy_j" in mine:
        out["energy_spent_j"] = round(spent_before + mine.get("energy_j", 0.0), 3)
    return out


def record_run(trial: optuna.trial.Trial, system: Mapping[str, Any]) -> float:
    """A run of ``trial`` ended without ending it (a pause, a failed attempt that is retried): its
    ``energy_j`` is added to the trial's ``ATTR_ENERGY_SPENT`` (written only where it measured some).
    Returns the trial's energy spent so far."""
    before = _number(trial.user_attrs.get(ATTR_ENERGY_SPENT)) or 0.0
    joules = run_energy(system).get("energy_j", 0.0)
    if joules > 0:
        trial.set_user_attr(ATTR_ENERGY_SPENT, round(before + joules, 3))
    return before + joules


def spent_j(attrs: Mapping[str, Any]) -> float | None:
    """The energy a trial's runs spent, from its user attrs (module docstring), whatever its state; None
    where none was measured, and for a trial that never ran here (imported by a warm start, closed unrun)."""
    if ATTR_IMPORTED in attrs or ATTR_UNUSED in attrs:
        return None
    system = attrs.get("system")
    recorded = None
    if isinstance(system, Mapping):
        recorded = _number(system.get("energy_spent_j"))
        if recorded is None:  # recorded before energy_spent_j: its one run
            recorded = _number(system.get("energy_j"))
    running = _number(attrs.get(ATTR_ENERGY_SPENT))
    values = [v for v in (recorded, running) if v is not None]
    return max(values) if values else None


def carried_energy(attrs: Mapping[str, Any]) -> dict[str, Any]:
    """What the rerun of an interrupted trial carries of its energy: the figures of the runs it builds
    on before its own, the replaced trial's paused segments (and what that trial carried), as
    ``{ATTR_ENERGY_CARRIED: {...figures, "runs": n}}``; ``{}`` where it paused never."""
    earlier, count = _earlier(attrs)
    if not count:
        return {}
    sums: dict[str, Any] = {key: round(sum(run[key] for run in earlier), 3) for key in ADDITIVE
                            if all(key in run for run in earlier)}
    sums[_RUNS] = count
    return {ATTR_ENERGY_CARRIED: sums}
