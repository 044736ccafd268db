"""Run untrusted Python in a sandbox: one process per program, resource limits, no network.

:func:`run_python_async` (and its blocking twin :func:`run_python`) runs one program in a fresh
interpreter and returns an :class:`ExecutionResult`. The code reward (:mod:`rewards.code`) uses
it to run completions against tests; an agent's "python execution" tool can use it as it is.

What every run gets:

- **a separate process** (``python -I``: no user site, no ``PYTHON*`` variables) started in its
  own session, killed as a process group when the run ends;
- **a private working directory** (``tempfile.mkdtemp``), removed afterwards, also when the run
  fails or the caller is cancelled (a caller killed outright leaves it to
  :func:`sweep_stale_workdirs`);
- **a scrubbed environment**: ``PATH``, ``HOME``/``TMPDIR`` (the working directory), a UTF-8
  locale and single-thread math libraries; nothing from the caller's environment, so no API key
  or token is inherited;
- **limits** (:class:`Limits`): CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  file size (``RLIMIT_FSIZE``), open files, no core dumps, a wall-clock timeout, and a cap on
  captured stdout and stderr (the process is killed when it writes more);
- **no new processes** by default: a seccomp filter refuses ``fork``/``clone`` (threads are
  fine), and a Python audit hook refuses ``os.fork``, ``subprocess`` and ``os.exec*``;
- **no network and no signals to other processes**: the seccomp filter refuses ``socket()``,
  ``kill()`` of any other process, ``ptrace``, mounts, new namespaces, ``setsid`` and io_uring.

Isolation is detected once per process (:func:`rewards.sandbox.isolation.sandbox_isolation`):

``namespaces``
    The run starts under ``unshare --net --pid --mount-proc --fork`` (util-linux; plus
    ``--user --map-root-user`` when not root): a fresh network namespace with only a loopback
    that is down, a PID namespace whose processes all die with the run and which cannot see or
    signal the caller, and a mount namespace where every mount is read-only, ``/tmp``,
    ``/var/tmp`` and ``/dev/shm`` are private ``tmpfs`` mounts, and only the working directory is
    writable. The program runs as root of the namespace with every capability dropped.
``process``
    The fallback where namespaces cannot be created (e.g. Docker's default seccomp profile, or
    unprivileged user namespaces disabled). The limits and the seccomp filter still hold (no
    sockets, no processes, no signals to others); file writes outside the working directory are
    refused by the audit hook only, and ``ctypes`` is refused so that the hook holds. The program
    runs as the caller's user and can read what that user can read. Running the trainer in a
    container or VM covers the rest.

Example:
    >>> result = run_python("import sys; print(sum(map(int, sys.stdin.read().split())))", stdin="2 3")
    >>> result.status, result.stdout
    ('ok', '5\\n')
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from rewards.sandbox import channel as _channel  # noqa: F401 - compiled here once: boot.py loads the bytecode
from rewards.sandbox import seccomp as _seccomp  # noqa: F401 - the same
from rewards.sandbox.isolation import (
    POLICIES,
    Isolation,
    NoBoundaryError,
    boundary_for,
    namespace_command,
    sandbox_isolation,
)
from rewards.sandbox.result import (
    LIMIT_KINDS,
    MAX_REPORT_BYTES,
    ExecutionResult,
    assemble_result,
    parse_reports,
)

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

WORKDIR_PREFIX = "dna-sandbox-"
"""Working directories are ``<tempdir>/dna-sandbox-<caller pid>-<random>``."""
ISOLATIONS = ("auto", "namespaces", "process")
"""What :func:`run_python` accepts (``auto`` falls back to ``process`` where namespaces cannot be made)."""

_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


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


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # already gone
        os.killpg(pid, signal.SIGKILL)


def _open_up(top: str) -> None:
    """Give the owner ``rwx`` on every directory under ``top`` (a program may have locked some), never following
    a link: each directory is opened with ``O_NOFOLLOW`` and changed through that descriptor, so nothing outside
    the tree changes. Runs after the program's processes are dead, so the tree no longer moves."""
    stack = [top]
    while stack:
        path = stack.pop()
        try:
            handle = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # a link or a file (rmtree unlinks it without following), or gone
        try:
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IRWXU)  # the opened directory itself, not a path
            with os.scandir(f"/proc/self/fd/{handle}") as entries:
                names = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
        except OSError:
            names = []
        finally:
            os.close(handle)
        stack.extend(os.path.join(path, name) for name in names)


