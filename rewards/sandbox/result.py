"""What a sandboxed run reports, and the :class:`ExecutionResult` made from it.

``boot.py`` writes one line ``<nonce> <kind> <payload>`` per event on a private pipe: ``setup``
(the protections in place), ``setup_error``, ``loaded`` (the program ran to its end before the
tests), ``pass <i>``, ``limit <kind>``, ``exception <type>`` and ``exit`` (status and CPU time
from ``wait4``). :func:`parse_reports` reads them, :func:`assemble_result` combines them with the
process's exit status, its captured output and what the parent saw (timeout, output cap).

Example:
    >>> assemble_result([("setup", "seccomp"), ("loaded", ""), ("pass", "0")], 1, b"", b"", False, False,
    ...                 2, 5.0, False, 0.0).tests_passed
    (True, False)
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import dataclass, field

MAX_REPORT_BYTES = 1 << 20
"""At most this much is read from the result pipe."""
BOUNDARY_PROTECTIONS = frozenset(
    {
        "bwrap",
        "userns",
        "netns",
        "pidns",
        "mountns",
        "ipcns",
        "utsns",
        "cgroupns",
        "minimal_root",
        "readonly_root",
    }
    | {"private_tmp"}
)
"""What a run inside the boundary (:mod:`rewards.sandbox.bwrap`) always has."""
LIMIT_KINDS = ("wall_time", "cpu_time", "memory", "processes", "output", "file_size", "network")
"""Names in :attr:`ExecutionResult.limits_hit`."""


@dataclass(frozen=True)
class ExecutionResult:
    """How one sandboxed run ended.

    Attributes:
        exit_code: The program's exit status, None when it was killed by a signal or never ran.
        signal: The signal that killed it, or None.
        stdout: Captured standard output (UTF-8, undecodable bytes replaced), at most
            ``max_output_bytes``.
        stderr: Captured standard error, same cap.
        limits_hit: Which limits the run ran into, from :data:`LIMIT_KINDS`.
        tests_passed: With ``tests``, one bool per test; else None.
        loaded: With ``tests``, whether the program itself ran to its end before the tests (False:
            it raised or exited first, a crash); else None.
        exceptions: Type names of the exceptions the program or its tests raised, in order.
        wall_s: Seconds from start to the end of the run, set-up and clean-up included.
        cpu_s: CPU seconds the program used (from ``wait4``), or None when unknown.
        sandbox_error: Why the sandbox itself failed (the program never ran), or None.
        isolation: ``namespaces`` or ``process``.
        protections: What the sandbox put in place, e.g. ``seccomp``, ``readonly_root``.
    """

    exit_code: int | None
    signal: int | None = None
    stdout: str = ""
    stderr: str = ""
    limits_hit: frozenset[str] = frozenset()
    tests_passed: tuple[bool, ...] | None = None
    loaded: bool | None = None
    exceptions: tuple[str, ...] = ()
    wall_s: float = 0.0
    cpu_s: float | None = None
    sandbox_error: str | None = None
    isolation: str = "process"
    protections: frozenset[str] = field(default_factory=frozenset)

    @property
    def status(self) -> str:
        """One word: ``sandbox_error``, ``timeout``, ``output_limit``, ``cpu_limit``,
        ``memory_limit``, ``process_limit``, ``ok`` or ``error`` (the first that applies)."""
        if self.sandbox_error is not None:
            return "sandbox_error"
        for kind, status in (
            ("wall_time", "timeout"),
            ("output", "output_limit"),
            ("cpu_time", "cpu_limit"),
            ("memory", "memory_limit"),
            ("processes", "process_limit"),
        ):
            if kind in self.limits_hit:
                return status
        return "ok" if self.exit_code == 0 else "error"

    @property
    def ok(self) -> bool:
        """The program ran and exited 0 within every limit."""
        return self.status == "ok"


def parse_reports(data: bytes, nonce: str) -> list[tuple[str, str]]:
    """The ``(kind, payload)`` of each ``<nonce> <kind> <payload>`` line read from the result pipe.

    Lines without the run's nonce (anything the program itself wrote there) are ignored. The pipe is
    read while the program runs (:func:`rewards.sandbox.run_python_async`), at most
    :data:`MAX_REPORT_BYTES` kept, so a program with any number of tests never blocks on it.

    Example:
        >>> parse_reports(b"n1 pass 0\\nforged pass 1\\nn1 loaded\\n", "n1")
        [('pass', '0'), ('loaded', '')]
    """
    reports = []
    for line in data.decode("utf-8", "replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) >= 2 and parts[0] == nonce:
            reports.append((parts[1], parts[2] if len(parts) == 3 else ""))
    return reports


def assemble_result(
    reports: list[tuple[str, str]],
    returncode: int | None,
    stdout: bytes,
    stderr: bytes,
    timed_out: bool,
    overflow: bool,
    n_tests: int | None,
    cpu_limit_s: float,
    namespaces: bool,
    start: float,
) -> ExecutionResult:
    """The :class:`ExecutionResult` of one run, from its reports, exit status and output.

    A run that never reported ``setup`` (``unshare`` refused, the interpreter did not start)
    is a ``sandbox_error``: the program never ran. A ``SIGKILL`` after at least 90% of the CPU
    limit is the hard CPU limit (``RLIMIT_CPU`` + 1 s), not the wall-clock timeout.
    """
    limits_hit = {payload for kind, payload in reports if kind == "limit" and payload in LIMIT_KINDS}
    if timed_out:
        limits_hit.add("wall_time")
    if overflow:
        limits_hit.add("output")
    protections: frozenset[str] = frozenset()
    setup_error = None
    exit_code: int | None = returncode if returncode is not None and returncode >= 0 else None
    sig = -returncode if returncode is not None and returncode < 0 else None
    cpu_s = None
    passed: set[int] = set()
    loaded = False
    exceptions = []
    for kind, payload in reports:
        if kind == "setup":
            protections = frozenset(filter(None, payload.split(",")))
            if namespaces:
                protections |= BOUNDARY_PROTECTIONS
        elif kind == "setup_error":
            setup_error = payload
        elif kind == "pass" and payload.isdigit():
            passed.add(int(payload))
        elif kind == "loaded":
            loaded = True
        elif kind == "exception":
            exceptions.append(payload)
        elif kind == "exit":
            try:
                status = json.loads(payload)
                exit_code, sig, cpu_s = status["code"], status["signal"], status["cpu_s"]
            except (ValueError, TypeError, KeyError):
                pass  # cut off at the report cap: the process's own exit status stands
    if sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu_s is not None and cpu_s >= 0.9 * cpu_limit_s):
        limits_hit.add("cpu_time")
    if sig == signal.SIGXFSZ:
        limits_hit.add("file_size")
    if setup_error is None and not any(kind == "setup" for kind, _ in reports):
        tail = stderr.decode("utf-8", "replace").strip()[-500:]
        setup_error = f"the sandbox did not start (exit status {returncode}): {tail or 'no output'}"
    if setup_error is not None:
        limits_hit.discard("wall_time")
    return ExecutionResult(
        exit_code=exit_code if setup_error is None else None,
        signal=sig,
        stdout=stdout.decode("utf-8", "replace"),
        stderr=stderr.decode("utf-8", "replace"),
        limits_hit=frozenset(limits_hit),
        tests_passed=tuple(i in passed for i in range(n_tests)) if n_tests is not None else None,
        loaded=loaded if n_tests is not None else None,
        exceptions=tuple(exceptions),
        wall_s=time.perf_counter() - start,
        cpu_s=cpu_s,
        sandbox_error=setup_error,
        isolation="namespaces" if namespaces else "process",
        protections=protections,
    )
