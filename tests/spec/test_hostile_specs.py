"""Hostile and odd inputs end in one line and exit 2 through the real CLI (`hpoflow validate` and
`hpoflow run`), never a traceback, and nothing is written: deep nesting, a NUL byte, a file that is
not UTF-8, endless or huge files, a list of 10^5 choices, a run directory that is a symlink loop, and
names with control characters."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from hpoflow.errors import SpecError
from hpoflow.spec import _yaml, load_spec, spec_from_mapping
from hpoflow.spec._yaml import MAX_ITEMS

ROOT = Path(__file__).resolve().parents[2]
BASE = {"study": {"name": "odd", "metric": "score", "direction": "maximize"},
        "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
        "search": {"algorithm": "random", "n_trials": 2},
        "training": {"function": "tests.trainfns:behave"}, "oracle": {"enabled": False}}


def _hpoflow(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hpoflow", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout, env=env)


def _one_line_exit_2(p: subprocess.CompletedProcess[str], *words: str) -> str:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) <= 2 and lines[0].startswith("hpoflow: error:"), p.stderr  # the head, then one issue
    for w in words:
        assert w in p.stderr, p.stderr
    assert all(len(ln) < 600 for ln in lines), p.stderr
    return p.stderr


def _text(**changes: Any) -> str:
    data = {**BASE, **changes}
    return yaml.safe_dump(data, sort_keys=False)


HOSTILE_TEXTS: list[tuple[str, bytes, str]] = [
    ("deep flow lists", b"deep: " + b"[" * 100_000 + b"]" * 100_000 + b"\n", "nests more than 32 levels"),
    ("deep block mappings", "".join(f"{'  ' * i}k{i}:\n" for i in range(200)).encode() + b"  " * 200 + b"v\n",
     "nests more than 32 levels"),
    ("deep through aliases", b"a: &a " + b"[" * 20 + b"1" + b"]" * 20 + b"\nb: " + b"[" * 20 + b"*a" + b"]" * 20
     + b"\n",
     "nests more than 32 levels"),
    ("a NUL byte", _text().replace("odd", "o\0dd").encode(), "control character U+0000"),
    ("an ESC byte", _text().replace("odd", "o\x1b[2Jdd").encode(), "control character U+001B"),
    ("not UTF-8", _text().replace("odd", "caf\u00e9").encode("latin-1"), "is not UTF-8"),
    ("10^5 choices", yaml.dump({**BASE, "space": {"c": {"type": "categorical", "choices": list(range(100_000))}}},
                               Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper),  # (libyaml's: the same text,
                               default_flow_style=None).encode(), "at most 10000 choices"),  # 3x faster, at import)
    ("a billion laughs", b"a: &a [x, x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
     b"c: &c [*b, *b, *b, *b, *b, *b, *b, *b, *b, *b]\nd: &d [*c, *c, *c, *c, *c, *c, *c, *c, *c, *c]\n"
     b"e: [*d, *d, *d, *d, *d, *d, *d, *d, *d, *d]\n",
     "YAML aliases repeat"),
]


@pytest.mark.parametrize(("name", "data", "words"), HOSTILE_TEXTS, ids=[c[0] for c in HOSTILE_TEXTS])
def test_hostile_specs_are_one_line_and_exit_2_in_validate_and_run(tmp_path: Path, name: str, data: bytes,
                                                                    words: str) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_bytes(data)
    _one_line_exit_2(_hpoflow("validate", str(spec), cwd=tmp_path), words, str(spec))
    _one_line_exit_2(_hpoflow("run", str(spec), "--run-dir", str(tmp_path / "run"), cwd=tmp_path), words)
    assert not (tmp_path / "run").exists()  # refused before anything was written


class _LibyamlNestingLimit(yaml.SafeLoader):
    """PyYAML's pure-Python loader with the limit libyaml has since PyYAML 6.0.4 (its wheels' libyaml):
    flow collections nested past 1000 levels are refused while scanning, with libyaml's error. Its
    scanner looks ahead up to 1024 characters on a line, as libyaml's does, so a deep flow list is
    refused before a single level of it reaches the event stream: what the C loader does there."""

    def fetch_flow_collection_start(self, TokenClass: Any) -> None:  # (PyYAML's argument name)
        if self.flow_level >= 1000:
            mark = self.get_mark()
            raise yaml.scanner.ScannerError("while increasing flow level", mark, "exceeded maximum nesting depth",
                                            mark)
        super().fetch_flow_collection_start(TokenClass)


LOADERS = [yaml.SafeLoader, _LibyamlNestingLimit, *([yaml.CSafeLoader] if hasattr(yaml, "CSafeLoader") else [])]


TEXTS = [c for c in HOSTILE_TEXTS if c[0] != "not UTF-8"]  # (that one is the file reader's, before YAML)


@pytest.mark.parametrize("loader", LOADERS, ids=[c.__name__ for c in LOADERS])
@pytest.mark.parametrize(("name", "data", "words"), TEXTS, ids=[c[0] for c in TEXTS])
def test_hostile_specs_say_the_same_whichever_loader_pyyaml_uses(monkeypatch: pytest.MonkeyPatch, name: str,
                                                                  data: bytes, words: str, loader: type) -> None:
    """The C loader of PyYAML 6.0.4 refused the deep flow list with its own "exceeded maximum nesting
    depth" before hpoflow's depth check saw it: the message must not depend on the loader."""
    text = data.decode()
    monkeypatch.setattr(_yaml, "_Loader", yaml.SafeLoader)
    with pytest.raises(SpecError) as reference:
        spec_from_text(text)
    monkeypatch.setattr(_yaml, "_Loader", loader)
    with pytest.raises(SpecError) as caught:
        spec_from_text(text)
    assert str(caught.value) == str(reference.value)
    assert words in str(caught.value)


