"""A code reward's tests: a row's tests cells read as one :class:`TestSuite`, and how outputs compare.

:func:`parse_tests` reads one cell (asserts, a test script, stdin/stdout cases, or JSON text of them; the
shapes are listed in :mod:`rewards.code`), :func:`merge_suites` joins the cells of several tests columns
(CodeContests' ``[private_tests, generated_tests]``), :func:`same_output` compares a program's output
with the expected one. Used by the code reward and by ``--dry_run``'s shown-tests check
(:mod:`dna_factory.grpo.shown_tests`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TestSuite:
    """A row's tests: snippets run after the program, or stdin/stdout cases."""

    snippets: tuple[str, ...] = ()
    cases: tuple[tuple[str, str], ...] = ()

    def __len__(self) -> int:
        return len(self.snippets) + len(self.cases)


def _case(item: Any, index: int) -> tuple[str, str]:
    if isinstance(item, dict):
        given = item.get("input", item.get("stdin"))
        expected = item.get("output", item.get("stdout", item.get("expected_output")))
        if given is not None and expected is not None:
            return str(given), str(expected)
    raise ValueError(
        f"Test case {index} is {str(item)[:80]!r}, not a stdin/stdout pair. Write it as "
        '{"input": "...", "output": "..."}.'
    )


def parse_tests(cell: Any, entry_point: str | None = None) -> TestSuite | None:
    """A tests cell as a :class:`TestSuite`, or None when the row has no tests.

    Args:
        cell: A list of assert strings, a test script, a list of ``{"input", "output"}`` dicts,
            a ``{"inputs": [...], "outputs": [...]}`` dict, JSON text of any of these, or
            None/empty.
        entry_point: The function a HumanEval-style ``check(candidate)`` script is called with.

    Raises:
        ValueError: When the cell has another shape.

    Example:
        >>> parse_tests('{"inputs": ["1 2"], "outputs": ["3"]}').cases
        (('1 2', '3'),)
        >>> parse_tests("def check(candidate):\\n    assert candidate(1) == 2", "inc").snippets[0].split()[-1]
        'check(inc)'
    """
    if cell is None or (isinstance(cell, float) and cell != cell):
        return None
    if isinstance(cell, str):
        text = cell.strip()
        if not text:
            return None
        if text[0] in "[{":
            try:
                return parse_tests(json.loads(text), entry_point)
            except json.JSONDecodeError:
                pass  # Python code that starts with a bracket, e.g. a list literal
        if entry_point and re.search(r"^def check\(", cell, re.MULTILINE):
            cell = f"{cell}\n\ncheck({entry_point})\n"
        return TestSuite(snippets=(cell,))
    if isinstance(cell, dict):
        inputs = cell.get("inputs", cell.get("input"))
        outputs = cell.get("outputs", cell.get("output"))
        if isinstance(inputs, list) and isinstance(outputs, list) and len(inputs) == len(outputs):
            cases = tuple((str(i), str(o)) for i, o in zip(inputs, outputs, strict=True))
            return TestSuite(cases=cases) if cases else None
        raise ValueError(
            f"A tests dict needs equally long 'inputs' and 'outputs' lists; got keys {sorted(cell)}. "
            'Write it as {"inputs": [...], "outputs": [...]}.'
        )
    if isinstance(cell, (list, tuple)):
        items = [item for item in cell if not (isinstance(item, str) and not item.strip())]
        if not items:
            return None
        if all(isinstance(item, str) for item in items):
            return TestSuite(snippets=tuple(items))
        return TestSuite(cases=tuple(_case(item, i) for i, item in enumerate(items)))
    raise ValueError(
        f"A tests cell is a {type(cell).__name__}. Use a list of assert strings, a test script, or "
        "stdin/stdout cases (see rewards/code.py)."
    )


def merge_suites(cells: list[Any], entry_point: str | None = None) -> TestSuite | None:
    """The tests of several cells of one row (one per tests column) as one suite; None when none has a test.

    Raises:
        ValueError: When one cell holds asserts or a script and another stdin/stdout cases.

    Example:
        >>> merge_suites([{"input": ["1"], "output": ["1"]}, {"input": [], "output": []}, None]).cases
        (('1', '1'),)
    """
    suites = [suite for suite in (parse_tests(cell, entry_point) for cell in cells) if suite is not None]
    if not suites:
        return None
    snippets = tuple(s for suite in suites for s in suite.snippets)
    cases = tuple(c for suite in suites for c in suite.cases)
    if snippets and cases:
        raise ValueError(
            "A row's tests columns hold both asserts (or a test script) and stdin/stdout cases; a program is "
            "tested one way. Give the reward columns of one kind in tests_column."
        )
    return TestSuite(snippets=snippets, cases=cases)


def same_output(actual: str, expected: str) -> bool:
    """Outputs equal up to trailing whitespace on each line and trailing blank lines.

    Example:
        >>> same_output("3 \\n\\n", "3"), same_output("3", "4")
        (True, False)
    """

    def lines(text: str) -> list[str]:
        rows = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
        while rows and not rows[-1]:
            rows.pop()
        return rows

    return lines(actual) == lines(expected)