def _remove_tree(path: str) -> None:
    """Delete a working directory, even parts the program locked; never follows a link, never raises.

    ``shutil.rmtree`` itself never follows links (it works through directory descriptors); what it cannot
    delete is logged, not raised: a leftover directory must not fail the reward of a whole batch.
    """
    try:
        if not os.path.lexists(path):
            return
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
        _open_up(path)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            logger.warning("Could not delete the sandbox working directory %s; delete it by hand.", path)
    except Exception as exc:  # noqa: BLE001 - cleanup must never fail a reward
        logger.warning("Could not delete the sandbox working directory %s: %s", path, exc)


def sweep_stale_workdirs() -> int:
    """Delete working directories left by callers that were killed mid-run; return how many.

    A run removes its own directory; only a caller killed outright (``SIGKILL``, the OOM killer)
    leaves one behind. Its processes die with it, and the first :func:`sandbox_isolation` of a
    later process calls this to delete directories of ours whose caller PID no longer exists.

    Example:
        >>> sweep_stale_workdirs() >= 0
        True
    """
    removed = 0
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        pid = path.name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        try:
            info = path.lstat()  # the entry itself: a link planted under our name is not ours to follow
            if not pid.isdigit() or info.st_uid != os.geteuid() or not stat.S_ISDIR(info.st_mode):
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove_tree(str(path))
            removed += 1
        except OSError:
            continue  # alive (another user's process) or vanished meanwhile
    return removed


async def _communicate(
    process: asyncio.subprocess.Process,
    stdin: bytes | None,
    timeout_s: float,
    cap: int,
    reports: asyncio.StreamReader,
) -> tuple[bytes, bytes, bytes, bool, bool]:
    """Feed stdin, read both streams up to ``cap`` bytes each and the result pipe while the program runs;
    ``(stdout, stderr, reports, timed_out, overflow)``."""
    overflow = False

    async def feed() -> None:
        assert process.stdin is not None
        try:
            if stdin:
                process.stdin.write(stdin)
                await process.stdin.drain()
            process.stdin.close()
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program exited without reading all of its input

    async def read(stream: asyncio.StreamReader | None) -> bytes:
        nonlocal overflow
        buffer = bytearray()
        while stream is not None and (chunk := await stream.read(65536)):
            room = cap - len(buffer)
            if len(chunk) > room:
                buffer += chunk[:room]
                overflow = True
                _kill_group(process.pid)
                break
            buffer += chunk
        return bytes(buffer)

    async def drain(stream: asyncio.StreamReader) -> bytes:
        """Every report line, read as it comes (a full pipe would block the program); past the cap, discarded."""
        buffer = bytearray()
        while chunk := await stream.read(65536):
            buffer += chunk[: max(0, MAX_REPORT_BYTES - len(buffer))]
        return bytes(buffer)

    out = asyncio.ensure_future(read(process.stdout))
    err = asyncio.ensure_future(read(process.stderr))
    result_pipe = asyncio.ensure_future(drain(reports))
    waiter = asyncio.ensure_future(process.wait())
    tasks = {asyncio.ensure_future(feed()), out, err, result_pipe, waiter}
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    except asyncio.CancelledError:  # the caller gave up: the run's finally kills the process group
        for task in tasks:
            task.cancel()
        raise
    timed_out = not waiter.done()
    if pending:
        _kill_group(process.pid)
        _, pending = await asyncio.wait(pending, timeout=KILL_GRACE_S)
        for task in pending:
            task.cancel()
    stdout = out.result() if out.done() and not out.cancelled() else b""
    stderr = err.result() if err.done() and not err.cancelled() else b""
    report_bytes = result_pipe.result() if result_pipe.done() and not result_pipe.cancelled() else b""
    return stdout, stderr, report_bytes, timed_out, overflow


