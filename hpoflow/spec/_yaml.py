"""YAML loading that remembers the line of every key, so errors can point at it.

Only the safe loader is used (libyaml's ``CSafeLoader`` where PyYAML has it): a spec can never
construct Python objects, and a tag such as ``!!python/object`` is refused with its own message.
The input is bounded, and every bound is checked before anything deep or large is built:

- at most ``MAX_BYTES`` of text (the file reader stops reading there: ``hpoflow.spec.load_spec``);
- printable text only (a NUL or an ESC byte is refused with its line and column);
- one pass over YAML's flat event stream, before a node is composed, checks the nesting depth
  (``MAX_DEPTH``, with aliases expanded: composing and constructing recurse, so a deep document must
  never reach them), the length of every list (``MAX_ITEMS``: a categorical's choices are the one
  place a long list could be meant, so its message says what to use instead) and the number of
  values once aliases are expanded (``MAX_NODES``: a 1 KB "billion laughs" spec expands to billions).

libyaml has limits and wording of its own (since PyYAML 6.0.4 its scanner refuses flow collections
nested past 1000 levels, and it scans ahead, so it stops before the event scan sees level 33): a text
the C loader refuses is scanned again by PyYAML's pure-Python loader, whose verdict and message stand.
Every message is then the same whichever loader PyYAML has.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from yaml.reader import Reader

from hpoflow.errors import Issue, SpecError

Path = tuple[str | int, ...]

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_ITEMS", "MAX_NODES", "Path", "load_yaml_with_lines"]

MAX_BYTES = 1_000_000
MAX_NODES = 20_000
MAX_DEPTH = 32
MAX_ITEMS = 10_000  # one list (a categorical's choices); also the model's bound on choices

_Loader: Any = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _TooLarge(Exception):
    def __init__(self, message: str, line: int | None, path: Path = ()) -> None:
        super().__init__(message)
        self.line = line
        self.path = path


@dataclass
class _Open:
    """A mapping or sequence whose end event has not come yet (the event scan's stack)."""

    path: Path
    is_map: bool
    anchor: str | None
    line: int
    nodes_before: int
    height: int = 0  # levels below it so far
    items: int = 0  # sequence items, or mapping values
    key: str | int | None = None  # mapping: the key whose value comes next (None: a key comes next)


def _scan(loader: Any) -> None:
    """Walk the event stream once, before anything is composed: ``_TooLarge`` past a bound. Counts every
    node (keys too) and the nodes an alias repeats; the depth of an alias is its anchor's height."""
    stack: list[_Open] = []
    anchors: dict[str, tuple[int, int]] = {}  # anchor -> (nodes, height) of what it names
    total = 0
    aliased = False
    key_of: list[str | int] = [""]  # the last key's text (the next value's key in its mapping)

    def done(nodes: int, height: int, anchor: str | None) -> None:
        """A node is complete: account for it in its parent."""
        if anchor is not None:
            anchors[anchor] = (nodes, height)
        if not stack:
            return
        top = stack[-1]
        top.height = max(top.height, height + 1)
        if top.is_map:
            if top.key is None:  # that node was a key
                top.key = key_of[0]
                return
            top.key = None
        top.items += 1
        if not top.is_map and top.items > MAX_ITEMS:
            raise _TooLarge(_long_list(top.path), top.line, top.path)

    while loader.check_event():
        event = loader.get_event()
        line = event.start_mark.line + 1
        if isinstance(event, yaml.ScalarEvent | yaml.AliasEvent | yaml.CollectionStartEvent):
            top = stack[-1] if stack else None
            is_key = top is not None and top.is_map and top.key is None
            here: Path = () if top is None else top.path if is_key else \
                (*top.path, top.key if top.is_map and top.key is not None else top.items)
            nodes, height = 1, 0
            if isinstance(event, yaml.AliasEvent):
                aliased = True
                nodes, height = anchors.get(str(event.anchor), (1, 0))
            total += nodes
            if total > MAX_NODES:
                raise _TooLarge(
                    f"the spec expands to more than {MAX_NODES} values (YAML aliases repeat what they point "
                    "at). Fix: write the values out, or use fewer aliases" if aliased else
                    f"the spec holds more than {MAX_NODES} values; a study spec is a few KB. Fix: check that "
                    "this is the right file", line)
            if len(stack) + height > MAX_DEPTH:
                raise _TooLarge(f"the spec nests more than {MAX_DEPTH} levels deep. Fix: flatten it", line, here[:1])
            if is_key:
                key_of[0] = str(event.value) if isinstance(event, yaml.ScalarEvent) else "?"
            if isinstance(event, yaml.CollectionStartEvent):
                stack.append(_Open(here, isinstance(event, yaml.MappingStartEvent), event.anchor, line, total - 1))
                continue
            done(nodes, height, event.anchor if isinstance(event, yaml.ScalarEvent) else None)
        elif isinstance(event, yaml.CollectionEndEvent) and stack:
            closed = stack.pop()
            done(total - closed.nodes_before, closed.height, closed.anchor)


def _long_list(path: Path) -> str:
    if len(path) == 3 and path[0] == "space" and path[2] == "choices":
        return (f"a categorical parameter holds at most {MAX_ITEMS} choices, but this list is longer. Fix: "
                "search a range instead ({type: int, low: 0, high: 99999} or type: float), or list fewer choices")
    return f"a list holds at most {MAX_ITEMS} items, but this one is longer. Fix: check that this is the right file"


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int], issues: list[Issue], src: str,
          budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:  # the event scan bounds this already; kept as a backstop
        raise _TooLarge(f"the spec expands to more than {MAX_NODES} values (YAML aliases repeat what they "
                        "point at). Fix: write the values out, or use fewer aliases", node.start_mark.line + 1)
    if len(path) > MAX_DEPTH:
        raise _TooLarge(f"the spec nests more than {MAX_DEPTH} levels deep. Fix: flatten it",
                        node.start_mark.line + 1)
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        seen: set[str] = set()
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else str(key_node.value)
            if key in seen:
                issues.append(
                    Issue(
                        ".".join(str(p) for p in (*path, key)),
                        f"duplicate key {key!r}; a key may appear once per mapping "
                        "(YAML would silently keep the last one). Fix: remove one of them",
                        key_node.start_mark.line + 1,
                        src,
                    )
                )
            seen.add(key)
            lines[(*path, key)] = key_node.start_mark.line + 1
            _walk(value_node, (*path, key), lines, issues, src, budget)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*path, i), lines, issues, src, budget)


