"""COMPSs site-config facts for ``hpoflow launch``: where ``enqueue_compss`` reads its site config, and
whether it keeps ``--qos`` (the job's time is ``hpoflow.engines.cluster.jobtime``).

``enqueue_compss`` without ``--exec_time`` asks for COMPSs's default of 10 minutes, and it drops
``--qos`` where the site config (``--sc_cfg``; COMPSs's generic ``default.cfg`` included) sets
``DISABLE_QARG_QOS=true``. These functions are pure (the environment and file reads are parameters
or explicit) and return warnings as text for the CLI to print.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

__all__ = ["qos_warning", "sc_cfg_file"]

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
