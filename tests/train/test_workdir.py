"""Each command trial runs in its own working directory (``training.workdir``, default ``${trial_dir}``):
files a program writes under fixed names are the trial's own, relative input paths of the command keep
meaning what they mean where hpoflow runs, ``${trial_dir}``/``${checkpoint_dir}`` stand for the trial's
directories; a failed program's error says its cause first."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.errors import SpecError
from hpoflow.spec import anchor_paths, run_values, spec_from_mapping
from hpoflow.spec._command import substitute_command
from hpoflow.trial import clip_error, error_cause
from tests.conftest import ROOT


def _spec(name: str, command: list[str], n: int = 2, **training: Any) -> dict[str, Any]:
    return {"study": {"name": name, "metric": "score", "direction": "maximize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": n, "max_concurrent": 2, "seed": 0},
            "training": {"command": command, **training}, "resources": {"processes": 1}}


def test_relative_paths_that_exist_are_anchored_and_outputs_are_not(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "train.py").write_text("")
    (tmp_path / "pkg").mkdir()
    argv = ["python", "train.py", "--data", "data", "--out", "model.pt", "--cfg=data", "-m", "pkg", "/abs", "-v"]
    assert anchor_paths(argv, str(tmp_path)) == [
        "python", str(tmp_path / "train.py"), "--data", str(tmp_path / "data"), "--out", "model.pt",
        f"--cfg={tmp_path / 'data'}", "-m", "pkg", "/abs", "-v"]
    assert anchor_paths(["./run.sh", "x"], str(tmp_path)) == ["./run.sh", "x"]  # not there: left as written
    (tmp_path / "train").mkdir()  # a subcommand named like a directory: a bare word after no option stays
    assert anchor_paths(["python", "main.py", "train", "--out", "train", "data/"], str(tmp_path)) == [
        "python", "main.py", "train", "--out", str(tmp_path / "train"), str(tmp_path / "data")]
    (tmp_path / "run.sh").write_text("")
    assert anchor_paths(["./run.sh", "data/"], str(tmp_path)) == [str(tmp_path / "run.sh"), str(tmp_path / "data")]


def test_run_placeholders_survive_the_parameters_and_are_replaced_where_the_trial_runs() -> None:
    argv = substitute_command(["python", "t.py", "--lr", "${lr}", "--save", "${trial_dir}/m.pt",
                               "--ckpt=${checkpoint_dir}"], {"lr": 0.1})
    assert argv == ["python", "t.py", "--lr", "0.1", "--save", "${trial_dir}/m.pt", "--ckpt=${checkpoint_dir}"]
    places = {"trial_dir": "/r/trials/3", "checkpoint_dir": "/r/trials/3/checkpoints"}
    assert [run_values(a, places) for a in argv][-2:] == ["/r/trials/3/m.pt", "--ckpt=/r/trials/3/checkpoints"]


def test_the_spec_accepts_run_placeholders_and_refuses_them_as_parameter_names(tmp_path: Path) -> None:
    (tmp_path / "t.py").write_text("print('score=1')\n")
    ok = _spec("ok", ["python", str(tmp_path / "t.py"), "--save", "${trial_dir}/m.pt"], workdir="${trial_dir}/w")
    spec_from_mapping(ok)
    bad = _spec("bad", ["python", str(tmp_path / "t.py")])
    bad["space"]["trial_dir"] = {"type": "float", "low": 0.0, "high": 1.0}
    with pytest.raises(SpecError) as e:
        spec_from_mapping(bad)
    assert "space.trial_dir" in str(e.value) and "not a parameter" in str(e.value)


@pytest.mark.slow
def test_two_concurrent_trials_keep_their_own_fixed_name_files(tmp_path: Path) -> None:
    # tests/fixedfiles.py writes model.pt and lightning_logs/version_N in its working directory; warm (python
    # SCRIPT) and isolated (python -m, found from the directory hpoflow runs in); --data names a file relative
    # to that directory, --save the trial's directory through its placeholder
    for isolate, command in ((False, ["python", "tests/fixedfiles.py"]), (True, ["python", "-m", "tests.fixedfiles"])):
        run = tmp_path / f"run-{isolate}"
        data = _spec(f"files-{isolate}", [*command, "--data", "tests/__init__.py", "--x", "${x}",
                                          "--save", "${trial_dir}/saved.json"], isolate=isolate)
        study = optimize(data, run).study
        assert [t.state for t in study.trials] == [TrialState.COMPLETE] * 2, [t.user_attrs.get("error")
                                                                              for t in study.trials]
        for t in study.trials:
            d = (run / "trials" / str(t.number)).absolute()
            model = json.loads((d / "model.pt").read_text())
            assert model["x"] == pytest.approx(t.params["x"]) and model["cwd"] == str(d)
            assert [p.name for p in (d / "lightning_logs").iterdir()] == ["version_0"]  # not version_1: its own
            assert json.loads((d / "lightning_logs" / "version_0" / "hparams.json").read_text())["x"] == model["x"]
            assert json.loads((d / "saved.json").read_text())["pid"] == model["pid"]
        assert not (ROOT / "model.pt").exists() and not (ROOT / "lightning_logs").exists()


@pytest.mark.slow
def test_workdir_dot_runs_where_hpoflow_runs_and_a_missing_input_says_why(tmp_path: Path) -> None:
    data = _spec("dot", ["python", "tests/fixedfiles.py", "--data", "no/such/file", "--save", "${trial_dir}/s.json"],
                 n=1)
    study = optimize(data, tmp_path / "run").study
    error = study.trials[0].user_attrs["error"]
    first = error.splitlines()[0]
    # the cause leads the first line (what the run's summary shows), with the working directory's hint
    assert "FileNotFoundError: [Errno 2] No such file or directory: 'no/such/file'" in first, error
    assert "training.workdir" in first
    data = _spec("dot2", ["python", os.path.relpath(ROOT / "tests" / "fixedfiles.py", tmp_path), "--data",
                          "f.txt", "--save", "s.json"], n=1, workdir=".")
    (tmp_path / "f.txt").write_text("in")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # (the directory hpoflow runs in)
    try:
        study = optimize(data, tmp_path / "run2").study
    finally:
        os.chdir(cwd)
    assert study.trials[0].state == TrialState.COMPLETE, study.trials[0].user_attrs.get("error")
    assert (tmp_path / "model.pt").exists() and (tmp_path / "s.json").exists()


def test_an_error_keeps_its_cause() -> None:
    trace = "\n".join(["Traceback (most recent call last):", *[f'  File "x.py", line {i}' for i in range(300)],
                       "OSError: [Errno 9] Bad file descriptor", "Exception ignored in: <function X.__del__>",
                       "noise"])
    assert error_cause(trace) == "OSError: [Errno 9] Bad file descriptor"
    assert error_cause("just one line\n\n") == "just one line" and error_cause("") == ""
    text = "rank 0: the program failed\n" + trace
    clipped = clip_error(text, 2000)
    assert len(clipped) <= 2000 and clipped.startswith("rank 0: the program failed\n...\n")
    assert "OSError: [Errno 9] Bad file descriptor" in clipped and clipped.endswith("noise")
    assert clip_error("short") == "short"


@pytest.mark.parametrize(("key", "value", "words"), [("isolate", True, "training.command is not set"),
                                                      ("workdir", ".", "training.command is not set")])
def test_command_only_keys_beside_a_function_are_refused(key: str, value: Any, words: str) -> None:
    data = _spec("fn", ["python", "x.py"])
    del data["training"]["command"]
    data["training"].update(function="trainfns:counter", **{key: value})
    with pytest.raises(SpecError) as e:
        spec_from_mapping(data)
    assert f"training.{key}: " in str(e.value) and words in str(e.value) and "Fix: remove" in str(e.value)
