"""YAML loading that remembers the line of every key, so errors can point at it.

Only ``yaml.SafeLoader`` is used: a spec can never construct Python objects.
"""

from __future__ import annotations

from typing import Any

import yaml

from hpoflow.errors import Issue, SpecError

Path = tuple[str | int, ...]

__all__ = ["Path", "load_yaml_with_lines"]


def _walk(node: yaml.Node, path: Path, lines: dict[Path, int], issues: list[Issue], src: str) -> None:
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
            _walk(value_node, (*path, key), lines, issues, src)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _walk(item, (*path, i), lines, issues, src)


def load_yaml_with_lines(text: str, source: str = "<spec>") -> tuple[Any, dict[Path, int]]:
    """Parse ``text`` safely; return the data and a map from key path to 1-based line number."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else None
        problem = exc.problem or "could not parse"
        raise SpecError(
            [Issue("", f"YAML syntax error: {problem}. Fix: check indentation, colons and quotes "
                   "on this line and the one before", line, source)]
        ) from None
    except yaml.YAMLError as exc:
        raise SpecError([Issue("", f"YAML error: {exc}", None, source)]) from None
    lines: dict[Path, int] = {}
    issues: list[Issue] = []
    if node is not None:
        _walk(node, (), lines, issues, source)
    if issues:
        raise SpecError(issues)
    return data, lines
