"""Metrics as programs print them (``hpoflow.train.lines``; issue 63): ``training.metrics`` patterns, the
default reader (ANSI colours, ``val/loss``, NaN, thousands separators, Hugging Face's dicts, JSON lines,
long lines), lines cut at ``\\r`` as progress bars redraw them, and steps that a value printed without one
never overrides or shifts. Then whole studies of small programs that print in their own format or draw a
progress bar, and the spec's checks of a pattern."""

from __future__ import annotations

import math
import random
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
from optuna.trial import TrialState

from hpoflow.api import optimize
from hpoflow.errors import SpecError
from hpoflow.spec import TrainConfig, spec_from_mapping
from hpoflow.train.context import TrialContext
from hpoflow.train.lines import MAX_LINE, LineReports, Segments, lines_of
from tests.conftest import ROOT

WORD_LM = "| end of epoch   1 | time:  5.39s | valid loss  5.80 | valid ppl   330.05"
WORD_LM_PATTERN = r"end of epoch\s+(?P<epoch>\d+).*valid loss\s+(?P<val_loss>[-+.\deE]+)"


def reads(line: str, *names: str, patterns: tuple[str, ...] = ()) -> tuple[int | None, dict[str, float]] | None:
    return LineReports(names or ("val_loss",), patterns).parse(line)


# -- patterns -----------------------------------------------------------------------------------------
def test_a_pattern_reads_word_language_models_line_that_the_default_reader_cannot() -> None:
    assert reads(WORD_LM) is None  # "valid loss  5.80": no NAME=VALUE; "time:  5.39s" is no number
    assert reads(WORD_LM, patterns=(WORD_LM_PATTERN,)) == (1, {"val_loss": 5.8})


def test_patterns_come_first_and_the_default_reader_still_reads_the_line() -> None:
    both = (r"valid loss\s+(?P<val_loss>[\d.]+)",)
    # the pattern's value of a metric wins over the pair's; the pair's other values and step stay
    assert reads("valid loss 0.5 | val_loss=0.7 epoch=4 lr=0.1", patterns=both) == (4, {"val_loss": 0.5, "lr": 0.1})
    # a pattern's step wins over the line's; a pattern that only gives a step gives the line's values one
    assert reads("iter 7 epoch=2 val_loss=0.3", patterns=(r"iter (?P<step>\d+)",)) == (7, {"val_loss": 0.3})
    assert reads("Epoch 3/10 val_loss=0.3", patterns=(r"Epoch (?P<epoch>\d+)/",)) == (3, {"val_loss": 0.3})


def test_a_pattern_reads_only_groups_named_after_a_study_metric_or_the_step() -> None:
    pattern = r"loss (?P<val_loss>\S+) ppl (?P<ppl>\S+) acc (?P<acc>\S+)"
    assert reads("loss 1,234.5 ppl 33 acc nan", "val_loss", "acc", patterns=(pattern,)) == \
        (None, {"val_loss": 1234.5, "acc": pytest.approx(math.nan, nan_ok=True)})
    assert reads("loss abc ppl 33 acc 0.5", "val_loss", patterns=(pattern,)) is None  # not a number: no value
    # several patterns, several matches: the first reading of each metric wins
    assert reads("a=1 v 0.1 v 0.2", patterns=(r"v (?P<val_loss>[\d.]+)", r"a=(?P<val_loss>\d)")) == \
        (None, {"val_loss": 0.1, "a": 1.0})


# -- the default reader ---------------------------------------------------------------------------------
def test_the_default_reader_keeps_what_it_read_before() -> None:
    assert reads("epoch=3 val_loss=0.41 val_accuracy: 0.9") == (3, {"val_loss": 0.41, "val_accuracy": 0.9})
    assert reads("Step: 12, val_loss: 1e-3") == (12, {"val_loss": 0.001})
    assert reads("val_loss = 2") == (None, {"val_loss": 2.0})
    assert reads("epoch=3 loss=0.41") is None  # no metric of the study: not a report
    assert reads("my_val_loss=0.4 val_loss=3.5x") is None  # whole names and numbers only
    assert reads("Val_Loss=0.4") is None  # names as written
    assert reads("epoch=1.5 val_loss=0.2") == (None, {"val_loss": 0.2})  # a step is a whole number
    assert reads("val_loss=0.25.") == (None, {"val_loss": 0.25})  # the end of a sentence


