"""Metrics in the lines a command trial's program prints (rank 0's stdout; ``hpoflow.train.command``).

**Lines.** The output is cut into lines at ``\\n``, ``\\r\\n`` and a lone ``\\r`` (``Segments``): tqdm's and
Lightning's progress bars redraw themselves with ``\\r``, and each redraw is a line of its own, a
*refresh* (it follows a lone ``\\r``). A line longer than ``MAX_LINE`` bytes is read by its last
``MAX_LINE`` bytes, from its first separator there on (so no name is read by its end only). ANSI escape
sequences (colours, cursor moves, a window title: CSI and OSC, 7- and 8-bit) are taken out before a line
is read, so a line is read as a terminal shows it.

**What a line reports** (``LineReports.parse``), read in this order, the first reading of a name
winning:

1. ``training.metrics`` patterns (Python regexes, as Katib's metrics-collector filters): each match of
   each pattern, in order. A named group ``epoch`` or ``step`` gives the line's step; a named group
   named after a metric of the study gives that metric's value. Other groups are ignored.
2. ``{...}`` spans that are a flat dict: Hugging Face's printed logs ``{'eval_loss': 0.41, 'epoch': 1.0}``
   (``ast.literal_eval``, never ``eval``) and JSON lines ``{"val_loss": 0.4, "step": 3}`` (``json``).
   Every entry with a number, or a string that is one (transformers 5 prints ``{'eval_loss': '0.66'}``),
   is a value; ``epoch``/``step`` give the step only as whole numbers written as such (``"step": 3``):
   Hugging Face's ``'epoch': 1.0`` (or ``'0.62'``) tells how far training is, not which evaluation this is,
   so its evaluations are counted as values without a step are (below). Names of either any case.
3. ``NAME=VALUE`` and ``NAME: VALUE`` pairs (the name may be quoted: ``'eval_loss': nan``). A name is a
   letter or ``_``, then letters, digits, ``_``, ``.`` and ``/`` (``val/loss``), matched as written
   (case-sensitive), whole (``my_val_loss`` is not ``val_loss``). A value is a number as Python writes
   it, ``NaN``/``nan``/``inf``/``Infinity`` in any case, or a number with thousands separators
   (``1,234.5``: only groups of exactly three digits after a comma are separators, so ``a=1,b=2`` is two
   pairs); a number followed by a letter (``5.39s``) is not a value. ``epoch=N``/``step=N`` (any case)
   give the step.

A line is a report only where it holds a value of a metric of the study (``study.metric``,
``study.metrics``, a constraint's); the report holds every value on it. Its step: the first of the
patterns' ``epoch``, the patterns' ``step``, the line's ``epoch``, the line's ``step``; a step is a whole
number >= 0 (``epoch: 1.0`` is step 1; ``epoch: 0.37`` is no step, and no value either).

**Steps** (``LineReports.route``: what the reports of the three ways become). A printed value never
overrides or shifts a step reported another way:

- a report with a step (a printed line with one, a line of ``HPOFLOW_METRICS_FILE`` with ``step`` or
  ``epoch``, ``hpoflow.client.report``) is made at that step. A second value of a metric at a step that
  has one already is dropped (the supervisor keeps the first): printed and reported, it counts once;
- once the program has reported through ``hpoflow.client`` or the metrics file, those are its way to
  report: printed lines make no report from then on, with a step or without (a progress bar's
  ``val_loss=``, Hugging Face's printed ``{'eval_loss': ..., 'epoch': 1.0}`` beside a callback's reports);
- once the trial has made any report with a step, values without one make no report;
- before that, the values without a step of each metric of the study get consecutive steps of their
  own: its 1st value step 1, its 2nd step 2, ... The other values on their line go with the step of the
  line's first new study value. A refresh (a line after a lone ``\\r``) that repeats the last value read
  of a metric is the same report, not a new one: a progress bar showing ``val_loss=0.512`` on each of its
  redraws between two validations counts that value once, and each validation's new value once. A line
  after ``\\n`` counts whatever it holds (an epoch that prints the value of the one before is a new step).

Values left out so are named in ``ignored`` (the trial's error says so when its metric was never
reported). ``hpoflow.client.report`` returns once its report is made, and the supervisor reads the
metrics file before each printed line it handles, so what a program reported before it printed a line
counts before that line: with the Lightning callback, whose report comes before the progress bar shows
the value, the callback's reports are the only ones. A program that prints a value before it reports it
(Hugging Face's Trainer logs an evaluation before its callbacks hear of it) may have its first printed
value reported before its first report; report at the steps the printed lines name (epochs), and the two
are the same report.

Everything here is bounded in time by the length of a line (``MAX_LINE``), whatever it holds, except
the user's own patterns, which run once per line.
"""

