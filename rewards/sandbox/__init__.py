"""Run untrusted Python in a sandbox: one process per program, resource limits, no network.

:func:`run_python_async` (and its blocking twin :func:`run_python`) runs one program in a fresh
interpreter and returns an :class:`ExecutionResult`. The code reward (:mod:`rewards.code`) uses
it to run completions against tests; an agent's "python execution" tool can use it as it is.

What every run gets:

- **separate processes**, killed when the run ends: inside the boundary, forked for the run from a
  pool slot's interpreter (:mod:`rewards.sandbox.pool`, :mod:`rewards.sandbox.zygote`), in ``process``
  mode a fresh ``python -I`` (no user site, no ``PYTHON*`` variables) in its own session; with tests,
  the program and the tests in two processes (:mod:`rewards.sandbox.boot`), so the program cannot
  forge a verdict;
- **a scrubbed environment**: ``PATH``, ``HOME``/``TMPDIR``, a UTF-8 locale and single-thread math
  libraries; nothing from the caller's environment, so no API key or token is inherited;
- **limits** (:class:`Limits`): CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  file size (``RLIMIT_FSIZE``), open files, no core dumps, a wall-clock timeout, and a cap on
  captured stdout and stderr (the process is killed when it writes more);
- **the seccomp filter** (:mod:`rewards.sandbox.seccomp`): no new processes by default (threads are
  fine; a Python audit hook refuses ``os.fork``, ``subprocess`` and ``os.exec*`` first), no
  ``socket()``, no signal or ``prlimit`` aimed at another process, no ``ptrace``, mounts, new
  namespaces, ``setsid`` or io_uring.

Isolation is detected once per process (:func:`rewards.sandbox.isolation.sandbox_isolation`):

``namespaces``
    The boundary (:mod:`rewards.sandbox.bwrap`): bubblewrap per pool slot and fresh namespaces per run
    (:mod:`rewards.sandbox.pool`) with every namespace new, an unprivileged uid that is never the host's root, a minimal read-only root with no host files or secrets, sized
    ``nosuid,nodev`` ``tmpfs`` mounts for the working directory ``/w``, ``/tmp`` and ``/dev/shm``
    (nothing touches the host's disk), and for a root caller cgroups that bound the run's memory and
    tasks.
``process``
    No boundary: where bubblewrap cannot run (not installed, Docker's default seccomp profile,
    user namespaces disabled). The limits and the seccomp filter still hold, the run gets a private
    working directory (``tempfile.mkdtemp``, removed afterwards; a caller killed outright leaves it
    to :func:`sweep_stale_workdirs`), and file writes outside it are refused by the audit hook only.
    The program runs as the caller's user and can read what that user can read. The code reward
    and the Coding Agent only use it when a recipe says ``isolation: unsafe_process``.

Example:
    >>> result = run_python("import sys; print(sum(map(int, sys.stdin.read().split())))", stdin="2 3")
    >>> result.status, result.stdout
    ('ok', '5\\n')
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rewards.sandbox import audit as _audit  # noqa: F401 - compiled here once: boot.py loads the bytecode
from rewards.sandbox import bwrap, pool, slot
from rewards.sandbox import channel as _channel  # noqa: F401 - compiled here once: boot.py loads the bytecode
from rewards.sandbox import seccomp as _seccomp  # noqa: F401 - the same
from rewards.sandbox.isolation import (
    POLICIES,
    Isolation,
    NoBoundaryError,
    auto_fallback,
    boundary_for,
    sandbox_isolation,
)
from rewards.sandbox.result import (
    LIMIT_KINDS,
    ExecutionResult,
    assemble_result,
    parse_reports,
)
from rewards.sandbox.streams import communicate
from rewards.sandbox.workdir import WORKDIR_PREFIX, _remove_tree, sweep_stale_workdirs

__all__ = [
    "ExecutionResult",
    "Isolation",
    "LIMIT_KINDS",
    "NoBoundaryError",
    "POLICIES",
    "boundary_for",
    "Limits",
    "run_python",
    "run_python_async",
    "sandbox_isolation",
    "sweep_stale_workdirs",
]

logger = logging.getLogger(__name__)

BOOT_SCRIPT = Path(__file__).with_name("boot.py")
"""The in-sandbox half (:mod:`rewards.sandbox.boot`), started as a script."""
SETUP_FAILED = 121
"""Exit status of ``boot.py`` when it could not set the sandbox up."""
KILL_GRACE_S = 5.0
"""Seconds to wait for pipes to close after the process group was killed."""

ISOLATIONS = ("auto", "namespaces", "process")
"""What :func:`run_python` accepts (``auto`` falls back to ``process`` where namespaces cannot be made)."""

_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MiB of address space per arena: threads would exhaust RLIMIT_AS
}


MAX_FILE_MB = 1 << 20
"""The largest ``max_file_mb``: each of a run's ``tmpfs`` mounts is sized by it."""


