"""Batch-job settings of ``hpoflow launch`` derived from the study: the job's time, qos warnings.

``enqueue_compss`` without ``--exec_time`` asks for COMPSs's default of 10 minutes, and it drops
``--qos`` where the site config (``--sc_cfg``; COMPSs's generic ``default.cfg`` included) sets
``DISABLE_QARG_QOS=true``. These functions are pure (the environment and file reads are parameters
or explicit) and return warnings as text for the CLI to print.
"""

from __future__ import annotations

import math
import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["FLOOR_MINUTES", "MARGIN_MINUTES", "JobTime", "job_time", "qos_warning", "sc_cfg_file"]

FLOOR_MINUTES = 30  # never ask for less: COMPSs start-up, queueing of the first tasks, shutdown
MARGIN_MINUTES = 5  # on top of the study's budget: runtime start and stop


@dataclass(frozen=True)
class JobTime:
    """The ``--exec_time`` of the job in minutes, how it was chosen, and warnings for the user."""

    minutes: int
    source: str
    warnings: tuple[str, ...] = ()


def job_time(given: int | None, *, search_timeout: float | None, n_trials: int | None, max_concurrent: int,
             trial_timeout: float | None) -> JobTime:
    """``given`` (``--time``) or one derived from the study's budget, with a floor.

    Derived: ``search.timeout`` (no trial starts after it) plus one trial's ``resources.timeout`` (a
    trial started just before the deadline runs to its end); else ``ceil(n_trials / max_concurrent)``
    waves of ``resources.timeout``; plus ``MARGIN_MINUTES``, at least ``FLOOR_MINUTES``. A warning when
    the time is shorter than one trial's timeout, or when nothing bounds the study.
    """
    warnings: list[str] = []
    if given is not None:
        minutes, source = given, "--time"
    else:
        budget_s: float | None = None
        if search_timeout:
            budget_s = search_timeout + (trial_timeout or 0.0)
            source = "search.timeout" + (" + resources.timeout" if trial_timeout else "")
        elif n_trials and trial_timeout:
            budget_s = math.ceil(n_trials / max(1, max_concurrent)) * trial_timeout
            source = "ceil(search.n_trials / search.max_concurrent) x resources.timeout"
        if budget_s is None:
            minutes, source = FLOOR_MINUTES, "the floor"
            warnings.append(
                f"--time not given and the study has no time budget (search.timeout, or search.n_trials with "
                f"resources.timeout): asking for {FLOOR_MINUTES} minutes; the batch system stops the study "
                "then. Fix: pass --time MINUTES, or set search.timeout")
        else:
            minutes = max(FLOOR_MINUTES, math.ceil(budget_s / 60) + MARGIN_MINUTES)
            source += f" + {MARGIN_MINUTES} min" + (f", at least {FLOOR_MINUTES}" if minutes == FLOOR_MINUTES else "")
    if trial_timeout and minutes * 60 < trial_timeout:
        warnings.append(
            f"the job's time ({minutes} min, from {source}) is shorter than one trial's timeout "
            f"(resources.timeout = {trial_timeout:g} s): the batch system will kill trials before they end. "
            f"Fix: --time {math.ceil(trial_timeout / 60) + MARGIN_MINUTES} or more, or lower resources.timeout")
    return JobTime(minutes, source, tuple(warnings))


def sc_cfg_file(sc_cfg: str | None, env: Mapping[str, str] | None = None,
                which: Callable[[str], str | None] = shutil.which) -> Path | None:
    """The site config file enqueue_compss would read, if it can be found here.

    As enqueue_compss does: ``sc_cfg`` as a file if it is one, else ``<name>.cfg`` (default
    ``default``) under ``$COMPSS_HOME/Runtime/scripts/queues/supercomputers/``; ``COMPSS_HOME`` from
    the environment or from where ``enqueue_compss`` is (``<home>/Runtime/scripts/user/``).
    """
    env = os.environ if env is None else env
    if sc_cfg and Path(sc_cfg).is_file():
        return Path(sc_cfg)
    home = env.get("COMPSS_HOME")
    if not home:
        exe = which("enqueue_compss")
        if exe is None:
            return None
        home = str(Path(exe).resolve().parents[3])
    name = sc_cfg or "default"
    path = Path(home) / "Runtime" / "scripts" / "queues" / "supercomputers" / (
        name if name.endswith("cfg") else f"{name}.cfg")
    return path if path.is_file() else None


def qos_warning(qos: str | None, cfg: Path | None) -> str | None:
    """A warning when ``--qos`` will be (or may be) dropped by enqueue_compss; None when it is used."""
    if not qos:
        return None
    if cfg is None:
        return (f"--qos {qos} may be ignored: enqueue_compss drops it when the site config sets "
                "DISABLE_QARG_QOS=true (COMPSs's generic default.cfg does), and no site config was found here "
                "to check. Fix: pass --sc-cfg with your site's config (ask your support team which), and "
                "check that the job script enqueue_compss writes has the QoS line")
    try:
        text = cfg.read_text(errors="replace")
    except OSError:
        text = ""
    found = re.findall(r"^\s*DISABLE_QARG_QOS\s*=\s*\"?(\w+)\"?", text, flags=re.MULTILINE)
    if found and found[-1].lower() == "true":
        return (f"--qos {qos} will be ignored: the site config {cfg} sets DISABLE_QARG_QOS=true, so "
                "enqueue_compss drops the flag. Fix: pass --sc-cfg with a config for your site that allows a "
                "QoS, or drop --qos")
    return None
