"""Run untrusted Python in the sandbox: :func:`run_python_async` and its blocking twin :func:`run_python`
(what the package's face, :mod:`rewards.sandbox`, hands on). ``isolation="auto"`` is chosen here, from
:func:`rewards.sandbox.isolation.sandbox_isolation`; the run itself is :func:`rewards.sandbox.execute.execute`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from rewards.sandbox.execute import ISOLATIONS, Limits, execute, run_blocking
from rewards.sandbox.isolation import auto_fallback, sandbox_isolation
from rewards.sandbox.result import ExecutionResult


async def run_python_async(
    code: str,
    stdin: str | bytes | None = None,
    *,
    tests: Sequence[str] | None = None,
    setup: str | None = None,
    timeout_s: float = 10.0,
    limits: Limits | None = None,
    isolation: str = "auto",
    seccomp: bool = True,
) -> ExecutionResult:
    """Run ``code`` as ``__main__`` in a sandbox and wait for it without blocking the event loop.

    Args:
        code: The program's source.
        stdin: Text or bytes for its standard input (empty when None).
        tests: Snippets run one by one after ``code`` (e.g. ``assert`` lines); ``code`` then runs as
            module ``solution``, so its ``__main__`` block does not run. The tests run in a process of
            their own that never executes the program's code and sees its globals through
            :mod:`rewards.sandbox.channel` (plain values only). A test passes when it runs to its end;
            the tests' process reports each pass on a private pipe with a random nonce the program's
            process never holds. With tests, the exit status is 0 only when every test passed.
        setup: Code the tests' process runs before the tests, in their namespace (e.g. MBPP's
            ``test_setup_code``): the program can neither see nor rewrite what it defines. Needs ``tests``.
        timeout_s: Wall-clock seconds before the process group is killed.
        limits: Resource limits; :class:`Limits` defaults when None.
        isolation: ``auto`` (namespaces when :func:`sandbox_isolation` finds them), ``namespaces``
            or ``process``.
        seccomp: Install the seccomp filter. Turn it off only to test the other layers.

    Returns:
        The :class:`ExecutionResult`. A sandbox that fails to start gives ``sandbox_error``;
        nothing here raises for what the program does.

    Raises:
        ValueError: For an unknown ``isolation`` or a non-positive ``timeout_s``.

    Example:
        >>> import asyncio
        >>> result = asyncio.run(run_python_async("def f(x):\\n    return 2 * x", tests=["assert f(2) == 4",
        ...                                       "assert f(2) == 5"]))
        >>> result.tests_passed, result.status
        ((True, False), 'error')
    """
    if isolation not in ISOLATIONS:
        raise ValueError(f"Unknown sandbox isolation {isolation!r}. Use one of: {', '.join(ISOLATIONS)}.")
    if setup is not None and tests is None:
        raise ValueError("Sandbox setup runs in the tests' process: give tests too (or put it in the code).")
    if not timeout_s > 0:
        raise ValueError(
            f"Sandbox timeout_s={timeout_s!r} is not positive. Give a number of seconds above 0."
        )
    limits = limits or Limits()
    if isolation == "auto":
        found = await asyncio.to_thread(sandbox_isolation)
        if not found.namespaces and (refused := auto_fallback(found)) is not None:
            return ExecutionResult(None, sandbox_error=refused, isolation="auto")
        isolation = "namespaces" if found.namespaces else "process"
    return await execute(
        code, stdin, tests=tests, setup=setup, timeout_s=timeout_s, limits=limits, isolation=isolation,
        seccomp=seccomp,
    )  # fmt: skip


def run_python(code: str, stdin: str | bytes | None = None, **options: Any) -> ExecutionResult:
    """Blocking :func:`run_python_async` (same arguments); safe to call inside a running event loop.

    Example:
        >>> run_python("print(1 / 0)", timeout_s=5).status
        'error'
    """
    return run_blocking(run_python_async(code, stdin, **options))