def test_ansi_colours_are_taken_out() -> None:
    assert reads("\x1b[1;32mscore=0.5\x1b[0m", "score") == (None, {"score": 0.5})
    assert reads("\x1b[2K\x1b[1G\x1b]0;title\x07epoch=\x1b[33m2\x1b[0m val_loss=\x1b[31m0.4\x1b[0m") == \
        (2, {"val_loss": 0.4})


def test_ansi_sequences_of_every_form_are_taken_out_and_make_no_value_of_their_own() -> None:
    # what a terminal shows is what is read: the 8-bit CSI (U+009B) and OSC (U+009D), 256-colour and RGB
    # parameters, a hyperlink (OSC 8, ended by ST), a charset (ESC ( B, as tput sgr0 writes it)
    assert reads("\x9b1;32mscore=0.5\x9b0m", "score") == (None, {"score": 0.5})
    assert reads("\x1b[38;5;196mval_loss\x1b[0m: \x1b[38;2;255;0;0m0.25\x1b(B\x1b[m") == (None, {"val_loss": 0.25})
    assert reads("\x1b]8;;https://x.org/?val_loss=9\x1b\\epoch=3\x1b]8;;\x1b\\ val_loss=0.5") == (3, {"val_loss": 0.5})
    assert reads("\x9d0;val_loss=9\x9c val_loss=0.5") == (None, {"val_loss": 0.5})  # a title is not shown
    assert reads("\x1b]0;val_loss=9\x07 done") is None
    assert reads("\x1b[1;32mmy_val_loss=0.5\x1b[0m") is None  # whole names still: my_val_loss is not val_loss
    assert reads("\x1b[38;5;1m epoch 3\x1b[0m") is None  # the sequence's numbers are no value


def test_names_with_a_slash() -> None:
    assert reads("val/loss=0.3 train/loss=0.5", "val/loss") == (None, {"val/loss": 0.3, "train/loss": 0.5})
    assert reads("val/loss=0.3", "loss") is None  # val/loss is not loss
    assert reads("val/loss: 0.3", "val/loss") == (None, {"val/loss": 0.3})


@pytest.mark.parametrize(("text", "value"), [("NaN", math.nan), ("nan", math.nan), ("inf", math.inf),
                                             ("-inf", -math.inf), ("Infinity", math.inf), ("+INF", math.inf),
                                             ("1,234.5", 1234.5), ("12,345,678", 12345678.0), ("-1.5e-3", -0.0015)])
def test_values_nan_inf_and_thousands_separators(text: str, value: float) -> None:
    found = reads(f"epoch=2 val_loss={text} done")
    assert found is not None
    assert found[0] == 2 and found[1]["val_loss"] == pytest.approx(value, nan_ok=True)


def test_a_comma_between_pairs_is_no_thousands_separator() -> None:
    assert reads("a=1,val_loss=2") == (None, {"a": 1.0, "val_loss": 2.0})
    assert reads("val_loss=0.5,acc=0.9") == (None, {"val_loss": 0.5, "acc": 0.9})
    assert reads("val_loss=1,2345") == (None, {"val_loss": 1.0})  # only groups of exactly three digits
    assert reads("nanny=3 val_loss=infinite") is None


