"""``training.command`` in a spec: an argv or one line split with shlex, ``${param}`` placeholders whole or
inside an argument, an inactive parameter's argument left out, and each mistake one line naming the
YAML key (``hpoflow validate``: exit 2, no traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hpoflow.errors import SpecError
from hpoflow.spec import UNBOUNDED_EPOCHS, resolve_training, spec_from_mapping
from tests.conftest import ROOT

SPACE = {"lr": {"type": "float", "low": 1e-3, "high": 1e-1, "log": True},
         "opt": {"type": "categorical", "choices": ["sgd", "adam"]},
         "momentum": {"type": "float", "low": 0.1, "high": 0.9, "when": {"opt": "sgd"}}}


def spec(training: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {"study": {"name": "cmd", "metric": "val_loss", "direction": "minimize"}, "space": SPACE,
            "search": {"algorithm": "random", "n_trials": 2}, "training": training, **top}


def problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        spec_from_mapping(data)
    return [f"{i.path}: {i.message}" for i in err.value.issues]


def test_placeholders_are_replaced_whole_or_inside_an_argument_and_an_inactive_ones_argument_goes() -> None:
    s = spec_from_mapping(spec({"command": ["python", "tests/commandprog.py", "--x", "${lr}", "--momentum",
                                            "${momentum}", "opt=${opt}"]}))
    adam = resolve_training(s.training, {"lr": 0.01, "opt": "adam"})
    assert adam.command == ["python", "tests/commandprog.py", "--x", "0.01", "opt=adam"]  # --momentum went with it
    sgd = resolve_training(s.training, {"lr": 0.01, "opt": "sgd", "momentum": 0.5})
    assert sgd.command == ["python", "tests/commandprog.py", "--x", "0.01", "--momentum", "0.5", "opt=sgd"]
    assert sgd.epochs == UNBOUNDED_EPOCHS  # no training.epochs: the program ends itself
    line = spec_from_mapping(spec({"command": "python tests/commandprog.py --x=${lr} --note 'a b;c'"}))
    # split like a shell splits a line, never run by one: a value is one argument whatever it holds
    assert resolve_training(line.training, {"lr": 0.02, "opt": "adam"}).command == \
        ["python", "tests/commandprog.py", "--x=0.02", "--note", "a b;c"]


def test_only_an_option_name_written_in_the_command_goes_with_an_inactive_parameters_argument() -> None:
    # "${flag}" is an active parameter whose value starts with "-": it is the program's argument, not the
    # option of the inactive "${momentum}" after it (the program lost --amp); "--", "-" and a negative
    # number written before an inactive placeholder are no option names either
    space = {**SPACE, "flag": {"type": "categorical", "choices": ["--amp", "--no-amp"]}}
    data = spec({"command": ["python", "tests/commandprog.py", "${flag}", "${momentum}", "--", "${momentum}",
                             "--offset", "-1", "${momentum}", "-", "${momentum}", "--m", "${momentum}"]})
    data["space"] = space
    s = spec_from_mapping(data)
    adam = resolve_training(s.training, {"lr": 0.01, "opt": "adam", "flag": "--amp"})
    assert adam.command == ["python", "tests/commandprog.py", "--amp", "--", "--offset", "-1", "-"]
    sgd = resolve_training(s.training, {"lr": 0.01, "opt": "sgd", "flag": "--no-amp", "momentum": 0.5})
    assert sgd.command == ["python", "tests/commandprog.py", "--no-amp", "0.5", "--", "0.5", "--offset", "-1",
                           "0.5", "-", "0.5", "--m", "0.5"]


@pytest.mark.parametrize(("training", "top", "path", "words"), [
    ({"command": ["python", "tests/commandprog.py", "--x", "${lrr}"]}, {}, "training.command.3",
     "${lrr} refers to no search parameter (did you mean 'lr'?)"),
    ({"command": "python tests/commandprog.py --x=${rate}"}, {}, "training.command", "${rate} refers to no search"),
    ({"command": ["no-such-program-here", "x"]}, {}, "training.command.0", "is not on PATH"),
    ({"command": ["python", "tests/no_such_script.py"]}, {}, "training.command.1", "is not a file"),
    ({"command": ["./tests/no_such_program"]}, {}, "training.command.0", "is not a file"),
    ({"command": ["python", "tests/commandprog.py"], "function": "trainfns:train"}, {}, "training.command",
     "give either function"),
    ({"command": "python 'tests/commandprog.py"}, {}, "training.command", "No closing quotation"),
    ({"command": []}, {}, "training.command", "the command is empty"),
    ({"command": ["python", "tests/commandprog.py"]},
     {"search": {"algorithm": "random", "n_trials": 2, "scheduler": {"type": "asha"}}}, "training.command",
     "Fix: set training.epochs"),
    ({"command": ["python", "tests/commandprog.py"]}, {"resources": {"processes": {"min": 1, "max": 2}}},
     "resources.processes", "keeps the ranks its program started with"),
])
def test_each_mistake_names_its_key(training: dict[str, Any], top: dict[str, Any], path: str, words: str) -> None:
    found = problems(spec(training, **top))
    assert any(p.startswith(f"{path}: ") and words in p for p in found), found


def test_validate_says_it_in_one_line_with_exit_code_2(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("study: {name: c, metric: val_loss, direction: minimize}\n"
                 "space: {lr: {type: float, low: 0.001, high: 0.1}}\n"
                 "search: {algorithm: random, n_trials: 2}\n"
                 "training:\n"
                 "  command: [python, tests/commandprog.py, --x, '${rate}']\n")
    r = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(f)], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert f"{f}:5: training.command.3: ${{rate}} refers to no search parameter" in r.stderr, r.stderr
