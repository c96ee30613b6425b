"""Search spaces: suggest a configuration on an Optuna trial, and enumerate a grid.

Conditional parameters are suggested only when their condition holds (define-by-run), so Optuna's
samplers see the real, conditional space.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import optuna

from hpoflow.spec import CategoricalParam, FloatParam, IntParam, Param

__all__ = ["active", "grid_points", "suggest"]


def active(param: Param, values: Mapping[str, Any]) -> bool:
    """Whether ``param``'s condition holds for the values chosen so far."""
    return all(values.get(parent, _UNSET) in allowed for parent, allowed in (param.when or {}).items())


_UNSET = object()


def suggest(trial: optuna.trial.BaseTrial, space: Mapping[str, Param]) -> dict[str, Any]:
    """Suggest every active parameter of ``space`` on ``trial``, in the spec's order."""
    values: dict[str, Any] = {}
    for name, p in space.items():
        if not active(p, values):
            continue
        if isinstance(p, FloatParam):
            values[name] = trial.suggest_float(name, p.low, p.high, log=p.log, step=p.step)
        elif isinstance(p, IntParam):
            values[name] = trial.suggest_int(name, p.low, p.high, log=p.log, step=p.step)
        else:
            values[name] = trial.suggest_categorical(name, p.choices)
    return values


def distribution(p: Param) -> optuna.distributions.BaseDistribution:
    """The Optuna distribution ``suggest`` draws ``p`` from."""
    if isinstance(p, FloatParam):
        return optuna.distributions.FloatDistribution(p.low, p.high, log=p.log, step=p.step)
    if isinstance(p, IntParam):
        return optuna.distributions.IntDistribution(p.low, p.high, log=p.log, step=p.step)
    return optuna.distributions.CategoricalDistribution(p.choices)


def _grid_values(p: Param) -> list[Any]:
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if isinstance(p, IntParam):
        return list(range(p.low, p.high + 1, p.step))
    step = p.step
    if step is None:  # the spec rejects this for grid; keep the function total
        raise ValueError("a float parameter needs step to be enumerated")
    n = round((p.high - p.low) / step)
    return [round(p.low + i * step, 12) for i in range(n + 1) if p.low + i * step <= p.high + 1e-12]


def grid_points(space: Mapping[str, Param]) -> list[dict[str, Any]]:
    """Every point of the Cartesian product, each exactly once, in a fixed order.

    A conditional parameter multiplies only the points where its condition holds; where it does not,
    the point simply lacks it (so no duplicate points differ only in an inactive value).
    """
    points: list[dict[str, Any]] = [{}]
    for name, p in space.items():
        values = _grid_values(p)
        nxt: list[dict[str, Any]] = []
        for point in points:
            if active(p, point):
                nxt.extend({**point, name: v} for v in values)
            else:
                nxt.append(point)
        points = nxt
    return points
