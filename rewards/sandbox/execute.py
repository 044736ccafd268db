"""One sandboxed run under a known isolation: the run's limits, its configuration for ``boot.py``, and the
two ways to start it (a pool slot inside the boundary, or a plain ``python -I`` process).

:mod:`rewards.sandbox.run` (the public :func:`~rewards.sandbox.run.run_python`) chooses the isolation and
calls :func:`execute`; :mod:`rewards.sandbox.isolation` runs its probe through it too.
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

import rewards.sandbox.audit as _audit  # noqa: F401 - compiled here once: boot.py loads the bytecode
import rewards.sandbox.bwrap as bwrap
import rewards.sandbox.channel as _channel  # noqa: F401 - compiled here once: boot.py loads the bytecode
import rewards.sandbox.pool as pool
import rewards.sandbox.seccomp as _seccomp  # noqa: F401 - the same
import rewards.sandbox.slot as slot
import rewards.sandbox.supervisor as _supervisor  # noqa: F401 - the same
import rewards.sandbox.trusted as _trusted  # noqa: F401 - the same
from rewards.sandbox.result import (
    ExecutionResult,
    assemble_result,
    parse_reports,
)
from rewards.sandbox.streams import communicate
from rewards.sandbox.workdir import WORKDIR_PREFIX, _remove_tree

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


async def execute(
    code: str,
    stdin: str | bytes | None,
    *,
    tests: Sequence[str] | None,
    setup: str | None,
    timeout_s: float,
    limits: Limits,
    isolation: str,
    seccomp: bool,
) -> ExecutionResult:
    """One run under a known isolation (``namespaces`` or ``process``); arguments as
    :func:`rewards.sandbox.run.run_python_async`, already checked. The isolation probe runs its probe through
    this, so it never asks for the isolation it is finding."""
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


def run_blocking(coroutine):
    """Run ``coroutine`` to its end from synchronous code, even inside a running event loop (on a thread)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