def test_hugging_face_dicts_and_json_lines() -> None:
    # Hugging Face's 'epoch': 1.0 is how far training is, not a step (its evaluations count as unstepped values)
    assert reads("{'eval_loss': 0.41, 'eval_runtime': 1.5, 'epoch': 1.0}", "eval_loss") == \
        (None, {"eval_loss": 0.41, "eval_runtime": 1.5})
    assert reads('{"val_loss": 0.4, "epoch": 2}') == (2, {"val_loss": 0.4})  # a whole number written as one is
    assert reads('{"val_loss": 0.4, "step": 3}') == (3, {"val_loss": 0.4})
    assert reads("{'eval_loss': 0.3, 'epoch': 0.37}", "eval_loss") == (None, {"eval_loss": 0.3})  # no whole step
    found = reads("{'eval_loss': nan, 'epoch': 2.0}", "eval_loss")  # no literal: read as pairs
    assert found is not None and found[0] == 2 and math.isnan(found[1]["eval_loss"])
    assert reads('log {"val_loss": NaN, "tag": "x", "ok": true, "n": {"a": 1}} end') is not None
    assert reads('{"val_loss": 1e999}') == (None, {"val_loss": math.inf})
    assert reads("{'val loss': 0.2, 'val_loss': 0.1, 'bad\\tname': 3}") == (None, {"val loss": 0.2, "val_loss": 0.1})
    # transformers 5 prints its log values quoted (TRL's DPO: a '/' in the name too)
    assert reads("{'eval_loss': '0.6931', 'eval_rewards/margins': '0.0601', 'epoch': '1.0', 'tag': 'x'}",
                 "eval_rewards/margins") == (None, {"eval_loss": 0.6931, "eval_rewards/margins": 0.0601})


def test_a_span_is_never_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    line = f"{{'val_loss': __import__('pathlib').Path({str(marker)!r}).touch()}} x"
    assert reads(line) is None
    assert reads("{'val_loss': (lambda: 0.5)()}") is None
    assert not marker.exists()


def test_any_metric_name_reaches_the_study_and_self_crashes_nothing(tmp_path: Path) -> None:
    assert reads("self=3 class=4 step=2", "self") == (2, {"self": 3.0, "class": 4.0})
    ctx = TrialContext(params={}, config=TrainConfig(), trial_number=0, trial_dir=tmp_path)
    ctx.report(2, **{"self": 3.0, "step": 1.0, "class": 4.0, "val/loss": 0.5})
    assert ctx.reports == [(2, {"self": 3.0, "step": 1.0, "class": 4.0, "val/loss": 0.5})]


def test_a_long_line_is_read_by_its_end_in_bounded_time() -> None:
    lines = LineReports(("val_loss",))
    head = "my_val_loss=9 " * 20000  # 280,000 characters before it
    found = lines.parse(head + "epoch=4 val_loss=0.3")
    assert found is not None and found[0] == 4 and found[1]["val_loss"] == 0.3
    assert lines.parse("x" * (MAX_LINE + 10) + "val_loss=0.3") is None  # its end is one word: no name there
    hostile = ["a=" * 40000, "{" * 70000, "{'a': 1, " * 8000, "x=" + "1," * 40000, "'a'" * 25000, "a:" * 40000,
               "\x1b[" * 40000, "{" + "'a': 1, " * 1900 + "}" * 3, "val_loss=" + "1" * 70000, "a/" * 40000 + "=1"]
    for text in hostile:
        t0 = time.perf_counter()
        lines.parse(text)
        assert time.perf_counter() - t0 < 2.0, text[:40]


# -- lines ------------------------------------------------------------------------------------------------
def test_lines_end_at_newline_crlf_and_a_lone_carriage_return() -> None:
    assert list(lines_of(b"a\nb\r\nc\rd\r\re\n\nf")) == \
        [(b"a", False), (b"b", False), (b"c", False), (b"d", True), (b"e", True), (b"f", False)]


def test_a_carriage_return_at_the_end_of_a_chunk_waits_for_the_next_byte() -> None:
    seg = Segments()
    assert seg.feed(b"val_loss=1\r") == []
    assert seg.feed(b"\nnext\r") == [(b"val_loss=1", False)]  # \r\n split over two reads: one line end
    assert seg.feed(b"bar 2") == [(b"next", False)]
    assert seg.end() == [(b"bar 2", True)]


