"""COMPSs site configs for ``hpoflow launch``: which one ``enqueue_compss`` reads, what it says, and
whether the job it would write is the one the user asked for (the job's time is
``hpoflow.engines.cluster.jobtime``).

``enqueue_compss`` reads a *site config* (``--sc_cfg=NAME|FILE``; default ``default``): a shell file
under ``$COMPSS_HOME/Runtime/scripts/queues/supercomputers/`` (COMPSs 3.3 ships 40) whose variables
decide the job script it writes. Three of them change what a user asked for without a word:

- ``QUEUE_SYSTEM``: the batch system the script is written for and submitted to. COMPSs's generic
  ``default.cfg`` says ``"lsf"``: on a SLURM login node the job would go to ``bsub``.
- ``ENABLE_PROJECT_NAME``: unless it is exactly ``true``, ``--project_name`` (``--account``) is left
  out of the script (no ``#SBATCH -A``); when it is ``true``, a job without one is refused.
- ``DISABLE_QARG_QOS``: unless it is empty or ``false``, ``--qos`` is left out.

``check_site`` turns those into one refusal (the rule, the value, the variable to set or the
``--sc-cfg`` to pass) or warnings where no config can be read here. ``DEFAULT_CPUS_PER_NODE`` /
``DEFAULT_GPUS_PER_NODE`` are what a job gets without ``--cpus_per_node``/``--gpus_per_node``.
Everything is a pure function of its arguments (files, environment and ``which`` are parameters).
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SiteCheck", "SiteConfig", "check_site", "compss_home", "read_site_config", "sc_cfg_file",
           "site_config_dir"]

_ASSIGN = re.compile(r"^\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)=(.*)$")


def compss_home(env: Mapping[str, str] | None = None, which: Callable[[str], str | None] = shutil.which
                ) -> Path | None:
    """COMPSs's installation: ``COMPSS_HOME``, else where ``enqueue_compss`` is
    (``<home>/Runtime/scripts/user/enqueue_compss``), else None."""
    env = os.environ if env is None else env
    home = env.get("COMPSS_HOME")
    if home:
        return Path(home)
    exe = which("enqueue_compss")
    return Path(exe).resolve().parents[3] if exe else None


def site_config_dir(env: Mapping[str, str] | None = None, which: Callable[[str], str | None] = shutil.which
                    ) -> Path | None:
    """``<COMPSs home>/Runtime/scripts/queues/supercomputers`` when it exists here."""
    home = compss_home(env, which)
    path = home / "Runtime" / "scripts" / "queues" / "supercomputers" if home else None
    return path if path is not None and path.is_dir() else None


def sc_cfg_file(sc_cfg: str | None, env: Mapping[str, str] | None = None,
                which: Callable[[str], str | None] = shutil.which) -> Path | None:
    """The site config file enqueue_compss would read, if it can be found here: as enqueue_compss does,
    ``sc_cfg`` as a file if it is one, else ``<name>.cfg`` (default ``default``) in ``site_config_dir``."""
    if sc_cfg and Path(sc_cfg).is_file():
        return Path(sc_cfg)
    folder = site_config_dir(env, which)
    if folder is None:
        return None
    name = sc_cfg or "default"
    path = folder / (name if name.endswith("cfg") else f"{name}.cfg")
    return path if path.is_file() else None


def _value(text: str) -> str:
    """A shell assignment's value as the shell sees it for the plain forms site configs use:
    ``"lsf" #from queues/`` -> ``lsf``, ``true`` -> ``true``."""
    text = text.strip()
    if text[:1] in ("'", '"'):
        end = text.find(text[0], 1)
        return text[1:end] if end > 0 else text[1:]
    words = text.split(" #", 1)[0].split()
    return words[0] if words else ""


@dataclass(frozen=True)
class SiteConfig:
    """A site config's variables (the last assignment of each wins, as in the shell)."""

    path: Path
    values: Mapping[str, str] = field(default_factory=dict)

    @property
    def queue_system(self) -> str:
        return self.values.get("QUEUE_SYSTEM", "")

    @property
    def slurm(self) -> bool:
        """Written for SLURM (``slurm``, or a site's SLURM variant such as ``ccc_slurm``)."""
        return "slurm" in self.queue_system.lower()

    @property
    def project_name_enabled(self) -> bool:
        return self.values.get("ENABLE_PROJECT_NAME", "") == "true"  # the script's own test

    @property
    def qos_disabled(self) -> bool:
        return self.values.get("DISABLE_QARG_QOS", "") not in ("", "false")  # the script's own test

    def number(self, name: str) -> int | None:
        """An integer variable (``DEFAULT_CPUS_PER_NODE``...), None when unset or not a number."""
        value = self.values.get(name, "")
        return int(value) if value.isascii() and value.isdigit() else None


