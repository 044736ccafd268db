"""Coding Agent environment: a Python execution tool that runs in the coding reward's sandbox.

``run_python(code, stdin)`` runs the program with :func:`rewards.sandbox.run_python_async` (a
fresh interpreter per call, resource limits, no network, no new processes; see
``docs/rewards.md``) and returns its status, stdout and stderr, each cut to
``max_output_chars``. What the program does (an exception, a timeout, a memory limit) is a normal
tool result the model can read and fix; only a sandbox that cannot start raises, which reaches
the model as a tool error. Each call starts clean: nothing carries over between calls, so the
model resends the definitions it needs.

Pair it with the code-execution reward on the row's tests (``{factory: code_execution}``): the
reward runs the last fenced Python block of the final answer, not the tool calls.

Example:
    >>> import asyncio
    >>> print(asyncio.run(CodingEnvironment(timeout_s=5).run_python("print(6 * 7)")))
    status: ok (exit code 0)
    stdout:
    42
    <BLANKLINE>
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dna_factory.agents.environment import Environment, tool
from dna_factory.errors import DnaConfigError
from rewards.sandbox import BOOT_SCRIPT, Limits, boundary_for, run_python_async


def _without_sandbox_frames(stderr: str) -> str:
    """A traceback without the frames of the sandbox's own boot script (the model did not write them)."""

    kept, skipping = [], False
    for line in stderr.splitlines(keepends=True):
        if line.startswith('  File "'):
            skipping = str(BOOT_SCRIPT) in line
        elif not line.startswith("    "):
            skipping = False
        if not skipping:
            kept.append(line)
    return "".join(kept)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}\n... [{len(text) - limit} more characters cut]"


class CodingEnvironment(Environment):
    """Python execution in the sandbox.

    Args:
        timeout_s: Wall-clock seconds per run.
        cpu_s: CPU seconds per run.
        memory_mb: Address-space limit per run, in MiB.
        max_output_chars: Characters of stdout and of stderr shown to the model, each.
        isolation: ``auto`` or ``namespaces`` (refuses to start where no boundary can be built), or
            ``unsafe_process`` (no boundary; a warning at every start). See ``rewards.sandbox.boundary_for``.
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        cpu_s: float = 5.0,
        memory_mb: int = 1024,
        max_output_chars: int = 2000,
        isolation: str = "auto",
    ) -> None:
        self.check_options(
            dict(timeout_s=timeout_s, cpu_s=cpu_s, memory_mb=memory_mb, max_output_chars=max_output_chars,
                 isolation=isolation)
        )  # fmt: skip
        self.timeout_s = timeout_s
        self.limits = Limits(
            cpu_s=cpu_s, memory_mb=memory_mb, max_output_bytes=max(4 * max_output_chars, 4096)
        )
        self.max_output_chars = max_output_chars
        self.isolation = self._boundary(isolation)

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:

        cls._boundary(options.get("isolation", "auto"))
        for key in ("timeout_s", "max_output_chars"):
            if key in options and not options[key] > 0:
                raise DnaConfigError(f"environment_options.{key} must be above 0, not {options[key]!r}.")
        try:
            Limits(cpu_s=options.get("cpu_s", 5.0), memory_mb=options.get("memory_mb", 1024))
        except ValueError as exc:
            raise DnaConfigError(f"environment_options: {exc}") from None

    @staticmethod
    def _boundary(isolation: str) -> str:
        """The sandbox isolation for ``environment_options.isolation``, failing closed (``rewards.sandbox.boundary_for``)."""

        try:
            return boundary_for(isolation, "the Coding Agent (environment_options.isolation)")
        except ValueError as exc:
            raise DnaConfigError(str(exc)) from None

    @tool
    async def run_python(self, code: str, stdin: str = "") -> str:
        """Run a Python program in a sandbox and return its status, stdout and stderr.

        Args:
            code: The complete program. Nothing is kept between calls, so include every definition it uses.
            stdin: Text given to the program on standard input.
        """

        result = await run_python_async(
            code, stdin or None, timeout_s=self.timeout_s, limits=self.limits, isolation=self.isolation
        )
        if result.status == "sandbox_error":
            raise RuntimeError(f"the sandbox could not start: {result.sandbox_error}")
        exit_text = (
            f"exit code {result.exit_code}" if result.exit_code is not None else f"signal {result.signal}"
        )
        parts = [f"status: {result.status} ({exit_text})"]
        if result.stdout:
            parts.append(f"stdout:\n{_cut(result.stdout, self.max_output_chars)}")
        if result.stderr:
            parts.append(f"stderr:\n{_cut(_without_sandbox_frames(result.stderr), self.max_output_chars)}")
        if not result.stdout and not result.stderr:
            parts.append("(no output)")
        return "\n".join(parts)
