"""The README is executed: every code block marked ``<!-- runnable ... -->`` runs as copied (shell
blocks with bash, a line per test in order in one directory; Python blocks as a script) in a temporary
directory holding a copy of examples/, with HPOFLOW_N_TRIALS=2 so each study is a quick smoke run of
the real spec."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"<!-- runnable[^>]*-->\n```(bash|python)\n(.*?)```", re.S)
BLOCKS = BLOCK.findall((ROOT / "README.md").read_text())


def test_the_readme_marks_its_quick_start_and_api_blocks_runnable() -> None:
    assert [lang for lang, _ in BLOCKS] == ["bash", "python"]


# A shell block runs one line per test, in order, in one directory (``_block_dir``), so each test's time is
# one command's and a failure names its line. A block whose lines are not each a whole command, or that
# changes the shell's own state (cd, export, VAR=...), runs as one test instead.
_SHELL_STATE = re.compile(r"^\s*(cd|pushd|popd|export|unset|source|\.|set|alias|shopt|[A-Za-z_][A-Za-z0-9_]*=)(\s|$)")


def _commands(code: str) -> list[str] | None:
    lines = [ln for ln in code.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if any(ln.rstrip().endswith("\\") or _SHELL_STATE.match(ln) for ln in lines):
        return None
    if any(subprocess.run(["bash", "-n", "-c", ln], capture_output=True).returncode for ln in lines):
        return None
    return lines


def _steps() -> list[tuple[int, str, int, int, str]]:
    """(block, lang, line, lines in the block, code) of every test: a line of a shell block, or a block."""
    out = []
    for i, (lang, code) in enumerate(BLOCKS):
        lines = _commands(code) if lang == "bash" else None
        if lines is None:
            out.append((i, lang, 0, 1, code))
        else:
            out += [(i, lang, j, len(lines), ln) for j, ln in enumerate(lines)]
    return out


STEPS = _steps()


@pytest.fixture(scope="module")
def block_dirs() -> dict[int, tuple[Path, list[int]]]:
    """Block -> its directory and the lines run in it so far (filled by ``_block_dir``)."""
    return {}


def _block_dir(dirs: dict[int, tuple[Path, list[int]]], tmp_path_factory: pytest.TempPathFactory,
               block: int) -> tuple[Path, list[int]]:
    if block not in dirs:
        d = tmp_path_factory.mktemp(f"readme-block{block}")
        shutil.copytree(ROOT / "examples", d / "examples")
        dirs[block] = (d, [])
    return dirs[block]


@pytest.mark.slow
@pytest.mark.parametrize(("block", "lang", "line", "n_lines", "code"), STEPS,
                         ids=[f"{lang}-{b}" + (f"-line{j + 1}" if n > 1 else "") for b, lang, j, n, _ in STEPS])
def test_a_runnable_readme_block_works_as_copied(block_dirs: dict[int, tuple[Path, list[int]]],
                                                 tmp_path_factory: pytest.TempPathFactory, block: int, lang: str,
                                                 line: int, n_lines: int, code: str) -> None:
    tmp_path, done = _block_dir(block_dirs, tmp_path_factory, block)
    assert done == list(range(line)), f"the lines before line {line + 1} of block {block} did not all pass: {done}"
    env = {**os.environ, "HPOFLOW_N_TRIALS": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if lang == "bash":
        argv = ["bash", "-euo", "pipefail", "-c", code]
    else:
        (tmp_path / "tune.py").write_text(code)
        argv = [sys.executable, "tune.py"]
    r = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "Traceback" not in r.stderr
    done.append(line)
    if line == n_lines - 1:  # the block's last line: every study it ran has its journal
        runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
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