@dataclass(frozen=True)
class Limits:
    """Resource limits for one sandboxed run.

    Attributes:
        cpu_s: CPU seconds (user + system) before ``SIGXCPU``; the hard limit is one more second.
        memory_mb: Address-space limit in MiB (``RLIMIT_AS``); a bigger allocation raises
            ``MemoryError``.
        max_processes: 1 (default) forbids new processes (seccomp and the audit hook; threads are
            fine). Above 1, processes are allowed and ``RLIMIT_NPROC`` caps processes and threads
            at this number, which the kernel enforces only for a non-root user; as root, only the
            wall-clock timeout and the PID namespace bound them.
        max_output_bytes: Bytes kept from stdout and from stderr each; writing more kills the run.
        max_file_mb: Largest file the program may write (``RLIMIT_FSIZE``), and the size of each
            private temp mount, in MiB.
        max_open_files: Open file descriptors (``RLIMIT_NOFILE``).

    Example:
        >>> Limits(cpu_s=2, memory_mb=256).memory_mb
        256
    """

    cpu_s: float = 10.0
    memory_mb: int = 1024
    max_processes: int = 1
    max_output_bytes: int = 1_000_000
    max_file_mb: int = 64
    max_open_files: int = 256

    def __post_init__(self) -> None:
        for name, minimum in (
            ("cpu_s", 0.1),
            ("memory_mb", 64),
            ("max_processes", 1),
            ("max_output_bytes", 1),
            ("max_file_mb", 1),
            ("max_open_files", 16),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
                raise ValueError(
                    f"Sandbox limit {name}={value!r} is too small or not a number. Use {minimum} or more."
                )
        if self.max_file_mb > MAX_FILE_MB:
            raise ValueError(
                f"Sandbox limit max_file_mb={self.max_file_mb!r} is more than a run's mounts can have. "
                f"Use at most {MAX_FILE_MB} (1 TiB)."
            )


def _kill_group(process: asyncio.subprocess.Process) -> None:
    """SIGKILL the run's process group, unless the process was already reaped (its pid could be reused)."""
    if process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(process.pid, signal.SIGKILL)


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
    namespaces = isolation == "namespaces"
    start = time.perf_counter()
    stdin_bytes = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
    nonce = secrets.token_hex(16)
    config = {  # what the program's process may see
        "program": code,
        "testing": tests is not None,
        "limits": asdict(limits),
        "namespaces": namespaces,
        "seccomp": seccomp,
        "site_packages": slot.site_packages(),
    }
    verdict = {  # the tests' process only
        "nonce": nonce,
        "tests": list(tests) if tests is not None else None,
        "setup": setup,
    }
    if namespaces:
        env = {**_SANDBOX_ENV, "HOME": bwrap.WORKDIR, "TMPDIR": "/tmp"}
        try:
            outcome = await pool.run(
                config,
                json.dumps(verdict),
                stdin_bytes,
                timeout_s,
                limits.memory_mb,
                limits.max_file_mb,
                limits.max_output_bytes,
                env,
            )
        except pool.SlotError as exc:
            return ExecutionResult(None, sandbox_error=str(exc), isolation=isolation)
    else:
        outcome = await _run_process(config, verdict, stdin_bytes, timeout_s, limits)
        if isinstance(outcome, ExecutionResult):
            return outcome
    reports = parse_reports(outcome.reports, nonce)
    if outcome.oom_killed:
        reports.append(("limit", "memory"))
    return assemble_result(
        reports,
        outcome.returncode,
        outcome.stdout,
        outcome.stderr,
        outcome.timed_out,
        outcome.overflow,
        len(verdict["tests"]) if tests is not None else None,
        limits.cpu_s,
        namespaces,
        start,
    )


async def _run_process(
    config: dict, verdict: dict, stdin: bytes | None, timeout_s: float, limits: Limits
) -> pool.Outcome | ExecutionResult:
    """A run as a plain process (``isolation="process"``) in a private working directory on the host."""
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    files = {
        "main.py": config["program"],
        ".sandbox.json": json.dumps(config),
        ".verdict.json": json.dumps(verdict),
    }
    for name, text in files.items():
        Path(workdir, name).write_bytes(text.encode("utf-8", "replace"))
    # -S: no site processing (scanning every dist's .pth costs ~50 ms a run); boot.py puts site-packages
    # on sys.path itself, so a program can still import the virtualenv's packages.
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", str(BOOT_SCRIPT), f"{workdir}/.sandbox.json"]
    pipes = [os.pipe() for _ in range(4)]  # stdin, stdout, stderr, result
    (stdin_read, stdin_write), (out_read, out_write), (err_read, err_write), (result_read, result_write) = (
        pipes
    )
    process: asyncio.subprocess.Process | None = None
    try:
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                str(result_write),
                stdin=stdin_read,
                stdout=out_write,
                stderr=err_write,
                cwd=workdir,
                env={**_SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir},
                pass_fds=(result_write,),
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (stdin_write, out_read, err_read, result_read):
                os.close(fd)
            return ExecutionResult(None, sandbox_error=f"cannot start {argv[0]}: {exc}", isolation="process")
        finally:
            for fd in (stdin_read, out_write, err_write, result_write):
                os.close(fd)
        stdout, stderr, reports, timed_out, overflow, returncode = await communicate(
            [stdin_write, out_read, err_read, result_read],
            stdin,
            timeout_s,
            limits.max_output_bytes,
            process.wait,
            functools.partial(_kill_group, process),
            KILL_GRACE_S,
        )
        return pool.Outcome(returncode, stdout, stderr, reports, timed_out, overflow)
    finally:
        if process is not None:
            _kill_group(process)
        _remove_tree(workdir)


def run_python(
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
    """Blocking :func:`run_python_async` (same arguments); safe to call inside a running event loop.

    Example:
        >>> run_python("print(1 / 0)", timeout_s=5).status
        'error'
    """
    coroutine = run_python_async(
        code, stdin, tests=tests, setup=setup, timeout_s=timeout_s, limits=limits, isolation=isolation,
        seccomp=seccomp,
    )  # fmt: skip
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
