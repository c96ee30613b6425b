"""YAML loading that remembers the line of every key, so errors can point at it.

Only ``yaml.SafeLoader`` is used: a spec can never construct Python objects, and a tag such as
``!!python/object`` is refused with its own message. The input is bounded: at most ``MAX_BYTES`` of
text, ``MAX_NODES`` values once aliases are expanded (a 1 KB "billion laughs" spec expands to
billions) and ``MAX_DEPTH`` levels of nesting.
"""

from __future__ import annotations

from typing import Any

import yaml

from hpoflow.errors import Issue, SpecError

Path = tuple[str | int, ...]

__all__ = ["MAX_BYTES", "MAX_DEPTH", "MAX_NODES", "Path", "load_yaml_with_lines"]

MAX_BYTES = 1_000_000
MAX_NODES = 20_000
MAX_DEPTH = 32


class _TooLarge(Exception):
    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.line = line


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int], issues: list[Issue], src: str,
          budget: list[int]) -> None:
    budget[0] -= 1
    if budget[0] < 0:
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


def load_yaml_with_lines(text: str, source: str = "<spec>") -> tuple[Any, dict[Path, int]]:
    """Parse ``text`` safely and boundedly; return the data and a map from key path to 1-based line."""
    if len(text) > MAX_BYTES:
        raise SpecError([Issue("", f"the spec is {len(text)} characters; at most {MAX_BYTES} are read. Fix: "
                               "a study spec is a few KB; check that this is the right file", None, source)])
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            raise _syntax(exc, source) from None
        lines: dict[Path, int] = {}
        issues: list[Issue] = []
        if node is not None:
            try:
                _walk(node, (), lines, issues, source, [MAX_NODES])
            except _TooLarge as exc:
                raise SpecError([Issue("", str(exc), exc.line, source)]) from None
        try:
            data = loader.construct_document(node) if node is not None else None
        except yaml.constructor.ConstructorError as exc:
            mark = exc.problem_mark or exc.context_mark
            tag = getattr(node, "tag", "") if node is not None else ""
            found = ((exc.problem or "").split("tag ")[-1].strip() or tag).strip("'")
            found = found.replace("tag:yaml.org,2002:", "!!")
            raise SpecError([Issue("", f"the YAML tag {found} is not allowed: a spec holds plain values only (no "
                                   "!!python/... or other tags). Fix: remove the tag",
                                   mark.line + 1 if mark is not None else None, source)]) from None
        except yaml.MarkedYAMLError as exc:
            raise _syntax(exc, source) from None
    except yaml.YAMLError as exc:
        raise SpecError([Issue("", f"YAML error: {exc}", None, source)]) from None
    finally:
        loader.dispose()
    if issues:
        raise SpecError(issues)
    return data, lines


def _syntax(exc: yaml.MarkedYAMLError, source: str) -> SpecError:
    mark = exc.problem_mark or exc.context_mark
    line = mark.line + 1 if mark is not None else None
    problem = exc.problem or "could not parse"
    return SpecError([Issue("", f"YAML syntax error: {problem}. Fix: check indentation, colons and quotes "
                            "on this line and the one before", line, source)])