def _unprintable(text: str, source: str) -> SpecError | None:
    """A character YAML refuses (NUL, ESC, other C0/C1 controls...), with its line and column."""
    m = Reader.NON_PRINTABLE.search(text)
    if m is None:
        return None
    pos = m.start()
    line = text.count("\n", 0, pos) + 1
    column = pos - (text.rfind("\n", 0, pos) + 1) + 1
    char = m.group()
    return SpecError([Issue("", f"column {column}: the control character U+{ord(char):04X} ({char!r}) is not "
                            "allowed: a spec is printable text. Fix: delete it (inside a double-quoted string "
                            f"it can be written as an escape, e.g. \\u{ord(char):04X})", line, source)])


def load_yaml_with_lines(text: str, source: str = "<spec>") -> tuple[Any, dict[Path, int]]:
    """Parse ``text`` safely and boundedly; return the data and a map from key path to 1-based line."""
    if len(text) > MAX_BYTES:
        raise SpecError([Issue("", f"the spec is {len(text)} characters; at most {MAX_BYTES} are read. Fix: "
                               "a study spec is a few KB; check that this is the right file", None, source)])
    bad = _unprintable(text, source)
    if bad is not None:
        raise bad
    try:
        loader = _scanned(text)(text)
        try:
            node = loader.get_single_node()
            lines: dict[Path, int] = {}
            issues: list[Issue] = []
            if node is not None:
                _walk(node, (), lines, issues, source, [MAX_NODES])
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except _TooLarge as exc:
        path = ".".join(str(p) for p in exc.path)
        raise SpecError([Issue(path, str(exc), exc.line, source)]) from None
    except yaml.constructor.ConstructorError as exc:
        mark = exc.problem_mark or exc.context_mark
        found = ((exc.problem or "").split("tag ")[-1].strip()).strip("'") or "here"
        found = found.replace("tag:yaml.org,2002:", "!!")
        raise SpecError([Issue("", f"the YAML tag {found} is not allowed: a spec holds plain values only (no "
                               "!!python/... or other tags). Fix: remove the tag",
                               mark.line + 1 if mark is not None else None, source)]) from None
    except yaml.MarkedYAMLError as exc:
        raise _syntax(exc, source) from None
    except yaml.YAMLError as exc:  # a reader error (bad character) or anything else PyYAML raises
        raise SpecError([Issue("", f"YAML error: {' '.join(str(exc).split())}", None, source)]) from None
    except RecursionError:  # a backstop: the event scan bounds the depth before composing
        raise SpecError([Issue("", f"the spec nests more than {MAX_DEPTH} levels deep. Fix: flatten it", None,
                               source)]) from None
    if issues:
        raise SpecError(issues)
    return data, lines


def _scanned(text: str) -> Any:
    """The loader class that scanned ``text`` within the bounds (``_scan``): ``_Loader``, or PyYAML's
    pure-Python ``SafeLoader`` where the C loader refused the text (see the module docstring); the
    pure-Python loader's error or ``_TooLarge`` if it refuses it too."""
    for cls in dict.fromkeys((_Loader, yaml.SafeLoader)):
        scanner = cls(text)
        try:
            _scan(scanner)
            return cls
        except yaml.YAMLError:
            if cls is yaml.SafeLoader:
                raise
        finally:
            scanner.dispose()
    return yaml.SafeLoader  # (not reached: the pure-Python loader returns or raises above)


def _syntax(exc: yaml.MarkedYAMLError, source: str) -> SpecError:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else None
    problem = exc.problem or "could not parse"
    return SpecError([Issue("", f"YAML syntax error: {problem}. Fix: check indentation, colons and quotes "
                            "on this line and the one before", line, source)])
