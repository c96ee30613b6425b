"""The lazy grid: the same points in the same order as building the whole product, at any size."""

from __future__ import annotations

import random
from typing import Any

import pytest

from hpoflow.errors import SpecError
from hpoflow.search.space import Grid, grid_points
from hpoflow.spec import spec_from_mapping

BASE: dict[str, Any] = {"study": {"name": "g", "metric": "m", "direction": "maximize"},
                        "search": {"algorithm": "grid"}, "training": {"function": "os.path:join"}}


def random_space(rng: random.Random) -> dict[str, Any]:
    space: dict[str, Any] = {}
    for i in range(rng.randint(1, 5)):
        kind = rng.choice(["categorical", "int", "float"])
        if kind == "categorical":
            p: dict[str, Any] = {"type": kind, "choices": rng.sample(["a", "b", 1, 2, 3.5, True], rng.randint(1, 4))}
        elif kind == "int":
            low = rng.randint(-3, 3)
            p = {"type": kind, "low": low, "high": low + rng.randint(0, 6), "step": rng.randint(1, 3)}
        else:
            p = {"type": kind, "low": 0.0, "high": rng.choice([1.0, 0.9, 1.05]), "step": rng.choice([0.1, 0.25, 0.3])}
        if space and rng.random() < 0.6:  # conditional on an earlier parameter
            parent = rng.choice(list(space))
            q = space[parent]
            if q["type"] == "categorical":
                values = q["choices"]
            elif q["type"] == "int":
                values = list(range(q["low"], q["high"] + 1, q["step"]))
            else:
                values = [0.0, 0.2, 0.25, 0.3, 0.6]
            p["when"] = {parent: rng.sample(values, min(len(values), rng.randint(1, 2)))}
        space[f"p{i}"] = p
    return space


def test_the_lazy_grid_matches_the_built_one_on_random_conditional_spaces() -> None:
    rng = random.Random(0)
    checked = 0
    for _ in range(300):
        try:
            spec = spec_from_mapping({**BASE, "space": random_space(rng)})
        except SpecError:
            continue  # e.g. a condition the spec refuses
        points = grid_points(spec.space)
        grid = Grid(spec.space)
        assert grid.size == len(points)
        assert list(grid) == points
        checked += 1
    assert checked > 150


def test_a_billion_points_are_counted_and_indexed_at_once() -> None:
    spec = spec_from_mapping({**BASE, "space": {f"p{i}": {"type": "int", "low": 0, "high": 9} for i in range(9)}})
    grid = Grid(spec.space)
    assert grid.size == 10**9
    assert grid[123456789] == {f"p{i}": (i + 1) % 10 for i in range(9)}
    assert grid[grid.size - 1] == {f"p{i}": 9 for i in range(9)}
    with pytest.raises(IndexError):
        grid.point(grid.size)


def test_sizes_beyond_an_index_and_conditions_on_huge_ranges() -> None:
    space = {"a": {"type": "int", "low": 0, "high": 10**12},
             "b": {"type": "categorical", "choices": [1, 2]},
             "c": {"type": "float", "low": 0.0, "high": 1.0, "step": 1e-9, "when": {"b": [2]}},
             "d": {"type": "int", "low": 0, "high": 3, "when": {"a": [5, 7]}}}
    grid = Grid(spec_from_mapping({**BASE, "space": space}).space)
    per_a = 1 + (10**9 + 1)  # b=1 (no c) or b=2 with every c
    assert grid.size == (10**12 + 1 - 2) * per_a + 2 * per_a * 4
    assert grid[0] == {"a": 0, "b": 1}
    assert grid[5 * per_a] == {"a": 5, "b": 1, "d": 0}  # a=5 makes d active: four points per (b, c)
    assert grid[grid.size - 1] == {"a": 10**12, "b": 2, "c": 1.0}
