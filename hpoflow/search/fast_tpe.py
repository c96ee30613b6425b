"""Optuna's TPE with SciPy's vectorized ``log_ndtr``.

Optuna 5.0's TPE computes the log of the standard normal CDF element by element in Python
(``optuna.samplers._tpe._truncnorm._log_ndtr``: ``np.frompyfunc`` over ``_log_ndtr_single``). It is called
for every kernel and candidate of every integer or stepped parameter, and for the truncation of every
kernel, so it took most of an ask's time (a profile of asks over LCBench's 7 parameters, 3 of them
integers). ``install`` replaces that one function, in that one module, with
``scipy.special.log_ndtr`` (SciPy comes with scikit-learn, a dependency), which gives the same values to
within 1e-7 relative (SciPy's is the more accurate in the far tails); the rest of TPE is Optuna's.

The replacement is made only where Optuna's function is the one it replaces (the module and its
``_log_ndtr_single`` exist): another Optuna keeps its own. ``installed()`` says whether it is in place.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np

__all__ = ["install", "installed"]

_state: dict[str, Any] = {}


def _log_ndtr(a: Any) -> np.ndarray:
    from scipy.special import log_ndtr

    out: np.ndarray = log_ndtr(np.asarray(a, dtype=float))
    return out


def install() -> bool:
    """Put SciPy's ``log_ndtr`` in Optuna's TPE (module docstring); True when it is in place."""
    if "installed" in _state:
        return bool(_state["installed"])
    try:  # SciPy is a dependency; without it Optuna's stays. Found, not imported: its import (0.13 s) waits
        # for the first ask (a validate builds the sampler and asks nothing)
        found = importlib.util.find_spec("scipy.special") is not None
        from optuna.samplers._tpe import _truncnorm
    except (ImportError, ValueError):
        found = False
    if not found:
        _state["installed"] = False
        return False
    ok = callable(getattr(_truncnorm, "_log_ndtr", None)) and callable(getattr(_truncnorm, "_log_ndtr_single", None))
    if ok:
        _state["original"] = _truncnorm._log_ndtr
        _truncnorm._log_ndtr = _log_ndtr
    _state["installed"] = ok
    return ok


def installed() -> bool:
    return bool(_state.get("installed"))
