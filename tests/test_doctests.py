"""Every module's examples run (#39): one doctest runner over every module of ``dna_factory/`` and ``rewards/``
(and ``tests/tiers.py``) whose docstrings hold ``>>>`` examples, in the fast tier.

Examples that need a server or a GPU say ``# doctest: +SKIP`` where they stand.
"""

from __future__ import annotations

import doctest
import importlib

import pytest

from tests.conftest import REPO

FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


def _modules_with_examples() -> list[str]:
    found = []
    for folder in ("dna_factory", "rewards"):
        for path in sorted((REPO / folder).rglob("*.py")):
            if ">>>" in path.read_text():
                parts = path.relative_to(REPO).with_suffix("").parts
                found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return [*found, "tests.tiers"]


MODULES = _modules_with_examples()


def test_the_runner_finds_the_examples():
    assert len(MODULES) >= 30 and "rewards.registry" in MODULES and "dna_factory.run.run_files" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_module_run(name, monkeypatch):
    for var in ("JUDGE_BASE_URL", "JUDGE_MODEL", "JUDGE_API_KEY"):  # the judge's examples read no server
        monkeypatch.delenv(var, raising=False)
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=FLAGS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (output above)"
