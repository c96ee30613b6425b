"""The PyCOMPSs API as the compss engine uses it, and whether the runtime is there.

``pycompss_available()``: the binding is importable. ``runtime_active()``: this process runs under
``runcompss``/``enqueue_compss`` (the binding's context says "master"). Outside the runtime the
binding runs tasks synchronously and ``@multinode`` raises, so the engine uses its own sequential
mode there (see ``hpoflow.engines.compss``).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["INSTALL_HINT", "api", "pycompss_available", "runtime_active"]

INSTALL_HINT = (
    "Fix: on a cluster, load the COMPSs module (e.g. `module load COMPSs`) or install COMPSs and "
    "`pip install -e '.[compss]'` (pip install pycompss), then launch with `hpoflow launch SPEC "
    "--engine compss`; on a laptop, use engine: local (or `python workflows/hpo.py SPEC`, which "
    "falls back to running the trials one at a time)"
)


def pycompss_available() -> bool:
    try:
        importlib.import_module("pycompss.api.api")
    except ImportError:
        return False
    return True


def runtime_active() -> bool:
    """True inside a COMPSs application's master (runcompss), False in plain ``python``."""
    try:
        ctx = importlib.import_module("pycompss.util.context")
    except ImportError:
        return False
    context = getattr(ctx, "CONTEXT", None)  # COMPSs >= 3.0
    if context is not None and hasattr(context, "in_master"):
        return bool(context.in_master())
    fn = getattr(ctx, "in_master", None) or getattr(ctx, "in_pycompss", None)  # COMPSs 2.x
    return bool(fn()) if callable(fn) else False


def api() -> Any:
    """``pycompss.api.api`` (``compss_wait_on``, ``TaskGroup``, ``compss_cancel_group``)."""
    return importlib.import_module("pycompss.api.api")
