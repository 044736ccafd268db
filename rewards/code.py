r"""Code-execution reward: run the program in a completion against the row's tests, in a sandbox.

For each completion the reward takes the program (by default the last fenced Python code block,
see :func:`extract_code`), runs it with the row's tests in :mod:`rewards.sandbox`, and returns
the fraction of tests that passed (or 1.0 only when all passed, with ``all_or_nothing``).

Row columns (``tests_column``, default ``tests``, or a list of columns whose tests all run — CodeContests'
hidden ``[private_tests, generated_tests]``; one of these shapes per cell):

==================================== ==========================================================
``["assert f(1) == 2", ...]``        assert-style tests (MBPP's ``test_list``): each string runs
                                     after the program, against its globals; one test each
``"def check(candidate): ..."``      one test script run after the program (HumanEval's
                                     ``test``); with an ``entry_point`` column it ends with
                                     ``check(<entry_point>)``
``[{"input": "1 2\n", "output":      stdin/stdout tests: the program runs once per case with that
"3\n"}, ...]``                       stdin; it passes when it exits 0 and its output matches
``{"inputs": [...], "outputs":       the same, APPS/CodeContests style
[...]}``
==================================== ==========================================================

With asserts or a test script the program runs as module ``solution`` (its ``if __name__ ==
"__main__":`` block stays quiet, as in the HumanEval and MBPP harnesses) and the tests run in a
separate process that never executes the program's code: they call its functions through a channel
that carries plain values only (:mod:`rewards.sandbox.channel`), so the program cannot forge a
verdict. With stdin/stdout cases it runs as ``__main__`` and its output is compared here.

A string holding JSON (``"[...]"`` or ``"{...}"``) is decoded first, so datasets that store
tests as JSON text work. Outputs match when they are equal after stripping trailing whitespace
from every line and trailing blank lines. ``setup_column`` (e.g. MBPP's ``test_setup_code``)
holds code run before the tests in the tests' process (after the program, for stdin cases), where
the program can neither see nor rewrite what it defines.

Per completion the reward is None when the row has no tests (missing, empty) or when the
sandbox itself failed (logged); 0.0 when the completion has no code; otherwise passed / total.
A malformed tests cell raises ``ValueError``.

Sandbox settings (``timeout_s``, ``cpu_s``, ``memory_mb``, ``max_output_bytes``) apply to each
run; at most ``concurrency`` runs go at once per reward, also across calls that overlap on one
event loop (async GRPO scores several groups at once). The reward is async: TRL runs it on its
event-loop thread, so the runs do not block the trainer.

Metrics through ``log_metric`` (per run unless noted): ``<name>/pass_rate`` (mean fraction per
scored completion), ``<name>/no_code_rate`` (per completion), ``<name>/timeout_rate``,
``<name>/crash_rate`` (the program raised or died before its tests), ``<name>/cpu_limit_rate``,
``<name>/memory_limit_rate``, ``<name>/process_limit_rate``, ``<name>/output_limit_rate``,
``<name>/network_attempt_rate``, ``<name>/sandbox_error_rate``, ``<name>/run_latency_s`` (mean)
and ``<name>/batch_latency_s``.

Example:
    >>> import asyncio
    >>> reward = make_code_execution_reward(timeout_s=5)
    >>> completion = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    >>> asyncio.run(reward(prompts=["q", "q"], completions=[completion, "no code"],
    ...                    tests=[["assert add(1, 2) == 3", "assert add(2, 2) == 5"], ["assert True"]]))
    [0.5, 0.0]
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from rewards.code_tests import TestSuite, merge_suites, same_output
from rewards.interface import Reward, column, completion_text
from rewards.registry import RewardConfigError
from rewards.sandbox import ExecutionResult, Limits, boundary_for, run_python_async

logger = logging.getLogger(__name__)

CODE_BLOCKS = ("last", "first", "all", "none")
"""``code_block`` choices: which fenced block(s) hold the program, or ``none`` for the whole text."""
PYTHON_TAGS = frozenset({"", "python", "py", "python3", "py3"})
"""Fence languages read as Python (an untagged fence counts)."""

_FENCE = re.compile(r"^[ \t]*```[ \t]*([\w+#.-]*)[^\n]*\n(.*?)^[ \t]*```", re.MULTILINE | re.DOTALL)
_LIMIT_METRICS = {
    "cpu_time": "cpu_limit_rate",
    "memory": "memory_limit_rate",
    "processes": "process_limit_rate",
    "output": "output_limit_rate",
    "network": "network_attempt_rate",
}


def after_thinking(text: str) -> str | None:
    """The answer part of a completion: the text after the last ``</think>``.

    Returns the text unchanged when it has no ``<think>``, and None when a ``<think>`` is never
    closed (the completion was cut off while thinking, so it has no answer).

    Example:
        >>> after_thinking("<think>try x</think>final"), after_thinking("<think>still going") is None
        ('final', True)
    """
    head, sep, tail = text.rpartition("</think>")
    if sep:
        return tail
    return None if "<think>" in text else text


def extract_code(text: str, code_block: str = "last") -> str | None:
    """The program in ``text``: fenced Python code blocks (```` ```python ````, ```` ```py ````
    or untagged) chosen by ``code_block``, or the whole text with ``none``.

    Args:
        text: The completion's answer text.
        code_block: ``last`` (default), ``first``, ``all`` (every Python block, joined by blank
            lines, in order) or ``none``.

    Returns:
        The code, or None when there is none (no closed Python block, or an empty text).

    Example:
        >>> extract_code("```python\\nx = 1\\n```\\nthen\\n```\\nprint(x)\\n```", "all")
        'x = 1\\n\\n\\nprint(x)\\n'
    """
    if code_block == "none":
        return text if text.strip() else None
    blocks = [body for language, body in _FENCE.findall(text) if language.lower() in PYTHON_TAGS]
    blocks = [body for body in blocks if body.strip()]
    if not blocks:
        return None
    if code_block == "first":
        return blocks[0]
    if code_block == "all":
        return "\n\n".join(blocks)
    return blocks[-1]


@dataclass
class _Outcome:
    """One completion's score and the sandbox runs behind it."""

    score: float | None
    runs: list[ExecutionResult]
    has_code: bool = True


