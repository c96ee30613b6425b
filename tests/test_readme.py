"""The README is executed: every code block marked ``<!-- runnable ... -->`` runs as copied (shell
blocks with bash, Python blocks as a script) in a temporary directory holding a copy of examples/,
with HPOFLOW_N_TRIALS=2 so each study is a quick smoke run of the real spec."""

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


@pytest.mark.slow
@pytest.mark.parametrize(("lang", "code"), BLOCKS, ids=[f"{lang}-{i}" for i, (lang, _) in enumerate(BLOCKS)])
def test_a_runnable_readme_block_works_as_copied(tmp_path: Path, lang: str, code: str) -> None:
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
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
