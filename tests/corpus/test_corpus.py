"""The acceptance corpus, reduced: public training programs, fetched from PyPI pinned by sha256 and run
unchanged as command trials on stand-in data, in a few modes (warm and isolated, 1 and 2 ranks, the median
pruner and promotion ASHA); two trials at once of a program that writes a fixed-name file keep their own
files. bench/corpus.py runs every program in every mode (docs/corpus.md).

A program that cannot be had here (no network to PyPI, a dependency that cannot be imported) is skipped
with the reason. The first run fetches ~260 MB into the corpus cache (tests/corpus/sources.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from hpoflow.spec import metric_pattern_problem, spec_from_mapping
from tests.corpus import programs as corpus
from tests.corpus import sources, standins
from tests.corpus.programs import Mode

# program, mode: one case per program that reports here, and every mode somewhere (~60 s on 2 cores once
# the cache is filled); bench/corpus.py has the rest of the matrix (ignite-transformers, which runs but cannot
# report, included).
CASES = [
    ("opacus-char-lstm", Mode(search="pruner", n_trials=3)),  # DataLoader workers in a warm trial
    ("ignite-reinforce", Mode(isolate=True, search="asha", n_trials=3)),
    ("opacus-imdb", Mode(search="pruner", n_trials=2)),  # DataLoader workers, HF caches, a line without a step
    ("trl-sft", Mode(ranks=2, search="pruner", n_trials=2)),  # HF Trainer's own DDP, eval_steps
    ("trl-dpo", Mode(search="pruner", n_trials=2)),  # the default reader on transformers' printed dicts
    ("opacus-mnist", Mode(search="pruner", n_trials=2)),  # torchvision: skips where it cannot be imported
    ("ignite-mnist", Mode(search="asha", n_trials=3)),
]


RUN_S = 200  # one study's bound (within the test's 900 s, fetch included): a hang fails with the logs


def _tails(o: corpus.Outcome, mode: Mode) -> str:
    logs = sorted(o.run_dir.glob("trials/*/rank*.log"))
    return o.stderr[-1500:] + "".join(f"\n--- {f.relative_to(o.run_dir)}:\n{f.read_text(errors='replace')[-1200:]}"
                                      for f in logs[-2 * mode.ranks:])


def _prepared(key: str, work: Path) -> corpus.Prepared:
    try:
        return corpus.prepare(corpus.BY_KEY[key], work)
    except sources.Unavailable as exc:
        pytest.skip(f"{key}: {exc}")


# One xdist worker runs the corpus's studies, one after another: the first fetches the cache for all, and
# no two studies of real programs share the 2 cores. The bound covers a first fetch (~260 MB) too.
F = TypeVar("F", bound=Callable[..., object])


def corpus_study(fn: F) -> F:
    for mark in (pytest.mark.slow, pytest.mark.xdist_group("corpus"), pytest.mark.timeout(900)):
        fn = mark(fn)
    return fn


@pytest.mark.parametrize(("key", "mode"), CASES, ids=[f"{k}-{m.label.replace(' ', '-')}" for k, m in CASES])
@corpus_study
def test_a_public_program_runs_unchanged_as_trials(key: str, mode: Mode, tmp_path: Path) -> None:
    program = corpus.BY_KEY[key]
    prep = _prepared(key, tmp_path)
    o = corpus.run(prep, mode, tmp_path, key.replace("-", "_"), timeout_s=RUN_S)
    assert o.rc != 124, _tails(o, mode)  # a study that did not end: the logs say where each rank was
    trials = {int(t["number"]): t for t in o.trials}
    assert len(trials) == mode.n_trials, (o.rc, o.stderr[-3000:])
    failed = {n: t["error"][-1500:] for n, t in trials.items() if t["state"] == "FAIL"}
    assert not failed, failed
    assert o.rc == 0, o.stderr[-3000:]
    assert {t["state"] for t in trials.values()} <= {"COMPLETE", "PRUNED"}
    assert o.summary["n_complete"] >= 1, o.summary
    expect = (program.expect_2 or program.expect) if mode.ranks == 2 else program.expect
    for n, t in trials.items():
        steps = corpus.reported_steps(o, n)
        if t["state"] == "COMPLETE":
            assert steps == list(expect), (n, steps, o.log(n)[-3000:])
        else:
            assert steps == list(expect[:len(steps)]) and steps, (n, steps)
        # every rank's program ended (by itself, or stopped after a prune or pause)
        assert None not in corpus.exit_codes(o, n, mode.ranks), [o.log(n, r)[-1500:] for r in range(mode.ranks)]
    if mode.search == "asha":
        assert any(int(t.get("pauses") or 0) > 0 for t in trials.values()), o.trials  # a rung paused a trial
    # nothing of the program's own files in the directory hpoflow ran in: each trial wrote in its own
    leftovers = {p.name for p in tmp_path.iterdir()} - {"data", ".hf-home", ".mpl", f"{o.run_dir.name}",
                                                        f"{o.run_dir.name.removesuffix('-run')}.yaml"}
    if not program.data_in_workdir:
        assert not leftovers, leftovers


@corpus_study
def test_two_trials_at_once_keep_their_own_files(tmp_path: Path) -> None:
    """opacus's char-lstm writes run_results_chr_lstm_classification.pt where it runs: two concurrent
    trials each find their own in their trial directory, and none lands where hpoflow runs."""
    prep = _prepared("opacus-char-lstm", tmp_path)
    mode = Mode(search="plain", n_trials=2, max_concurrent=2)
    o = corpus.run(prep, mode, tmp_path, "charlstm_x2", timeout_s=RUN_S)
    assert o.rc != 124, _tails(o, mode)
    assert o.rc == 0 and o.summary["n_complete"] == 2, (o.rc, o.cause(), o.stderr[-2000:])
    name = "run_results_chr_lstm_classification.pt"
    for n in (0, 1):
        own = list((o.run_dir / "trials" / str(n)).rglob(name))
        assert len(own) == 1, (n, own)
    assert not list(tmp_path.glob(name))


def test_every_program_is_pinned_and_its_study_is_valid(tmp_path: Path) -> None:
    """The corpus table itself: each program's archive, groups and stand-in exist, its patterns read its
    study's metric, and its study validates in every mode (without fetching anything)."""
    fake = tmp_path / "program.py"
    fake.write_text("print('epoch=1 x=1')\n")
    assert len({p.key for p in corpus.PROGRAMS}) == len(corpus.PROGRAMS)
    runnable = [p for p in corpus.PROGRAMS if not p.reads and "torchvision" not in p.probe]
    assert len(runnable) >= 5, [p.key for p in runnable]
    for p in corpus.PROGRAMS:
        a = sources.ARCHIVES[p.archive]
        assert len(a.sha256) == 64 and len(p.sha256) == 64, p.key
        assert set(p.groups) <= set(sources.GROUPS) and set(p.path_archives) <= set(sources.ARCHIVES)
        assert p.standin is None or p.standin in standins.KINDS
        for pattern in p.patterns:
            assert metric_pattern_problem(pattern, [p.metric]) == "", (p.key, pattern)
        prep = corpus.Prepared(p, fake, [], tmp_path)
        for mode in (Mode(), Mode(isolate=True, search="asha"), Mode(ranks=2, search="plain")):
            spec_from_mapping(corpus.spec(prep, mode, p.key))


