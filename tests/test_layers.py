"""Packages talk through public modules: no module imports another package's ``_private`` module or name.

(The layer order itself is checked by ``lint-imports`` with the contract in pyproject.toml.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def _private_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, dotted name) for every imported hpoflow module or name with a ``_private`` part."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("hpoflow")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("hpoflow"):
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out
            if any(p.startswith("_") and not p.startswith("__") for p in name.split("."))]


def test_no_module_imports_another_packages_private_module() -> None:
    offences = []
    for path in sorted((ROOT / "hpoflow").rglob("*.py")):
        importer = _package_of(_module_name(path), path.name == "__init__.py")
        for line, name in _private_uses(ast.parse(path.read_text(encoding="utf-8"))):
            parts = name.split(".")
            first_private = next(i for i, p in enumerate(parts) if p.startswith("_") and not p.startswith("__"))
            owner = ".".join(parts[:first_private])  # the package the private part belongs to
            if importer != owner and not importer.startswith(owner + "."):
                offences.append(f"{path.relative_to(ROOT)}:{line} imports {name} (private to {owner})")
    assert offences == []


def test_the_check_sees_a_private_import() -> None:
    tree = ast.parse("from hpoflow.engines.local._worker import worker_main\nimport hpoflow.spec._models\n")
    assert [n for _, n in _private_uses(tree)] == ["hpoflow.engines.local._worker.worker_main",
                                                    "hpoflow.spec._models"]