def test_the_lines_are_the_same_however_the_stream_is_cut() -> None:
    rng = random.Random(63)
    for _ in range(300):
        data = bytes(rng.choice(b"ab \r\n=1") for _ in range(rng.randint(0, 200)))
        seg, got, i = Segments(), [], 0
        while i < len(data):
            n = rng.randint(1, 7)
            got += seg.feed(data[i:i + n])
            i += n
        assert got + seg.end() == list(lines_of(data)), data


def test_a_long_line_keeps_its_last_bytes_from_a_separator_on() -> None:
    seg = Segments(limit=100)
    out = []
    for chunk in [b"x" * 80, b"my_val_loss=1 " * 20, b"y" * 30 + b" val_loss=0.3", b"\n"]:
        out += seg.feed(chunk)
    assert len(out) == 1 and out[0][0].endswith(b"val_loss=0.3") and len(out[0][0]) <= 100
    assert out[0][0].startswith((b" ", b"y" * 30))  # no name cut in half
    assert not out[0][0].lstrip().startswith(b"al_loss")
    big = Segments()
    assert big.feed(b"z" * (3 * MAX_LINE) + b"\n") == []  # one word: nothing to read
    ((line, refresh),) = big.feed(b"a" * 10 + b" val_loss=1" * 10000 + b"\n")
    assert MAX_LINE - 11 < len(line) <= MAX_LINE and line.startswith(b" val_loss=1 val_loss=1") and not refresh


# -- steps --------------------------------------------------------------------------------------------------
def printed(lines: LineReports, metrics: dict[str, float], step: int | None = None,
            refresh: bool = False) -> list[tuple[int, dict[str, float]]]:
    return lines.route(step, metrics, printed=True, refresh=refresh)


def test_values_without_a_step_get_consecutive_steps_per_metric() -> None:
    lines = LineReports(("val_loss", "acc"))
    assert printed(lines, {"val_loss": 0.5, "acc": 0.8, "lr": 0.1}) == [(1, {"lr": 0.1, "val_loss": 0.5, "acc": 0.8})]
    assert printed(lines, {"val_loss": 0.4}) == [(2, {"val_loss": 0.4})]
    assert printed(lines, {"val_loss": 0.4}) == [(3, {"val_loss": 0.4})]  # a new line: a new value
    assert printed(lines, {"acc": 0.9, "lr": 0.2}) == [(2, {"lr": 0.2, "acc": 0.9})]  # acc's 2nd value
    assert printed(lines, {"lr": 0.3}) == []  # no metric of the study
    # a metrics-file line without a step is a value without a step too
    assert lines.route(None, {"acc": 0.95}, printed=False) == [(3, {"acc": 0.95})]
    assert lines.ignored == set()


def test_a_redraw_repeating_a_value_is_the_same_report() -> None:
    lines = LineReports(("val_loss",))
    assert printed(lines, {"train_loss": 0.9}, refresh=True) == []
    assert printed(lines, {"val_loss": 0.512, "train_loss": 0.8}, refresh=True) == \
        [(1, {"train_loss": 0.8, "val_loss": 0.512})]
    for loss in (0.7, 0.6, 0.5):  # the bar redraws the last validation's value with each batch
        assert printed(lines, {"val_loss": 0.512, "train_loss": loss}, refresh=True) == []
    assert printed(lines, {"val_loss": 0.498}, refresh=True) == [(2, {"val_loss": 0.498})]
    assert printed(lines, {"val_loss": 0.498}, refresh=False) == [(3, {"val_loss": 0.498})]
    nan = LineReports(("val_loss",))
    assert len(printed(nan, {"val_loss": math.nan}, refresh=True)) == 1
    assert printed(nan, {"val_loss": math.nan}, refresh=True) == []


def test_after_a_report_with_a_step_values_without_one_make_none() -> None:
    lines = LineReports(("val_loss",))
    assert printed(lines, {"val_loss": 0.5}) == [(1, {"val_loss": 0.5})]
    assert printed(lines, {"val_loss": 0.45}, step=4) == [(4, {"val_loss": 0.45})]  # a printed step counts
    assert printed(lines, {"val_loss": 0.4}) == []
    assert printed(lines, {"lr": 0.4}) == []
    assert printed(lines, {"val_loss": 0.2}, step=5) == [(5, {"val_loss": 0.2})]
    assert lines.route(None, {"val_loss": 0.3}, printed=False) == []  # nor a metrics-file line without one
    assert lines.ignored == {"val_loss"}