from __future__ import annotations

import ast
import json
import math
import re
from collections.abc import Iterable, Iterator

from hpoflow.spec import unprintable

__all__ = ["MAX_LINE", "STEP_NAMES", "LineReports", "Segments", "compile_patterns", "lines_of"]

MAX_LINE = 65536  # bytes of a line read: its last MAX_LINE
STEP_NAMES = ("epoch", "step")  # in this order: a line's epoch is its step before its step
_MAX_SPANS = 16  # {...} spans of a line tried as a dict
_MAX_SPAN = 16384  # characters of one
_MAX_MATCHES = 64  # matches of one pattern on one line
_MAX_NAME = 256

# ANSI escape sequences: CSI (colours, cursor moves; ESC [ or the 8-bit U+009B), OSC (a window title, a
# hyperlink; ESC ] or U+009D, to BEL or ST), and the other ESC sequences (a charset, ESC 7)
_ANSI = re.compile(r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]|(?:\x1b\]|\x9d)[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"
                   r"|\x1b[ -/]*[0-~]")
_ESCAPES = ("\x1b", "\x9b", "\x9d")
_NUMBER = (r"[-+]?(?:\d{1,3}(?:,\d{3}(?!\d))+(?:\.\d*)?|\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"
           r"|[-+]?(?i:nan|inf(?:inity)?)(?!\w)")
_NAME = r"[A-Za-z_][\w./]*"
_PAIR = re.compile(rf"(?<![\w./\-])(?:(['\"])({_NAME})\1|({_NAME}))\s*[=:]\s*({_NUMBER})(?!\w|\.\d)")
_SPAN = re.compile(r"\{[^{}]*\}")
_GROUPED = re.compile(r"\s*[-+]?\d{1,3}(?:,\d{3})+(?:\.\d*)?(?:[eE][-+]?\d+)?\s*")
_EOL = re.compile(rb"\r\n|\r|\n")
_SEPARATOR = re.compile(rb"[\s,;|{}()\[\]]")
_SEPARATOR_TEXT = re.compile(r"[\s,;|{}()\[\]]")

Reading = tuple[int | None, dict[str, float]]


def _number(text: str) -> float | None:
    """``text`` as a float (thousands separators allowed), else None."""
    if _GROUPED.fullmatch(text):
        text = text.replace(",", "")
    try:
        return float(text)
    except (ValueError, OverflowError):
        return None


def _step(value: float | None) -> int | None:
    """A step: a whole number >= 0 (within a float's exact integers), else None."""
    if value is None or not math.isfinite(value) or value < 0 or value != int(value) or value > 2.0 ** 53:
        return None
    return int(value)


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def compile_patterns(patterns: Iterable[str]) -> list[re.Pattern[str]]:
    """The ``training.metrics`` patterns compiled (the spec checked them: ``TrainConfig.metrics``);
    ``ValueError`` naming the one that does not compile."""
    out = []
    for i, pattern in enumerate(patterns):
        try:
            out.append(re.compile(pattern))
        except (re.error, RecursionError, OverflowError) as exc:
            raise ValueError(f"training.metrics.{i}: {pattern!r} is not a Python regular expression: {exc}") from exc
    return out