@dataclass(eq=False, kw_only=True)
class CodeExecutionReward(Reward):
    """A picklable async code-execution reward; build it with :func:`make_code_execution_reward`."""

    tests_column: str | list[str]
    setup_column: str | None
    entry_point_column: str | None
    code_block: str
    all_or_nothing: bool
    timeout_s: float
    limits: Limits
    concurrency: int
    isolation: str
    _semaphores: weakref.WeakKeyDictionary = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_semaphores"] = None  # bound to event loops; rebuilt after unpickling
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._semaphores = weakref.WeakKeyDictionary()

    def _semaphore(self) -> asyncio.Semaphore:
        """The bound on sandbox runs, shared by every call of this reward on the running loop."""
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.concurrency)
        return self._semaphores[loop]

    def required_columns(self) -> set[str]:
        """Dataset columns this reward reads (for the recipe dry-run); ``entry_point`` is optional."""
        return set(self._tests_columns) | ({self.setup_column} if self.setup_column else set())

    @property
    def _tests_columns(self) -> list[str]:
        return [self.tests_column] if isinstance(self.tests_column, str) else list(self.tests_column)

    def _suites(self, kwargs: dict[str, Any], n: int) -> list[list[Any]] | None:
        """Per row, its tests cells (one per tests column), or None when a column is missing (logged once)."""
        columns = []
        for name in self._tests_columns:
            cells = self.column_or_abstain(kwargs, name, n, holds="tests", option="tests_column")
            if cells is None:
                return None
            columns.append(cells)
        return [list(row) for row in zip(*columns, strict=True)]

    async def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        """Score a batch: passed / total tests per completion (see the module docstring)."""
        n = len(completions)
        applies = self.applies(kwargs, n)
        cells = self._suites(kwargs, n)
        if cells is None:
            return [None] * n
        setups = column(kwargs, self.setup_column, n) if self.setup_column else None
        entry_points = column(kwargs, self.entry_point_column, n) if self.entry_point_column else None
        start = time.perf_counter()
        semaphore = self._semaphore()
        jobs = []
        for i in range(n):
            entry_point = entry_points[i] if entry_points is not None else None
            suite = merge_suites(cells[i], str(entry_point) if entry_point else None) if applies[i] else None
            setup = setups[i] if setups is not None else None
            jobs.append(self._score(semaphore, completions[i], suite, setup))
        outcomes = await asyncio.gather(*jobs)
        self._report(outcomes, time.perf_counter() - start, kwargs)
        return [outcome.score for outcome in outcomes]

    async def _score(
        self, semaphore: asyncio.Semaphore, completion: Any, suite: TestSuite | None, setup: Any
    ) -> _Outcome:
        if suite is None or len(suite) == 0:
            return _Outcome(None, [])
        answer = after_thinking(completion_text(completion))
        code = extract_code(answer, self.code_block) if answer is not None else None
        if code is None:
            return _Outcome(0.0, [], has_code=False)
        setup = setup if isinstance(setup, str) and setup.strip() else None
        runs: list[ExecutionResult] = []
        passed = 0
        if suite.snippets:
            async with semaphore:
                result = await run_python_async(
                    code,
                    tests=suite.snippets,
                    setup=setup,  # on the tests' side: the program cannot rewrite the helpers they call
                    timeout_s=self.timeout_s,
                    limits=self.limits,
                    isolation=self.isolation,
                )
            runs.append(result)
            passed += sum(result.tests_passed or ())

        script = f"{code}\n\n{setup}\n" if setup else code  # a stdin/stdout case has no tests' side

        async def case(stdin: str) -> ExecutionResult:
            async with semaphore:
                return await run_python_async(
                    script, stdin, timeout_s=self.timeout_s, limits=self.limits, isolation=self.isolation
                )

        case_runs = await asyncio.gather(*(case(stdin) for stdin, _ in suite.cases))
        for (_, expected), result in zip(suite.cases, case_runs, strict=True):
            runs.append(result)
            passed += result.ok and same_output(result.stdout, expected)
        if any(run.sandbox_error is not None for run in runs):
            return _Outcome(None, runs)
        fraction = passed / len(suite)
        return _Outcome(float(fraction == 1.0) if self.all_or_nothing else fraction, runs)

    def _report(self, outcomes: list[_Outcome], latency: float, kwargs: dict[str, Any]) -> None:
        """Log sandbox failures and send the run statistics to the trainer."""
        runs = [run for outcome in outcomes for run in outcome.runs]
        errors = [run.sandbox_error for run in runs if run.sandbox_error is not None]
        if errors:
            logger.warning(
                "Reward %s: the sandbox failed in %d of %d runs; those samples get None. First error: %s",
                self.__name__,
                len(errors),
                len(runs),
                errors[0],
            )
        log_metric = kwargs.get("log_metric")
        attempted = [outcome for outcome in outcomes if outcome.runs or not outcome.has_code]
        if not callable(log_metric) or not attempted:
            return
        scored = [outcome.score for outcome in attempted if outcome.score is not None]
        if scored:
            log_metric(f"{self.__name__}/pass_rate", sum(scored) / len(scored))
        log_metric(f"{self.__name__}/no_code_rate", sum(not o.has_code for o in attempted) / len(attempted))
        log_metric(f"{self.__name__}/batch_latency_s", latency)
        if not runs:
            return
        total = len(runs)
        log_metric(f"{self.__name__}/timeout_rate", sum("wall_time" in r.limits_hit for r in runs) / total)
        log_metric(f"{self.__name__}/crash_rate", sum(_crashed(r) for r in runs) / total)
        for kind, metric in _LIMIT_METRICS.items():
            log_metric(f"{self.__name__}/{metric}", sum(kind in r.limits_hit for r in runs) / total)
        log_metric(f"{self.__name__}/sandbox_error_rate", len(errors) / total)
        log_metric(f"{self.__name__}/run_latency_s", sum(r.wall_s for r in runs) / total)