def test_once_the_program_reports_through_the_client_or_the_file_printed_lines_make_no_report() -> None:
    lines = LineReports(("eval_loss",))
    assert lines.route(1, {"eval_loss": 0.5}, printed=False) == [(1, {"eval_loss": 0.5})]
    # Hugging Face's printed log of the next evaluation, beside its callback's report of it
    assert printed(lines, {"eval_loss": 0.4}, step=2) == []
    assert lines.route(2, {"eval_loss": 0.4}, printed=False) == [(2, {"eval_loss": 0.4})]
    assert lines.ignored == {"eval_loss"}


# -- whole studies ----------------------------------------------------------------------------------------
def _study(tmp_path: Path, script: str, state: TrialState = TrialState.COMPLETE, **training: Any) -> Any:
    prog = tmp_path / "prog.py"
    prog.write_text(textwrap.dedent(script))
    data = {"study": {"name": "lines", "metric": "val_loss", "direction": "minimize"},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 1, "max_concurrent": 1, "seed": 1},
            "training": {"command": [sys.executable, str(prog), "--x", "${x}"], **training},
            "resources": {"processes": 1}}
    study = optimize(data, tmp_path / "run").study
    (trial,) = study.trials
    assert trial.state == state, (tmp_path / "run" / "trials" / "0" / "rank0.log").read_text()
    return trial


WORD_LM_PROG = """\
    import sys, time
    print("| epoch   1 |   200/ 2983 batches | lr 20.00 | ms/batch 38.1 | loss  7.60 | ppl  1998.31", flush=True)
    for epoch, loss in enumerate([5.8, 5.51, 5.3], start=1):
        print("-" * 89)
        print(f"| end of epoch {epoch:3d} | time: {epoch * 5.39:5.2f}s | valid loss {loss:5.2f} | "
              f"valid ppl {2.718 ** loss:8.2f}", flush=True)
        print("-" * 89, flush=True)
    print("=" * 89)
    print("| End of training | test loss  5.21 | test ppl   183.07", flush=True)
"""


def test_a_program_in_its_own_format_is_read_through_a_pattern(tmp_path: Path) -> None:
    trial = _study(tmp_path, WORD_LM_PROG, metrics=[WORD_LM_PATTERN])
    assert trial.intermediate_values == {1: 5.8, 2: 5.51, 3: 5.3}
    assert trial.value == 5.3


BAR_PROG = """\
    import json, os, sys, time
    explicit = "--file" in sys.argv
    shown = None  # the bar shows the last validation's value, as Lightning's does
    for epoch in range(1, 4):
        for batch in range(6):
            post = f"loss={1.0 / (epoch + batch):.3f}" + (f", val_loss={shown:.3f}" if shown is not None else "")
            sys.stdout.write(f"\\rEpoch {epoch - 1}: {batch * 20:3d}%|{'#' * batch:<5}| {batch}/5 [{post}]")
            sys.stdout.flush()
            time.sleep(0.01)
        value = 1.0 / epoch + 0.000123  # the validation
        if explicit:
            with open(os.environ["HPOFLOW_METRICS_FILE"], "a") as f:
                f.write(json.dumps({"step": epoch, "val_loss": value}) + "\\n")
        shown = value
        for _ in range(3):
            sys.stdout.write(f"\\rEpoch {epoch - 1}: 100%|#####| 5/5 [loss=0.100, val_loss={shown:.3f}]")
            sys.stdout.flush()
        sys.stdout.write("\\n")
    sys.stdout.write("\\rTesting: 100%| val_loss=0.001\\n")
"""


def test_a_progress_bar_beside_reports_with_steps_gives_exactly_those_steps(tmp_path: Path) -> None:
    trial = _study(tmp_path, BAR_PROG.replace('"--file" in sys.argv', "True"))
    assert trial.intermediate_values == {e: pytest.approx(1.0 / e + 0.000123, abs=1e-12) for e in (1, 2, 3)}
    assert trial.value == pytest.approx(1.0 / 3 + 0.000123, abs=1e-12)