class LineReports:
    """Reports in lines of text (see the module docstring): ``parse`` reads one line; ``route`` makes the
    trial's reports of what was read (steps for values without one, printed values left out)."""

    def __init__(self, names: Iterable[str], patterns: Iterable[str] = ()) -> None:
        self.names = frozenset(names)
        self.patterns = compile_patterns(patterns)
        self.has_step = False  # the trial made a report with a step
        self.reported = False  # the program reported through hpoflow.client or the metrics file
        self.count: dict[str, int] = {}  # values without a step read so far, per metric of the study
        self.last: dict[str, float] = {}  # the last of them, per metric
        self.ignored: set[str] = set()  # metrics of the study whose values made no report (route)

    # -- one line ---------------------------------------------------------------------------------
    def parse(self, line: str) -> Reading | None:
        """``(step, metrics)`` of a line that reports (step None: the line has none), else None."""
        if len(line) > MAX_LINE:  # its last MAX_LINE characters, from a separator on (as Segments keeps it)
            line = line[-MAX_LINE:]
            sep = _SEPARATOR_TEXT.search(line)
            line = line[sep.start():] if sep is not None else ""
        text = _ANSI.sub("", line) if any(e in line for e in _ESCAPES) else line
        steps: dict[str, int] = {}
        metrics: dict[str, float] = {}
        self._patterns(text, steps, metrics)
        if "{" in text:
            text = self._spans(text, steps, metrics)  # (the dicts read are blanked: their pairs are read once)
        if "=" in text or ":" in text:
            self._pairs(text, steps, metrics)
        if not any(name in self.names for name in metrics):
            return None
        order = [f"pattern {k}" for k in STEP_NAMES] + list(STEP_NAMES)
        return next((steps[k] for k in order if k in steps), None), metrics

    def _patterns(self, text: str, steps: dict[str, int], metrics: dict[str, float]) -> None:
        for pattern in self.patterns:
            for n, match in enumerate(pattern.finditer(text)):
                if n >= _MAX_MATCHES:
                    break
                for name, raw in match.groupdict().items():
                    if raw is None:
                        continue
                    value = _number(raw)
                    if name in STEP_NAMES:
                        step = _step(value)
                        if step is not None:
                            steps.setdefault(f"pattern {name}", step)
                    elif name in self.names and value is not None:
                        metrics.setdefault(name, value)

    def _spans(self, text: str, steps: dict[str, int], metrics: dict[str, float]) -> str:
        """Flat dicts: Hugging Face's printed logs (Python literals) and JSON objects; ``text`` with each dict
        read blanked out."""
        read: list[tuple[int, int]] = []
        for n, match in enumerate(_SPAN.finditer(text)):
            if n >= _MAX_SPANS:
                break
            span = match.group()
            if len(span) > _MAX_SPAN or ":" not in span:
                continue
            found = _literal(span)
            if found:
                read.append(match.span())
            for key, raw in found.items():
                if not isinstance(key, str) or not key or len(key) > _MAX_NAME or unprintable(key):
                    continue
                if key.lower() in STEP_NAMES and (isinstance(raw, bool) or not isinstance(raw, int)):
                    continue  # Hugging Face's 'epoch': 1.0 / '0.62' is where training is, not a step
                if isinstance(raw, str) and len(raw) <= 64:  # transformers 5 prints values quoted: '0.66'
                    number = _number(raw.strip())
                    if number is not None:
                        self._take(key, number, steps, metrics)
                    continue
                if isinstance(raw, bool) or not isinstance(raw, int | float):
                    continue
                try:
                    value = float(raw)
                except OverflowError:
                    value = math.inf if raw > 0 else -math.inf
                self._take(key, value, steps, metrics)
        for start, end in read:
            text = text[:start] + " " * (end - start) + text[end:]
        return text

    def _pairs(self, text: str, steps: dict[str, int], metrics: dict[str, float]) -> None:
        for match in _PAIR.finditer(text):
            name = match.group(2) or match.group(3)
            value = _number(match.group(4))
            if value is not None:
                self._take(name, value, steps, metrics)

    @staticmethod
    def _take(name: str, value: float, steps: dict[str, int], metrics: dict[str, float]) -> None:
        low = name.lower()
        if low in STEP_NAMES:
            step = _step(value)
            if step is not None:
                steps.setdefault(low, step)
        else:
            metrics.setdefault(name, value)

    # -- steps --------------------------------------------------------------------------------------
    def route(self, step: int | None, metrics: dict[str, float], *, printed: bool,
              refresh: bool = False) -> list[tuple[int, dict[str, float]]]:
        """The reports ``(step, metrics)``, in step order, that values read at ``step`` (None: they have
        none) make (see the module docstring): ``printed`` on rank 0's stdout (``refresh``: on a line after
        a lone ``\\r``, a progress bar's redraw), else given to ``hpoflow.client`` or the metrics file."""
        if printed and self.reported:
            self.ignored.update(name for name in metrics if name in self.names)
            return []
        self.reported = self.reported or not printed
        if step is not None:
            self.has_step = True
            return [(step, metrics)]
        if self.has_step:
            self.ignored.update(name for name in metrics if name in self.names)
            return []
        out: dict[int, dict[str, float]] = {}
        first: int | None = None
        for name, value in metrics.items():
            if name not in self.names:
                continue
            if refresh and name in self.last and _same(self.last[name], value):
                continue  # a redraw of what was read already
            self.last[name] = value
            step = self.count[name] = self.count.get(name, 0) + 1
            out.setdefault(step, {})[name] = value
            if first is None:
                first = step
        if first is None:
            return []
        out[first] = {**{k: v for k, v in metrics.items() if k not in self.names}, **out[first]}
        return sorted(out.items())


