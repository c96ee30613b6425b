"""Search spaces: suggest a configuration on an Optuna trial, and enumerate a grid.

Conditional parameters are suggested only when their condition holds (define-by-run), so Optuna's
samplers see the real, conditional space. ``Grid`` counts an exact grid and maps an index to its
point without building the grid (a grid of 10^9 points costs what a grid of 10 does);
``grid_points`` builds the whole list, in the same order (small grids, tests).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from functools import lru_cache
from typing import Any

import optuna

from hpoflow.spec import CategoricalParam, FloatParam, IntParam, Param

__all__ = ["Grid", "active", "grid_points", "suggest"]


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


class _FloatSteps(Sequence[float]):
    """The values ``_grid_values`` lists for a float parameter with ``step``, without the list."""

    def __init__(self, low: float, high: float, step: float) -> None:
        self.low, self.step = low, step
        last = round((high - low) / step)
        while last >= 0 and low + last * step > high + 1e-12:
            last -= 1
        self._n = last + 1

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(self._n))]
        if not 0 <= i < self._n:
            raise IndexError(i)
        return round(self.low + i * self.step, 12)

    def position(self, value: Any) -> int | None:
        """Where ``value`` is in the sequence (None: not in it)."""
        if isinstance(value, bool) or not isinstance(value, int | float) or value != value:
            return None
        guess = round((value - self.low) / self.step)
        for i in (guess - 1, guess, guess + 1):
            if 0 <= i < self._n and self[i] == value:
                return i
        return None


def _values(p: Param) -> Sequence[Any]:
    """A parameter's grid values, in ``_grid_values``' order, as a lazy sequence."""
    if isinstance(p, CategoricalParam):
        return list(p.choices)
    if isinstance(p, IntParam):
        return range(p.low, p.high + 1, p.step)
    if p.step is None:
        raise ValueError("a float parameter needs step to be enumerated")
    return _FloatSteps(p.low, p.high, p.step)


def _position(values: Sequence[Any], value: Any) -> list[int]:
    """The positions of ``value`` (by ``==``, as ``active`` compares) in a grid value sequence."""
    if isinstance(values, list):
        return [i for i, v in enumerate(values) if v == value]
    if isinstance(values, range):
        if isinstance(value, int | float) and value == value and value == int(value):
            as_int = int(value)
            return [values.index(as_int)] if as_int in values else []
        return []
    if isinstance(values, _FloatSteps):
        i = values.position(value)
        return [] if i is None else [i]
    return []


class Grid(Sequence[dict[str, Any]]):
    """The exact grid of a space, counted and indexed without being built.

    ``grid[i]`` is ``grid_points(space)[i]`` (the same points in the same order: the Cartesian product
    with the first parameter the most significant, a conditional parameter multiplying only the points
    where its condition holds). A point is found by mixed-radix arithmetic: at each parameter, the
    number of completions below each of its values is counted (memoised on the few facts later
    conditions ask about the values chosen so far), so ``size`` and ``grid[i]`` cost a few
    operations per parameter however many points the grid has. ``size`` may exceed ``sys.maxsize``
    (``len()`` then raises ``OverflowError``, as Python's ``range`` does).
    """

    def __init__(self, space: Mapping[str, Param]) -> None:
        self._names = list(space)
        self._params = [space[n] for n in self._names]
        self._seqs = [_values(p) for p in self._params]
        index = {n: i for i, n in enumerate(self._names)}
        # A condition pair (q, r, allowed): parameter q is active only if parameter r's value is in allowed.
        self._pairs: list[tuple[int, int, list[Any]]] = []
        self._never: set[int] = set()  # parameters whose condition names no earlier parameter: never active
        for q, p in enumerate(self._params):
            for parent, allowed in (p.when or {}).items():
                r = index.get(parent)
                if r is None or r >= q:
                    self._never.add(q)
                else:
                    self._pairs.append((q, r, list(allowed)))
        n = len(self._params)
        self._pending = [[k for k, (q, r, _) in enumerate(self._pairs) if r < j <= q] for j in range(n + 1)]
        self._segments = [self._segments_of(j) for j in range(n)]
        self._count = lru_cache(maxsize=None)(self._count_uncached)
        self.size = self._count(0, ())

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (self.point(i) for i in range(self.size))

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self.point(i) for i in range(*index.indices(self.size))]
        return self.point(index)

    def point(self, index: int) -> dict[str, Any]:
        """The grid's point number ``index`` (0-based)."""
        if not 0 <= index < self.size:
            raise IndexError(f"grid index {index} is outside 0..{self.size - 1}")
        point: dict[str, Any] = {}
        state: tuple[bool, ...] = ()
        for j, name in enumerate(self._names):
            if not self._active(j, state):
                state = self._next(j, state, None)
                continue
            for start, length, sig in self._segments[j]:
                nxt = self._next(j, state, sig)
                per = self._count(j + 1, nxt)
                if index < length * per:
                    point[name] = self._seqs[j][start + index // per]
                    index %= per
                    state = nxt
                    break
                index -= length * per
        return point

    # -- internals: a state is, for each condition pair pending at a parameter, whether it holds --
    def _active(self, j: int, state: tuple[bool, ...]) -> bool:
        if j in self._never:
            return False
        flags = dict(zip(self._pending[j], state, strict=True))
        return all(flags[k] for k, (q, _, _) in enumerate(self._pairs) if q == j)

    def _next(self, j: int, state: tuple[bool, ...], sig: tuple[bool, ...] | None) -> tuple[bool, ...]:
        """The state after parameter ``j`` took a value of signature ``sig`` (None: inactive)."""
        flags = dict(zip(self._pending[j], state, strict=True))
        own = [k for k, (_, r, _) in enumerate(self._pairs) if r == j]
        flags.update(zip(own, sig if sig is not None else (False,) * len(own), strict=True))
        return tuple(flags[k] for k in self._pending[j + 1])

    def _segments_of(self, j: int) -> list[tuple[int, int, tuple[bool, ...]]]:
        """Parameter ``j``'s values as runs (start, length, signature): the signature says which
        conditions of later parameters a value satisfies; values outside every condition share one."""
        seq = self._seqs[j]
        own = [allowed for (_, r, allowed) in self._pairs if r == j]
        if not own:
            return [(0, len(seq), ())]
        special = sorted({i for allowed in own for a in allowed for i in _position(seq, a)})
        none = (False,) * len(own)
        out: list[tuple[int, int, tuple[bool, ...]]] = []
        at = 0
        for i in special:
            if i > at:
                out.append((at, i - at, none))
            value = seq[i]
            out.append((i, 1, tuple(value in allowed for allowed in own)))
            at = i + 1
        if at < len(seq):
            out.append((at, len(seq) - at, none))
        return out

    def _count_uncached(self, j: int, state: tuple[bool, ...]) -> int:
        """Points below parameter ``j`` reached with ``state``."""
        if j == len(self._params):
            return 1
        if not self._active(j, state):
            return self._count(j + 1, self._next(j, state, None))
        return sum(length * self._count(j + 1, self._next(j, state, sig)) for _, length, sig in self._segments[j])
