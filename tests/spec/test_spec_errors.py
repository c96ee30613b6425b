"""Malformed specs: each gives a short error with the key path and line, and exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpoflow.errors import SpecError
from hpoflow.spec import in_memory_storage, load_spec

GOOD = """\
study:
  name: t
  metric: val_accuracy
  direction: maximize
space:
  lr: {type: float, low: 0.001, high: 0.1, log: true}
  opt: {type: categorical, choices: [adam, sgd]}
  momentum: {type: float, low: 0.1, high: 0.9, when: {opt: sgd}}
  width: {type: int, low: 16, high: 64, step: 16}
search:
  algorithm: tpe
  n_trials: 4
  max_concurrent: 1
training:
  model: mlp
  epochs: 2
  lr: ${lr}
  optimizer: ${opt}
  momentum: ${momentum}
  model_options: {hidden: "${width}"}
"""

# (name, old, new, expected path fragment, expected line, expected words)
CASES = [
    ("wrong type", "n_trials: 4", "n_trials: four", "search.n_trials", 12, "integer"),
    ("unknown key", "  epochs: 2", "  epoch: 2", "training.epoch", 16, "did you mean 'epochs'"),
    ("unknown top key", "search:\n", "serch:\n", "serch", 10, "did you mean 'search'"),
    ("low > high", "low: 0.001, high: 0.1", "low: 0.5, high: 0.1", "space.lr", 6, "low <= high"),
    ("empty choices", "choices: [adam, sgd]", "choices: []", "space.opt", 7, "at least one"),
    ("unknown algorithm", "algorithm: tpe", "algorithm: bayes", "search.algorithm", 11,
     "valid samplers: bohb, cmaes, gp, grid, nsga2, nsga3, random, tpe"),
    ("algorithm typo", "algorithm: tpe", "algorithm: tpee", "search.algorithm", 11, "did you mean 'tpe'"),
    ("missing metric", "  metric: val_accuracy\n", "", "study.metric", 1, "missing required key"),
    ("missing search", "search:\n  algorithm: tpe\n  n_trials: 4\n  max_concurrent: 1\n", "",
     "search", None, "missing required key"),
    ("broken yaml", "  n_trials: 4", "  n_trials: [4", "", 13, "YAML syntax error"),
    ("bad module:function", "  model: mlp", "  function: not_a_module_xyz:train", "training.function",
     15, "cannot import"),
    ("function without colon", "  model: mlp", "  function: just_a_name", "training.function", 15,
     "pattern"),
    ("missing attribute", "  model: mlp", "  function: json:no_such_fn", "training.function", 15,
     "defines no"),
    ("unknown placeholder", "lr: ${lr}", "lr: ${lrate}", "training.lr", 17, "refers to no search parameter"),
    ("bad direction", "direction: maximize", "direction: up", "study.direction", 4, "choose one of"),
    ("log with low 0", "low: 0.001, high: 0.1, log: true", "low: 0.0, high: 0.1, log: true", "space.lr",
     6, "low > 0"),
    ("condition on unknown", "when: {opt: sgd}", "when: {optim: sgd}", "space.momentum.when.optim", 8,
     "unknown parameter"),
    ("negative concurrency", "max_concurrent: 1", "max_concurrent: 0", "search.max_concurrent", 13,
     "greater than or equal to 1"),
    ("missing param type", "{type: int, low: 16, high: 64, step: 16}", "{low: 16, high: 64}",
     "space.width", 9, "type"),
    ("placeholder wrong type", "  epochs: 2", "  epochs: ${opt}", "training.epochs", 16, "${opt} can be 'adam'"),
    ("unknown built-in model", "model: mlp", "model: resnet9000", "training.model", 15,
     "unknown model 'resnet9000'; valid models: cnn, gpt, mlp"),
    ("duplicate key", "  epochs: 2\n", "  epochs: 2\n  epochs: 3\n", "training.epochs", 17, "duplicate key"),
    ("grid needs step", "algorithm: tpe", "algorithm: grid", "space.lr", 6, "needs step"),
    ("unknown metric", "metric: val_accuracy", "metric: accuracy", "study.metric", 3, "did you mean"),
    ("bad ask_ahead", "max_concurrent: 1", "max_concurrent: 1\n  ask_ahead: maybe", "search.ask_ahead", 14,
     "choose one of: auto, True, False"),
    ("elastic max < min", "n_trials: 4", "n_trials: 4\nresources:\n  processes: {min: 2, max: 1}",
     "resources.processes", 14, "max (1) must be >= min (2)"),
    ("in-memory storage", "search:\n", "storage: 'sqlite:///:memory:'\nsearch:\n", "storage", 10,
     "'sqlite:///:memory:' is an SQLite in-memory database: it lives only inside the driver's process"),
    ("negative core", "search:\n", "engine_options: {cores: [0, -1]}\nsearch:\n", "engine_options.cores.1", 10,
     "must be >= 0, but got -1"),
]


@pytest.mark.parametrize(("url", "in_memory"), [
    ("sqlite://", True), ("sqlite:///", True), ("sqlite://?timeout=5", True), ("sqlite:///:memory:", True),
    ("sqlite+pysqlite:///:memory:", True), ("sqlite:///file::memory:?cache=shared&uri=true", True),
    ("sqlite:///file:study?mode=memory&cache=shared&uri=true", True),
    ("sqlite:///study.db", False), ("sqlite:////abs/study.db", False), ("sqlite:///file:study.db?uri=true", False),
    ("postgresql://u@h/memory", False), ("study.journal", False), ("/dev/shm/study.journal", False),
])
def test_which_storages_are_in_memory(url: str, in_memory: bool) -> None:
    assert (in_memory_storage(url) is not None) == in_memory


@pytest.mark.parametrize("name,old,new,path,line,words", CASES, ids=[c[0] for c in CASES])
def test_malformed_spec_errors(tmp_path: Path, name: str, old: str, new: str, path: str,
                               line: int | None, words: str) -> None:
    assert old in GOOD, name
    f = tmp_path / "spec.yaml"
    f.write_text(GOOD.replace(old, new, 1))
    with pytest.raises(SpecError) as info:
        load_spec(f)
    issues = info.value.issues
    match = [i for i in issues if i.path == path or (path and i.path.startswith(path))]
    assert match, f"no issue at {path!r}: {[str(i) for i in issues]}"
    issue = match[0]
    assert words in issue.message, str(issue)
    if line is not None:
        assert issue.line == line, str(issue)
    assert len(str(info.value)) < 1200  # short


def test_good_spec_loads(tmp_path: Path) -> None:
    f = tmp_path / "spec.yaml"
    f.write_text(GOOD)
    spec, text = load_spec(f)
    assert text == GOOD
    assert list(spec.space) == ["lr", "opt", "momentum", "width"]
    assert spec.search.n_trials == 4


@pytest.mark.parametrize("old,new", [("n_trials: 4", "n_trials: -3"), ("  epochs: 2", "  epoch: 2"),
                                     ("  n_trials: 4", "  n_trials: [4")])
def test_cli_validate_exit_code_2_without_traceback(tmp_path: Path, old: str, new: str) -> None:
    f = tmp_path / "spec.yaml"
    f.write_text(GOOD.replace(old, new))
    p = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert f"{f}:" in p.stderr


def test_cli_validate_ok(tmp_path: Path) -> None:
    f = tmp_path / "spec.yaml"
    f.write_text(GOOD)
    p = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "valid" in p.stdout


def test_validate_rejects_more_cores_than_machine(tmp_path: Path) -> None:
    f = tmp_path / "spec.yaml"
    f.write_text(GOOD + "resources: {processes: 64, cpus_per_process: 4}\n")
    p = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(f)], capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2
    assert "256 cores" in p.stderr and "Traceback" not in p.stderr


def test_engine_options_cores_and_gpus_are_checked_against_this_machine(tmp_path: Path) -> None:
    """The local engine's ``engine_options.cores`` and ``gpus`` are checked by validate and run against
    this process's CPU affinity and the GPUs visible here (``cores: [-1]`` validated, then every trial
    failed with a sched_setaffinity traceback; ``cores: [0, 99]`` was only warned about): one line
    with the key path, exit 2, nothing written.
    The commands run with their affinity set to one core, and CUDA_VISIBLE_DEVICES=0 (one GPU, as far
    as the check can tell: it reads no device)."""
    first = min(os.sched_getaffinity(0))
    tests = Path(__file__).resolve().parents[1]  # for trainfns_light
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0",
           "PYTHONPATH": os.pathsep.join([str(tests.parent), str(tests), os.environ.get("PYTHONPATH", "")])}

    def hpoflow(*args: str, options: str, spec: str = GOOD) -> subprocess.CompletedProcess[str]:
        (tmp_path / "spec.yaml").write_text(spec + f"engine_options: {options}\n")
        return subprocess.run([sys.executable, "-m", "hpoflow", *args], capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=env, preexec_fn=lambda: os.sched_setaffinity(0, {first}))

    r = hpoflow("validate", "spec.yaml", options=f"{{cores: [{first}, {first + 1}]}}")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr == (f"hpoflow: error: engine_options.cores.1: core {first + 1} is not one the local engine can use "
                        f"on this machine (this process's CPU affinity: {first}). Fix: list cores among those, or "
                        "leave engine_options.cores out to use them all\n")
    r = hpoflow("validate", "spec.yaml", options="{gpus: [1]}")
    assert r.returncode == 2 and r.stderr.startswith("hpoflow: error: engine_options.gpus.0: GPU 1 is not one the "
                                                     "local engine can use on this machine (visible GPUs, from "
                                                     "CUDA_VISIBLE_DEVICES or else the NVIDIA driver: 0)"), r.stderr
    r = hpoflow("validate", "spec.yaml", options=f"{{cores: [{first}], gpus: [0]}}")
    assert r.returncode == 0, r.stderr
    light = ("study: {name: cores, metric: value, direction: maximize}\n"
             "space: {x: {type: float, low: 0.0, high: 1.0}}\n"
             "search: {algorithm: random, n_trials: 2}\n"
             "training: {function: 'trainfns_light:nap'}\n"
             "oracle: {enabled: false}\n")
    r = hpoflow("run", "spec.yaml", "--run-dir", "run", options=f"{{cores: [{first + 1}]}}", spec=light)
    assert r.returncode == 2 and f"engine_options.cores.0: core {first + 1} is not one" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_examples_are_valid() -> None:
    root = Path(__file__).resolve().parents[2] / "examples"
    for f in sorted(root.glob("*.yaml")):
        load_spec(f)


def test_validating_a_user_function_does_not_run_it(tmp_path: Path) -> None:
    """The driver must not import the user's training code (nor torch through it)."""
    (tmp_path / "mytrain.py").write_text(
        "import torch\nraise SystemExit('executed!')\ndef train(ctx):\n    return 1.0\n")
    f = tmp_path / "spec.yaml"
    f.write_text(GOOD.replace("  model: mlp", "  function: mytrain:train").replace("val_accuracy", "loss"))
    code = ("import sys; from hpoflow.spec import load_spec; load_spec(sys.argv[1]); "
            "print('torch' in sys.modules, 'mytrain' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=60,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["False", "False"]
    f.write_text(GOOD.replace("  model: mlp", "  function: mytrain:trian").replace("val_accuracy", "loss"))
    p = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(f)], capture_output=True, text=True,
                       timeout=60, cwd=tmp_path)
    assert p.returncode == 2 and "did you mean 'train'" in p.stderr
