""".ci/run, run with fake tools on PATH (a ``python`` that records each call and makes a venv of fakes, an ``id``
that is no root, so nothing is installed with apt-get): it makes a venv afresh, outside the clone, and
installs, lints, type-checks and runs the README's test command with that venv's tools only, so CI passes
only on what requirements-dev.txt installs."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import ROOT

FAKE = """#!/usr/bin/env bash
echo "$0 $* PYTHONPATH=${PYTHONPATH-unset}" >> "$CI_LOG"
if [ "$1 $2" = "-m venv" ]; then
  mkdir -p "$3/bin"
  for tool in python lint-imports; do cp "$CI_FAKE" "$3/bin/$tool"; done
fi
"""


def test_ci_runs_everything_in_a_fresh_venv_of_its_own(tmp_path: Path) -> None:
    fakes = tmp_path / "fakes"
    fakes.mkdir()
    (fakes / "python").write_text(FAKE)
    (fakes / "id").write_text("#!/bin/sh\necho 1000\n")  # no root: the apt-get part is left out
    for f in fakes.iterdir():
        f.chmod(0o755)
    cache, log = tmp_path / "cache", tmp_path / "calls.log"
    env = {**os.environ, "PATH": f"{fakes}{os.pathsep}{os.environ['PATH']}", "XDG_CACHE_HOME": str(cache),
           "CI_LOG": str(log), "CI_FAKE": str(fakes / "python"), "PYTHONPATH": str(tmp_path / "elsewhere")}
    r = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    calls = [line.split(" PYTHONPATH=") for line in log.read_text().splitlines()]
    first, *rest = calls
    made = first[0].split()
    assert made[:3] == [str(fakes / "python"), "-m", "venv"], first
    venv = Path(made[3])
    assert venv.is_relative_to(cache) and not venv.is_relative_to(ROOT), venv  # outside the clone
    assert [c[0].strip() for c in rest] == [
        f"{venv}/bin/python -m pip install -q -r requirements-dev.txt",
        f"{venv}/bin/python -m ruff check hpoflow workflows tests bench",
        f"{venv}/bin/python -m mypy --cache-dir {cache}/hpoflow-ci/mypy",
        f"{venv}/bin/lint-imports",
        f"{venv}/bin/python -m pytest -q",
    ]
    assert all(c[1] == "unset" for c in calls), calls  # the caller's PYTHONPATH reaches none of them
    # a second run removes the venv the first left and makes it again
    (venv / "leftover").write_text("")
    log.unlink()
    r = subprocess.run(["bash", str(ROOT / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    assert not (venv / "leftover").exists()
    assert log.read_text().splitlines()[0].split()[3] == str(venv)