async def run_python_async(
    code: str,
    stdin: str | bytes | None = None,
    *,
    tests: Sequence[str] | None = None,
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
    if not timeout_s > 0:
        raise ValueError(
            f"Sandbox timeout_s={timeout_s!r} is not positive. Give a number of seconds above 0."
        )
    limits = limits or Limits()
    if isolation == "auto":
        found = await asyncio.to_thread(sandbox_isolation)
        isolation, prefix = ("namespaces", found.command) if found.namespaces else ("process", ())
    else:
        prefix = namespace_command() if isolation == "namespaces" else ()
    namespaces = isolation == "namespaces"
    if prefix is None:
        return ExecutionResult(
            None, sandbox_error="util-linux 'unshare' is not installed", isolation=isolation
        )
    start = time.perf_counter()
    stdin_bytes = stdin.encode("utf-8") if isinstance(stdin, str) else stdin
    workdir = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-")
    read_fd, write_fd = os.pipe()
    process: asyncio.subprocess.Process | None = None
    result_transport: asyncio.ReadTransport | None = None
    try:
        nonce = secrets.token_hex(16)
        config = {  # what the program's process may see
            "program": code,
            "testing": tests is not None,
            "limits": asdict(limits),
            "namespaces": namespaces,
            "seccomp": seccomp,
        }
        verdict = {
            "nonce": nonce,
            "tests": list(tests) if tests is not None else None,
        }  # the tests' process only
        Path(workdir, "main.py").write_text(code, encoding="utf-8")
        config_path = Path(workdir, ".sandbox.json")
        config_path.write_text(json.dumps(config), encoding="utf-8")
        Path(workdir, ".verdict.json").write_text(json.dumps(verdict), encoding="utf-8")
        command = [*prefix, sys.executable, "-I", "-B", "-X", "utf8", str(BOOT_SCRIPT), str(config_path)]
        env = {**_SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir}
        try:
            process = await asyncio.create_subprocess_exec(
                *command,
                str(write_fd),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env=env,
                pass_fds=(write_fd,),
                start_new_session=True,
            )
        except OSError as exc:
            return ExecutionResult(
                None, sandbox_error=f"cannot start {command[0]}: {exc}", isolation=isolation
            )
        finally:
            os.close(write_fd)
        reader = asyncio.StreamReader()
        pipe = os.fdopen(read_fd, "rb", buffering=0)  # the transport owns (and closes) the read end from here
        read_fd = None
        result_transport, _ = await asyncio.get_running_loop().connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        stdout, stderr, report_bytes, timed_out, overflow = await _communicate(
            process, stdin_bytes, timeout_s, limits.max_output_bytes, reader
        )
        reports = parse_reports(report_bytes, nonce)
        n_tests = len(verdict["tests"]) if tests is not None else None
        return assemble_result(
            reports,
            process.returncode,
            stdout,
            stderr,
            timed_out,
            overflow,
            n_tests,
            limits.cpu_s,
            namespaces,
            start,
        )
    finally:
        if process is not None:
            _kill_group(process.pid)
        if result_transport is not None:
            result_transport.close()
        if read_fd is not None:
            os.close(read_fd)
        _remove_tree(workdir)


def run_python(
    code: str,
    stdin: str | bytes | None = None,
    *,
    tests: Sequence[str] | None = None,
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
        code, stdin, tests=tests, timeout_s=timeout_s, limits=limits, isolation=isolation, seccomp=seccomp
    )
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()