def _literal(span: str) -> dict[object, object]:
    """``span`` as a flat dict (JSON, or a Python literal), else ``{}``. Never ``eval``."""
    for load in (json.loads, ast.literal_eval):
        try:
            found = load(span)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
        if isinstance(found, dict):
            return found
    return {}


class Segments:
    """The lines of a byte stream, fed as it comes: ``feed`` gives the ``(line, refresh)`` it completes,
    ``end`` the last. Lines end at ``\\n``, ``\\r\\n`` or a lone ``\\r`` (a ``\\r`` at the end of what came so far
    waits for the next byte); ``refresh``: the line follows a lone ``\\r``. A line is kept by its last
    ``limit`` bytes, from its first separator there on (a space, a comma, a bracket...). Empty lines are
    left out."""

    def __init__(self, limit: int = MAX_LINE) -> None:
        self.limit = limit
        self.pending = bytearray()  # the line so far (its last ``limit`` bytes)
        self.refresh = False  # the pending line follows a lone \r
        self.cut = False  # the pending line lost its beginning
        self.held_cr = False  # the bytes so far end with a \r: a lone one, or half of a \r\n

    def feed(self, chunk: bytes) -> list[tuple[bytes, bool]]:
        """The lines ``chunk`` completes. Each byte is looked at once (however the stream is cut)."""
        out: list[tuple[bytes, bool]] = []
        if self.held_cr and chunk:
            self.held_cr = False
            crlf = chunk.startswith(b"\n")
            self._end_line(out, after_cr=not crlf)
            chunk = chunk[1:] if crlf else chunk
        start = 0
        for match in _EOL.finditer(chunk):
            self.pending += chunk[start:match.start()]
            start = match.end()
            if match.group() == b"\r" and start == len(chunk):
                self.held_cr = True
                break
            self._end_line(out, after_cr=match.group() == b"\r")
        self.pending += chunk[start:]
        if len(self.pending) > self.limit:
            del self.pending[:-self.limit]
            self.cut = True
        return out

    def end(self) -> list[tuple[bytes, bool]]:
        """The last line (the stream ended)."""
        out: list[tuple[bytes, bool]] = []
        self._end_line(out, after_cr=False)
        self.held_cr = False
        return out

    def _end_line(self, out: list[tuple[bytes, bool]], after_cr: bool) -> None:
        self._emit(bytes(self.pending), out)
        self.pending.clear()
        self.refresh = after_cr

    def _emit(self, line: bytes, out: list[tuple[bytes, bool]]) -> None:
        cut, self.cut = self.cut, False
        if len(line) > self.limit:
            line, cut = line[-self.limit:], True
        if cut:
            sep = _SEPARATOR.search(line)
            line = line[sep.start():] if sep is not None else b""
        if line:
            out.append((line, self.refresh))


def lines_of(data: bytes) -> Iterator[tuple[bytes, bool]]:
    """Every ``(line, refresh)`` of ``data`` at once (``Segments``)."""
    seg = Segments()
    yield from seg.feed(data)
    yield from seg.end()