def test_the_patterns_read_the_lines_the_programs_print() -> None:
    """Each pattern against a line as the program prints it (copied from a run's log)."""
    import re

    lines = {
        "opacus-char-lstm": ("\t Epoch 2. Accuracy: 0.303712 | Loss: 1.382732 | (ε = 6.16, δ = 8e-05)",
                             {"epoch": "2", "train_loss": "1.382732"}),
        "opacus-imdb": ("Test set: Average loss: 0.6884, Accuracy: 40.62%", {"val_loss": "0.6884"}),
        "ignite-reinforce": ("Episode 10\tLast reward: 34.00\tAverage length: 18.80",
                             {"step": "10", "running_reward": "18.80"}),
        "ignite-actor-critic": ("Episode 15\tLast reward: 9.00\tAverage reward: 11.83",
                                {"step": "15", "running_reward": "11.83"}),
        "trl-sft": ("\x1b[A{'eval_loss': '2.99', 'eval_runtime': '0.4173', 'epoch': '0.5'}", {"eval_loss": "2.99"}),
        "opacus-mnist": ("Train Epoch: 1 \t Loss: 2.301234 (ε = 1.02, δ = 1e-05)",
                         {"epoch": "1", "train_loss": "2.301234"}),
        "ignite-mnist": ("Validation Results - Epoch: 2 Avg accuracy: 0.91 Avg loss: 0.30",
                         {"epoch": "2", "val_loss": "0.30"}),
    }
    for key, (line, want) in lines.items():
        m = re.search(corpus.BY_KEY[key].patterns[0], line)
        assert m is not None, (key, line)
        assert {k: v for k, v in m.groupdict().items() if k in want} == want, key


def test_stand_ins_are_the_same_bytes_every_time(tmp_path: Path) -> None:
    standins.names(tmp_path / "a")
    standins.names(tmp_path / "b")
    standins.mnist(tmp_path / "a")
    standins.mnist(tmp_path / "b")
    for f in sorted((tmp_path / "a").rglob("*")):
        if f.is_file():
            assert f.read_bytes() == (tmp_path / "b" / f.relative_to(tmp_path / "a")).read_bytes(), f
    images = (tmp_path / "a" / "MNIST" / "raw" / "train-images-idx3-ubyte").read_bytes()
    assert images[:16] == bytes.fromhex("00000803000002000000001c0000001c") and len(images) == 16 + 512 * 784
    assert len(list((tmp_path / "a" / "names").glob("*.txt"))) == 4


def test_a_source_that_cannot_be_fetched_is_unavailable_with_the_reason(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """No registry (an index nothing answers, no cache): ``Unavailable`` with pip's words, nothing cached."""
    monkeypatch.setenv("HPOFLOW_CORPUS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_EXTRA_INDEX_URL", "")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(sources.Unavailable, match=r"pip could not fetch PyPI opacus==1\.6\.0"):
        sources.source("opacus")
    assert not (tmp_path / "cache" / "src" / "opacus-1.6.0").exists()


def test_the_bench_lists_its_options() -> None:
    r = subprocess.run([sys.executable, str(corpus.ROOT / "bench" / "corpus.py"), "--help"], capture_output=True,
                       text=True, timeout=60, check=False)
    assert r.returncode == 0 and "--programs" in r.stdout, r.stderr