def test_a_progress_bar_alone_reports_each_validation_once(tmp_path: Path) -> None:
    trial = _study(tmp_path, BAR_PROG)
    # each validation's value once, at its own step; the redraws repeating it are no report, and the last
    # line's new value (a line after \r) is the 4th
    assert trial.intermediate_values == {1: 1.0, 2: 0.5, 3: 0.333, 4: 0.001}


def test_a_value_printed_after_reports_through_the_file_is_not_read_and_the_error_says_why(tmp_path: Path) -> None:
    trial = _study(tmp_path, """\
        import json, os
        with open(os.environ["HPOFLOW_METRICS_FILE"], "a") as f:
            f.write(json.dumps({"step": 1, "train_loss": 0.5}) + "\\n")
        print("valid loss 0.3 | val_loss=0.3", flush=True)
    """, state=TrialState.FAIL)
    error = trial.user_attrs["error"]
    assert "never reported 'val_loss'" in error and "were not read" in error and "training.metrics" in error, error


# -- the spec ----------------------------------------------------------------------------------------------
def _spec(metrics: Any, **training: Any) -> dict[str, Any]:
    return {"study": {"name": "p", "metric": "val_loss", "direction": "minimize", "constraints": ["mem_mb <= 10"]},
            "space": {"x": {"type": "float", "low": 0.0, "high": 1.0}},
            "search": {"algorithm": "random", "n_trials": 2},
            "training": {"command": ["python", "tests/commandprog.py"], "metrics": metrics, **training}}


def _problems(data: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as err:
        spec_from_mapping(data)
    return [f"{i.path}: {i.message}" for i in err.value.issues]


def test_good_patterns_are_kept_for_the_ranks() -> None:
    spec = spec_from_mapping(_spec([WORD_LM_PATTERN, r"mem (?P<mem_mb>\d+)", r"it (?P<step>\d+)"]))
    assert spec.training["metrics"][0] == WORD_LM_PATTERN
    assert TrainConfig.model_validate(spec.training).model_dump(mode="json")["metrics"][1] == r"mem (?P<mem_mb>\d+)"


@pytest.mark.parametrize(("metrics", "words"), [
    (["(?P<val_loss>[0-9.+"], "is not a Python regular expression: unterminated character set"),
    (["valid loss ([0-9.]+)"], "has no named group"),
    ([r"valid loss (?P<valid_loss>[0-9.]+)"], "which is not a metric of the study (val_loss, mem_mb), step or epoch "
                                              "(did you mean 'val_loss'?)"),
    ([r"(?P<a>\d) (?P<b>\d)"], "none of which is a metric of the study"),
])
def test_a_bad_pattern_names_its_key_the_rule_and_the_fix(metrics: list[str], words: str) -> None:
    found = _problems(_spec(metrics))
    assert len(found) == 1 and found[0].startswith("training.metrics.0: ") and words in found[0], found
    assert "Fix: " in found[0]


def test_patterns_without_a_command_are_refused() -> None:
    data = _spec([WORD_LM_PATTERN])
    del data["training"]["command"]
    (found,) = _problems(data)
    assert found.startswith("training.metrics: ") and "training.command is not set" in found


def test_validate_says_it_in_one_line_with_exit_code_2(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("study: {name: c, metric: val_loss, direction: minimize}\n"
                 "space: {x: {type: float, low: 0.0, high: 1.0}}\n"
                 "search: {algorithm: random, n_trials: 2}\n"
                 "training:\n"
                 "  command: [python, tests/commandprog.py]\n"
                 "  metrics:\n"
                 "    - 'valid loss\\s+(?P<valid_loss>[-+.\\deE]+)'\n")
    r = subprocess.run([sys.executable, "-m", "hpoflow", "validate", str(f)], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    assert "training.metrics.0" in r.stderr and "Fix: " in r.stderr, r.stderr
