"""Property-based fuzzing of `hpoflow validate`: mutated versions of every example spec end in exit 0
or exit 2 with a one-line-per-problem message naming a key path or line, never a traceback, and each
within bounded time and memory (the bounds are generous: the point is that nothing explodes; memory is
the peak resident set the kernel counts over each case, or tracemalloc's peak where it cannot reset it)."""

from __future__ import annotations

import contextlib
import copy
import io
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hpoflow.cli.main import main

ROOT = Path(__file__).resolve().parents[1]
#: each example spec parsed once: a case's deep copy is the same data as parsing it again, at a fraction of the CPU
EXAMPLES = {p.name: yaml.safe_load(p.read_text()) for p in sorted((ROOT / "examples").glob("*.yaml"))}
NAMES = sorted(EXAMPLES)
CASES = 1000
MAX_SECONDS = 1.0
MAX_BYTES = 200 * 2**20

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.sampled_from(["${lr}", "${nope}", "tpe", "median", "easgd", "local", "compss", "1e400", "-1", "0"]),
)
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                       st.dictionaries(st.text(max_size=8), inner, max_size=4)),
                      max_leaves=8)

TEXT_ATTACKS = [
    "bomb: &a [x, x, x, x, x, x, x, x, x]\nb2: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    "b3: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b]\nb4: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
    "b5: [*d, *d, *d, *d, *d, *d, *d, *d, *d]\n",
    "x: !!python/object/apply:os.system ['true']\n",
    "deep: " + "[" * 60 + "]" * 60 + "\n",
    "deeper: " + "[" * 100_000 + "]" * 100_000 + "\n",  # once a RecursionError: depth is checked before composing
    "".join(f"{'  ' * i}k{i}:\n" for i in range(100)) + "  " * 100 + "v\n",
    "nul: a\x00b\n", "esc: \x1b[2J\n",  # once a ReaderError outside the try
    "long: [" + "1, " * 30_000 + "1]\n",
    "space: {c: {type: categorical, choices: [" + ", ".join(str(i) for i in range(12_000)) + "]}}\n",
    "\t- broken: [\n",
    "study: {name: 'a b', metric: m, direction: sideways}\n",
]

pytestmark = pytest.mark.slow  # 1,000 generated specs


def _paths(data: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(data, dict):
        for k, v in data.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out += _paths(v, (*prefix, i))
    return out


def _mutate(data: Any, draw: Any) -> Any:
    paths = _paths(data)
    for _ in range(draw(st.integers(min_value=1, max_value=3))):
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        parent = data
        for key in path[:-1]:
            parent = parent[key]
        last = path[-1]
        op = draw(st.sampled_from(["replace", "delete", "rename", "add"]))
        if op == "replace":
            parent[last] = draw(values)
        elif op == "delete" and isinstance(parent, dict):
            del parent[last]
        elif op == "rename" and isinstance(parent, dict):
            parent[str(last)[:-1] + draw(st.text(max_size=2))] = parent.pop(last)
        elif op == "add" and isinstance(parent, dict):
            parent[draw(st.text(min_size=1, max_size=10))] = draw(values)
        paths = _paths(data)
    return data


@st.composite
def spec_texts(draw: Any) -> str:
    base = copy.deepcopy(EXAMPLES[draw(st.sampled_from(NAMES))])
    if draw(st.integers(min_value=0, max_value=19)) == 0:
        return yaml.safe_dump(base, sort_keys=False) + draw(st.sampled_from(TEXT_ATTACKS))
    return yaml.safe_dump(_mutate(base, draw), sort_keys=False, allow_unicode=True)


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise KeyError(field)


def _rss_high_water_resets() -> bool:
    """Whether this kernel resets the peak resident set (VmHWM) on ``5 > /proc/self/clear_refs`` (Linux 4.0+)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kb("VmHWM") <= _status_kb("VmRSS") + 1024
    except (OSError, KeyError, ValueError):
        return False


_RSS_PEAK = _rss_high_water_resets()


@contextlib.contextmanager
def _peak_bytes() -> Iterator[list[int]]:
    """The most memory a case takes beyond what the process held before it. Where the kernel resets
    the peak resident set, that peak (VmHWM) less the resident set before the case: the kernel's count,
    which sees C allocations too (libyaml's, NumPy's). Elsewhere tracemalloc's peak of Python's
    allocations, which makes each case ~5x slower."""
    out = [0]
    if _RSS_PEAK:
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kb("VmRSS")
        try:
            yield out
        finally:
            out[0] = max(0, _status_kb("VmHWM") - before) * 1024
        return
    tracemalloc.start()
    try:
        yield out
    finally:
        out[0] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()


def _validate(path: Path) -> tuple[int, str, float, int]:
    err, out = io.StringIO(), io.StringIO()
    t0 = time.perf_counter()
    with _peak_bytes() as peak:
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                code = main(["validate", str(path)])
        finally:
            elapsed = time.perf_counter() - t0
    return code, err.getvalue(), elapsed, peak[0]


def test_mutated_specs_end_cleanly(tmp_path_factory: Any) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "spec.yaml"
    slow: list[float] = []

    @settings(max_examples=CASES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(spec_texts())
    def check(text: str) -> None:
        path.write_text(text)
        code, err, elapsed, peak = _validate(path)
        assert code in (0, 2), (code, err, text)
        assert "Traceback" not in err, (err, text)
        if code == 2:
            assert err.startswith("hpoflow: error: "), (err, text)
            body = [ln for ln in err.splitlines()[1:] if ln.strip()] or err.splitlines()
            assert all(str(path) in ln or ln.startswith("hpoflow: error:") for ln in body), (err, text)
        assert peak < MAX_BYTES, (peak, text)
        if elapsed > MAX_SECONDS:
            slow.append(elapsed)

    check()
    # a shared, loaded machine can stall any single case; a real blow-up is slow every time
    assert len(slow) <= CASES // 100, sorted(slow)[-5:]