def spec_from_text(text: str) -> Any:
    data, _ = _yaml.load_yaml_with_lines(text, "spec.yaml")
    return spec_from_mapping(data)


def test_endless_and_huge_files_are_read_only_up_to_the_bound(tmp_path: Path) -> None:
    """/dev/zero, a pipe that never ends and a sparse 10 GB file: at most MAX_BYTES + 1 bytes are read."""
    _one_line_exit_2(_hpoflow("validate", "/dev/zero", cwd=tmp_path), "more than 1000000 bytes")
    huge = tmp_path / "huge.yaml"
    with huge.open("wb") as f:
        f.truncate(10 * 2**30)
    _one_line_exit_2(_hpoflow("validate", str(huge), cwd=tmp_path), "more than 1000000 bytes")
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    stop = threading.Event()

    def feed() -> None:  # writes until the reader goes away
        try:
            with fifo.open("wb") as w:
                while not stop.is_set():
                    w.write(b"a: b\n" * 1000)
        except (BrokenPipeError, OSError):
            pass

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        _one_line_exit_2(_hpoflow("validate", str(fifo), cwd=tmp_path), "more than 1000000 bytes")
    finally:
        stop.set()
        writer.join(timeout=30)
    # a spec from a pipe within the bound is read as usual (process substitution: hpoflow validate <(...))
    r, w = os.pipe()
    os.write(w, _text().encode())
    os.close(w)
    p = subprocess.run([sys.executable, "-m", "hpoflow", "validate", f"/dev/fd/{r}"], capture_output=True,
                       text=True, cwd=ROOT, timeout=120, pass_fds=(r,))
    os.close(r)
    assert p.returncode == 0, p.stderr


