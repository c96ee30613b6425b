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
