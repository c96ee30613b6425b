"""hpoflow: task-based hyperparameter optimisation for deep learning, from laptops to HPC clusters.

>>> import hpoflow
>>> result = hpoflow.optimize("examples/digits.yaml", run_dir="runs/digits")  # doctest: +SKIP
>>> result.best_params  # doctest: +SKIP
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from hpoflow._version import __version__

# A library logs, it does not print: messages go to the "hpoflow" logger; the CLI and the rank
# processes attach a handler (stderr, which a rank's log file captures).
logging.getLogger("hpoflow").addHandler(logging.NullHandler())

__all__ = ["StudyResult", "StudySpec", "TrialContext", "__version__", "load_spec", "optimize"]

if TYPE_CHECKING:
    from hpoflow.api import StudyResult, optimize
    from hpoflow.spec import StudySpec, load_spec
    from hpoflow.train import TrialContext


def __getattr__(name: str) -> Any:
    # Lazy: `import hpoflow` stays cheap (no torch, no optuna) until something is used.
    if name in ("optimize", "StudyResult"):
        from hpoflow import api

        return getattr(api, name)
    if name in ("StudySpec", "load_spec"):
        from hpoflow import spec

        return getattr(spec, name)
    if name == "TrialContext":
        from hpoflow.train import TrialContext

        return TrialContext
    raise AttributeError(f"module 'hpoflow' has no attribute {name!r}")