def test_a_run_dir_that_is_a_symlink_loop_is_one_line(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(_text())
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    for args in (["run", str(spec), "--run-dir", str(tmp_path / "a")],
                 ["run", str(spec), "--run-dir", str(tmp_path / "a" / "sub")],
                 ["status", str(tmp_path / "a")], ["report", str(tmp_path / "a")]):
        _one_line_exit_2(_hpoflow(*args, cwd=ROOT), "symlink loop")


def test_choices_are_bounded_and_checked_in_linear_time() -> None:
    """The same bound through the Python API; 10,000 distinct choices (the most allowed) load at once:
    the check for duplicates is a set, not a scan of a list per choice."""
    many = {**BASE, "space": {"c": {"type": "categorical", "choices": list(range(100_000))}}}
    with pytest.raises(SpecError, match=r"space\.c\.choices: a categorical parameter holds at most 10000 choices, "
                                        r"but got 100000\. Fix: search a range instead"):
        spec_from_mapping(many)
    most = {**BASE, "space": {"c": {"type": "categorical", "choices": [f"v{i}" for i in range(MAX_ITEMS)]}}}
    assert len(spec_from_mapping(most).space["c"].choices) == MAX_ITEMS  # type: ignore[union-attr]
    mixed = {**BASE, "space": {"c": {"type": "categorical", "choices": [1, 1.0, True, "1", None]}}}
    assert len(spec_from_mapping(mixed).space["c"].choices) == 5  # type: ignore[union-attr]
    with pytest.raises(SpecError, match="choices must be distinct, but 2 appears twice"):
        spec_from_mapping({**BASE, "space": {"c": {"type": "categorical", "choices": [1, 2, 3, 2]}}})


def test_a_long_list_elsewhere_has_its_own_message(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(_text(plugins=[f"m{i}" for i in range(MAX_ITEMS + 1)]))
    with pytest.raises(SpecError, match=r"plugins: a list holds at most 10000 items"):
        load_spec(spec)


@pytest.mark.parametrize(("where", "change"), [
    ("space.a\\u202eb", {"space": {"a\u202eb": {"type": "float", "low": 0.0, "high": 1.0}}}),
    ("space.x\\x00", {"space": {"x\0": {"type": "float", "low": 0.0, "high": 1.0}}}),
    ("study.metric", {"study": {"name": "odd", "metric": "score\x1b[31m", "direction": "maximize"}}),
    ("study.metrics.1.name", {"study": {"name": "odd", "metrics": [{"name": "score", "direction": "maximize"},
                                                                  {"name": "size\n", "direction": "minimize"}]}}),
    ("space.c.choices.1", {"space": {"c": {"type": "categorical", "choices": ["a", "b\u202e"]}}}),
])
def test_names_with_control_characters_are_refused_escaped(tmp_path: Path, where: str,
                                                           change: dict[str, Any]) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump({**BASE, **change}, sort_keys=False))  # escapes them in double quotes
    err = _one_line_exit_2(_hpoflow("validate", str(spec), cwd=ROOT), f"{where}:", "must be printable")
    assert all(c.isprintable() for c in err.replace("\n", "")), repr(err)  # shown escaped, never raw


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1_0", "-1", "0", "2 3", "x"])
def test_hpoflow_n_trials_is_parsed_strictly(tmp_path: Path, value: str) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(_text())
    env = {**os.environ, "HPOFLOW_N_TRIALS": value, "PYTHONPATH": str(ROOT)}
    for cmd in (["validate", str(spec)], ["run", str(spec), "--run-dir", str(tmp_path / "run")]):
        p = subprocess.run([sys.executable, "-m", "hpoflow", *cmd], capture_output=True, text=True, cwd=ROOT,
                           timeout=120, env=env)
        _one_line_exit_2(p, "HPOFLOW_N_TRIALS must be a whole number >= 1")
    assert not (tmp_path / "run").exists()


def test_input_the_run_refuses_starts_no_engine_process(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``hpoflow run`` boots the local engine's processes (the forkserver's torch preload, light workers)
    before it opens the study; a bad ``HPOFLOW_N_TRIALS`` or a ``--run-dir`` that cannot be resolved
    starts none of them (the run then refuses it, as the test above shows), nor does a ``--run-dir`` that
    is a file (refused as "a file, not a directory"), and a good one does."""
    import hpoflow.engines.local as local
    from hpoflow.cli import run_cmd

    started: list[str] = []
    monkeypatch.setattr(local, "prestart_for", lambda spec, python_path=(): started.append(spec.study.name))
    spec = tmp_path / "spec.yaml"
    spec.write_text(_text())
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    monkeypatch.setenv("HPOFLOW_N_TRIALS", "x")
    run_cmd._prestart(str(spec), str(tmp_path / "run"))
    monkeypatch.setenv("HPOFLOW_N_TRIALS", "2")
    run_cmd._prestart(str(spec), str(tmp_path / "a" / "sub"))
    (tmp_path / "a-file").write_text("x")
    run_cmd._prestart(str(spec), str(tmp_path / "a-file"))
    assert started == []
    run_cmd._prestart(str(spec), str(tmp_path / "run"))
    assert len(started) == 1 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("value", ["\u00b2", "\u0663", "1_0"])
def test_cli_whole_numbers_are_ascii_digits(tmp_path: Path, value: str) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(_text())
    p = _hpoflow("run", str(spec), "--n-trials", value, "--run-dir", str(tmp_path / "run"), cwd=ROOT)
    assert p.returncode == 2 and "Traceback" not in p.stderr and "expected a whole number" in p.stderr, p.stderr
    assert not (tmp_path / "run").exists()


def test_a_spec_built_in_python_may_not_nest_without_bound_nor_contain_itself() -> None:
    deep: dict[str, Any] = {}
    cur = deep
    for _ in range(5000):
        cur["a"] = {}
        cur = cur["a"]
    looped: dict[str, Any] = {}
    looped["again"] = looped
    for options in (deep, looped):
        spec = {**BASE, "training": {"function": "tests.trainfns:behave", "options": options}}
        with pytest.raises(SpecError, match=r"training\.options: the spec nests more than 32 levels deep"):
            spec_from_mapping(spec)