def _crashed(run: ExecutionResult) -> bool:
    """The program itself failed: raised or died before its tests, or a script run exited non-zero."""
    if run.status != "error":
        return False
    return run.loaded is False if run.loaded is not None else True


def make_code_execution_reward(
    tests_column: str | list[str] = "tests",
    setup_column: str | None = None,
    entry_point_column: str | None = "entry_point",
    code_block: str = "last",
    all_or_nothing: bool = False,
    timeout_s: float = 10.0,
    cpu_s: float = 5.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 100_000,
    concurrency: int | None = None,
    isolation: str = "auto",
    only_label: str | None = None,
    name: str | None = None,
) -> CodeExecutionReward:
    r"""Build the code-execution reward (YAML: ``{factory: code_execution, ...}``).

    Args:
        tests_column: The column holding each row's tests (shapes in the module docstring), or a list of
            columns whose tests all run (CodeContests' hidden tests: ``[private_tests, generated_tests]``).
            Reward tests the prompt does not show: a program that prints the shown outputs passes shown
            tests (``--dry_run`` warns when a tests column is in the prompt).
        setup_column: A column of code run before the tests (e.g. MBPP's ``test_setup_code``), in the
            tests' process, so the program cannot rewrite the helpers it defines (for stdin/stdout cases,
            after the program); None for none.
        entry_point_column: The column naming the function a HumanEval ``check(candidate)``
            script tests; read when the batch has it.
        code_block: Which fenced Python block is the program: ``last``, ``first``, ``all``, or
            ``none`` (the whole completion).
        all_or_nothing: 1.0 only when every test passes, else 0.0 (default: the fraction passed).
        timeout_s: Wall-clock seconds per sandbox run.
        cpu_s: CPU seconds per sandbox run.
        memory_mb: Address-space limit per run, in MiB.
        max_output_bytes: Captured stdout/stderr per run; more kills the run.
        concurrency: Sandbox runs at once for this reward (calls overlapping on one event loop
            share the bound); default ``min(8, CPU count)``.
        isolation: ``auto`` or ``namespaces`` (the namespace boundary; where this machine cannot build it,
            the reward refuses to start), or ``unsafe_process`` (no boundary, a warning at every start); see
            :func:`rewards.sandbox.boundary_for`.
        only_label: Score only rows whose ``label`` equals this; others get None.
        name: The reward's ``__name__`` (TRL's metric prefix); default ``code_execution``.

    Returns:
        A picklable async callable with TRL's reward signature.

    Raises:
        RewardConfigError: For an unknown ``code_block`` or ``isolation``, no sandbox boundary (see
            ``isolation``), or a non-positive number.

    Example:
        >>> reward = make_code_execution_reward(tests_column="test_list", all_or_nothing=True)
        >>> reward.required_columns(), reward.__name__
        ({'test_list'}, 'code_execution')
    """
    try:
        isolation = boundary_for(isolation, f"code reward {name or 'code_execution'!r}")
    except ValueError as exc:
        raise RewardConfigError(str(exc)) from None
    columns = [tests_column] if isinstance(tests_column, str) else tests_column
    if (
        not isinstance(columns, (list, tuple))
        or not columns
        or not all(isinstance(c, str) and c for c in columns)
    ):
        raise RewardConfigError(
            f"Code reward option tests_column={tests_column!r} is neither a column name nor a list of column "
            "names. Write e.g. tests_column: tests, or tests_column: [private_tests, generated_tests]."
        )
    if code_block not in CODE_BLOCKS:
        raise RewardConfigError(f"Unknown code_block {code_block!r}. Use one of: {', '.join(CODE_BLOCKS)}.")
    if concurrency is None:
        concurrency = max(1, min(8, os.cpu_count() or 1))
    for option, value in (("timeout_s", timeout_s), ("concurrency", concurrency)):
        if not value > 0:
            raise RewardConfigError(
                f"Code reward option {option}={value!r} is not positive. Give a number above 0."
            )
    try:
        limits = Limits(cpu_s=cpu_s, memory_mb=memory_mb, max_output_bytes=max_output_bytes)
    except ValueError as exc:
        raise RewardConfigError(f"Code reward limits are invalid: {exc}") from exc
    return CodeExecutionReward(
        tests_column=tests_column if isinstance(tests_column, str) else list(tests_column),
        setup_column=setup_column,
        entry_point_column=entry_point_column,
        code_block=code_block,
        all_or_nothing=all_or_nothing,
        timeout_s=timeout_s,
        limits=limits,
        concurrency=concurrency,
        isolation=isolation,
        only_label=only_label,
        name=name or "code_execution",
    )
