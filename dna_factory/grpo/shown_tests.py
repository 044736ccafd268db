"""Does a code reward score only tests that the prompt shows? A ``--dry_run`` validator that warns.

In CodeContests the ``public_tests`` are the examples printed in the problem statement: a program that
prints the shown outputs passes them without solving anything, and under RL pressure a policy finds
that. A code-execution reward must score hidden tests (CodeContests: ``private_tests`` and
``generated_tests``). :func:`shown_tests` reads the first rows of each local dataset a code reward
scores and warns when, in most of them, every test of the reward's ``tests_column`` (each input and its
output, or each assert) is written in the prompt.
"""

from __future__ import annotations

import logging
from typing import Any

from dna_factory.errors import DnaConfigError
from dna_factory.grpo.answer_formats import _asked_text, _prompt_source, _source_column
from dna_factory.inputs.data import config_specs
from dna_factory.inputs.data_files import peek_rows
from rewards.code_tests import merge_suites

logger = logging.getLogger(__name__)

ROWS = 16
"""Rows read per local dataset."""


def _flat(text: str) -> str:
    return " ".join(text.split())


def _all_shown(suite: Any, prompt: str) -> bool:
    """Every test of ``suite`` is in ``prompt`` verbatim (whitespace aside): each input and its output, each
    assert or script."""
    shown = _flat(prompt)
    cases = all(_flat(i) in shown and _flat(o) in shown for i, o in suite.cases)
    return cases and all(_flat(snippet) in shown for snippet in suite.snippets)


def _code_entries(entries: Any) -> list[tuple[list[str], str | None]]:
    """``(tests columns, only_label)`` of every code-execution reward entry."""
    found = []
    for entry in entries or []:
        if entry == "code_execution":
            found.append((["tests"], None))
        elif isinstance(entry, dict) and entry.get("factory") == "code_execution":
            columns = entry.get("tests_column", "tests")
            columns = [columns] if isinstance(columns, str) else list(columns or [])
            found.append(([str(c) for c in columns], entry.get("only_label")))
    return found


def shown_tests(cfg: Any) -> list[str]:
    """Warnings for code rewards whose tests the prompts show, verbatim, in most of a dataset's first rows."""
    try:
        specs = config_specs(cfg)
    except DnaConfigError:
        return []  # the dataset validator reports it
    warnings = []
    for columns, label in _code_entries(cfg.get("reward_funcs")):
        for spec in specs:
            if label is not None and spec.label != label:
                continue
            rows = peek_rows(spec, ROWS) if spec.is_local else None
            scored = shown = 0
            for row in rows or []:
                try:
                    suite = merge_suites([row.get(_source_column(spec, c)) for c in columns])
                except ValueError:
                    continue  # a malformed cell is the reward's error at its first batch
                if suite is None:
                    continue
                scored += 1
                prompt = _asked_text(row.get(_prompt_source(spec), row.get("messages")))
                shown += _all_shown(suite, prompt)
            if scored and shown * 2 > scored:
                warnings.append(
                    f"Reward code_execution reads its tests from {', '.join(columns)}, and in {shown} of the first "
                    f"{scored} rows of dataset {spec.label} the prompt shows every one of them (inputs and outputs "
                    "verbatim): a program that prints the shown outputs scores without solving the task. Reward "
                    "tests the prompt does not show, e.g. CodeContests' hidden ones: columns: {description: prompt, "
                    "private_tests: private_tests, generated_tests: generated_tests} and tests_column: "
                    "[private_tests, generated_tests]."
                )
    return warnings


def warn_shown_tests(cfg: Any) -> None:
    """Log :func:`shown_tests` as warnings (a validator: never raises)."""
    for message in shown_tests(cfg):
        logger.warning(message)