def read_site_config(path: Path) -> SiteConfig:
    """Parse a site config's ``NAME=value`` lines (unreadable: no values)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return SiteConfig(path)
    values: dict[str, str] = {}
    for line in text.splitlines():
        m = _ASSIGN.match(line)
        if m:
            values[m.group(1)] = _value(m.group(2))
    return SiteConfig(path, values)


@dataclass(frozen=True)
class SiteCheck:
    """What ``check_site`` found: a refusal (one line: rule, value, fix) or None, and warnings."""

    error: str | None = None
    warnings: tuple[str, ...] = ()


def _slurm_configs(folder: Path | None) -> list[str]:
    if folder is None:
        return []
    return [p.stem for p in sorted(folder.glob("*.cfg")) if read_site_config(p).slurm]


def check_site(cfg: SiteConfig | None, *, sc_cfg: str | None, sbatch_here: bool, account: str | None,
               qos: str | None, folder: Path | None) -> SiteCheck:
    """Whether the job enqueue_compss would write from site config ``cfg`` (None: not found here) is the
    one asked for: written for SLURM where ``sbatch`` is (``sbatch_here``), with the ``account`` and
    ``qos`` given. ``folder``: the site configs' directory here (None: COMPSs not found)."""
    if cfg is None:
        if sc_cfg and folder is not None:
            return SiteCheck(
                f"--sc-cfg {sc_cfg}: there is no such file and no {sc_cfg.removesuffix('.cfg')}.cfg in {folder}, "
                "so enqueue_compss would stop. Fix: pass a site config file, or one of the names there: "
                f"{', '.join(p.stem for p in sorted(folder.glob('*.cfg'))) or '(none)'}")
        asked = [f for f, given in (("--account", account), ("--qos", qos)) if given]
        if not asked and not (sbatch_here and not sc_cfg):
            return SiteCheck()
        what = (f"whether {' and '.join(asked)} will be kept" if asked else "which queue system the job is for")
        return SiteCheck(warnings=(
            f"no COMPSs site config found here (COMPSS_HOME unset, enqueue_compss not on PATH), so {what} cannot "
            f"be checked: enqueue_compss reads {sc_cfg or 'default'}.cfg, whose QUEUE_SYSTEM, ENABLE_PROJECT_NAME "
            "and DISABLE_QARG_QOS decide it (COMPSs's generic default.cfg: LSF, no account, no QoS). Fix: run "
            "hpoflow launch where COMPSs is loaded (module load COMPSs), and pass --sc-cfg with your site's config",))
    where = f"the site config {cfg.path}"
    if sbatch_here and not cfg.slurm:
        slurm = _slurm_configs(folder)
        names = f" (there: {', '.join(slurm[:6])}{', ...' if len(slurm) > 6 else ''})" if slurm else ""
        return SiteCheck(
            f"{where} sets QUEUE_SYSTEM={cfg.queue_system or '(nothing)'!r}, but this is a SLURM login node (sbatch "
            f"is on PATH): enqueue_compss would write the job script for {cfg.queue_system or 'no queue system'} and "
            f"submit it that way. Fix: pass --sc-cfg with your site's SLURM config{names}, or a copy of {cfg.path} "
            'that sets QUEUE_SYSTEM="slurm"')
    if account and not cfg.project_name_enabled:
        return SiteCheck(
            f"--account {account} would be dropped: {where} does not set ENABLE_PROJECT_NAME=true, so "
            "enqueue_compss leaves --project_name out of the job script (no account line: the job is refused or "
            f"charged to your default account). Fix: pass --sc-cfg with a copy of {cfg.path} that sets "
            "ENABLE_PROJECT_NAME=true, or drop --account")
    if not account and cfg.project_name_enabled:
        return SiteCheck(
            f"{where} sets ENABLE_PROJECT_NAME=true, so enqueue_compss refuses a job without a project name. "
            "Fix: pass --account NAME")
    if qos and cfg.qos_disabled:
        return SiteCheck(
            f"--qos {qos} would be dropped: {where} sets DISABLE_QARG_QOS={cfg.values.get('DISABLE_QARG_QOS')}, so "
            f"enqueue_compss leaves --qos out of the job script. Fix: pass --sc-cfg with a copy of {cfg.path} that "
            "sets DISABLE_QARG_QOS=false, or drop --qos")
    return SiteCheck()
