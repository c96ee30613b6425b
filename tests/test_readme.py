"""The README is executed: every code block marked ``<!-- runnable ... -->`` runs as copied (shell
blocks with bash, a line at a time in order in one directory; Python blocks as a script), a block per
test, in a temporary directory holding a copy of examples/, with HPOFLOW_N_TRIALS=2 so each study is a
quick smoke run of the real spec."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import pythonpath

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- runnable[^>]*-->\n```(bash|python)\n(.*?)```", re.S)
BLOCKS = BLOCK.findall((ROOT / "README.md").read_text())


def test_the_readme_marks_its_quick_start_and_api_blocks_runnable() -> None:
    assert [lang for lang, _ in BLOCKS] == ["bash", "python"]


# A shell block whose lines are each a whole command runs them one at a time, in order, in one directory, and
# a failure names its line and command. A block whose lines are not each a whole command, or that changes
# the shell's own state (cd, export, VAR=...), runs as one script. Either way a block is one test: its
# lines depend on each other (a run, then its status and report), so no test runner may split them (pytest-
# xdist hands out tests, not lines), and blocks run in parallel with each other and with the suite.
_SHELL_STATE = re.compile(r"^\s*(cd|pushd|popd|export|unset|source|\.|set|alias|shopt|[A-Za-z_][A-Za-z0-9_]*=)(\s|$)")


def _commands(code: str) -> list[str] | None:
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if any(ln.rstrip().endswith("\\") or _SHELL_STATE.match(ln) for ln in lines):
        return None
    if any(subprocess.run(["bash", "-n", "-c", ln], capture_output=True).returncode for ln in lines):
        return None
    return lines


def _steps(lang: str, code: str) -> list[tuple[list[str], str]]:
    """What a block runs, in order: (argv, what a failure names) per command of a shell block, else the
    block as one script."""
    if lang == "python":
        return [([sys.executable, "tune.py"], "the script")]
    lines = _commands(code)
    if lines is None:
        return [(["bash", "-euo", "pipefail", "-c", code], "the script")]
    return [(["bash", "-euo", "pipefail", "-c", ln], f"line {j + 1} ({ln.split('#')[0].strip()})")
            for j, ln in enumerate(lines)]


def test_each_command_of_a_shell_block_is_one_step_of_its_test() -> None:
    """The quick start's shell block runs a command at a time (a failure names it), all in one test."""
    steps = _steps(*BLOCKS[0])
    assert len(steps) == len(_commands(BLOCKS[0][1]) or []) > 1
    assert steps[0][1].startswith("line 1 (hpoflow validate")
    assert _steps("bash", "cd x\nls\n") == [(["bash", "-euo", "pipefail", "-c", "cd x\nls\n"], "the script")]


@pytest.mark.slow
@pytest.mark.timeout(900)  # a block runs several studies (the suite's 300 s is one command's)
@pytest.mark.parametrize(("block", "lang", "code"), [(i, lang, code) for i, (lang, code) in enumerate(BLOCKS)],
                         ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(BLOCKS)])
def test_a_runnable_readme_block_works_as_copied(tmp_path: Path, block: int, lang: str, code: str) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "HPOFLOW_N_TRIALS": "2", "PYTHONPATH": pythonpath(ROOT)}
    if lang == "python":
        (tmp_path / "tune.py").write_text(code)
    for argv, what in _steps(lang, code):
        r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        where = f"block {block}: {what}"
        assert r.returncode == 0, f"{where} failed:\nstdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
        assert "Traceback" not in r.stderr, f"{where}: {r.stderr[-3000:]}"
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())  # every study the block ran has its journal
    assert runs and all((tmp_path / "runs" / name / "study.journal").is_file() for name in runs), runs


def _requirement_names(lines: list[str]) -> set[str]:
    """The distribution names in PEP 508 requirement strings (lower case, ``-`` for ``_``)."""
    return {re.split(r"[\s<>=!~;\[]", line.strip(), maxsplit=1)[0].lower().replace("_", "-") for line in lines}


def test_requirements_txt_installs_what_the_quick_start_runs() -> None:
    """The README's quick start installs with ``pip install -r requirements.txt`` and then runs
    ``hpoflow report``, which draws with plotly (the ``report`` extra): the file must install it, or a
    fresh clone's first report fails with "needs plotly"."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras: set[str] = set()
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        m = re.fullmatch(r"-e\s+\.(?:\[([\w,\s-]+)\])?", line.strip())
        if m:
            extras |= {e.strip() for e in (m.group(1) or "").split(",") if e.strip()}
    installed = _requirement_names(project["dependencies"])
    for extra in extras:
        installed |= _requirement_names(project["optional-dependencies"][extra])
    quick_start = BLOCKS[0][1]
    assert "hpoflow report" in quick_start
    assert _requirement_names(project["optional-dependencies"]["report"]) <= installed, (extras, installed)
