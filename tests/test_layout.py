"""The package layout's rules (#16): ``rewards/`` is the ground floor, and what builds on it imports it, never
the other way round."""

from __future__ import annotations

import ast

from tests.conftest import REPO

SHIMS = {"rewards/filter_tasks.py"}
"""``python -m rewards.filter_tasks``: the documented command, kept as a thin shim over dna_factory.filter."""


def _imported_modules(path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_rewards_imports_nothing_from_dna_factory():
    offenders = {
        path.relative_to(REPO).as_posix(): sorted(
            m for m in _imported_modules(path) if m.split(".")[0] == "dna_factory"
        )
        for path in sorted((REPO / "rewards").rglob("*.py"))
        if path.relative_to(REPO).as_posix() not in SHIMS
    }
    offenders = {path: modules for path, modules in offenders.items() if modules}
    assert not offenders, f"rewards/ must not import dna_factory/: {offenders}"
