"""The in-sandbox half of :mod:`rewards.sandbox`: confine, run the program, and judge it from outside it.

:func:`rewards.sandbox.run_python_async` starts this file, ``python -I -S -B -X utf8 boot.py CONFIG RESULT_FD``,
inside the boundary (:mod:`rewards.sandbox.bwrap`) or as a plain process, with a scrubbed environment. It uses
the standard library only (its siblings :mod:`~rewards.sandbox.seccomp`, :mod:`~rewards.sandbox.channel`,
:mod:`~rewards.sandbox.trusted` and :mod:`~rewards.sandbox.audit` are loaded by path).

Steps, in order:

1. Read the program's config (program, limits; no nonce, no tests) and open the verdict file (the
   nonce and the tests), then delete both files.
2. Mark this process non-dumpable, so no process of the run can read its memory or descriptors
   through ``/proc`` (every process forked from it inherits that).
3. Fork the **program's process**. It closes the verdict file and the result pipe before anything
   else, so it never holds the nonce, the tests or the report channel. It confines itself
   (``PR_SET_PDEATHSIG``, resource limits, ``PR_SET_NO_NEW_PRIVS``, no capabilities, the seccomp
   filter, an audit hook) and runs the program: as ``__main__`` (script mode), or as module
   ``solution`` and then answers calls from the tests over :mod:`~rewards.sandbox.channel` (tests mode).
   What it reports (its set-up, limits it ran into, exceptions) goes through a diagnostics pipe that
   this process reads and vets; it cannot write a verdict.
4. Only then read the verdict file. With tests, fork the **tests' process**: confined the same way,
   it never executes the program's code. It sees the program's globals as proxies that carry plain
   values only, runs each test snippet, and reports each pass as ``<nonce> pass <i>`` on the result
   pipe (file descriptor ``RESULT_FD``).
5. Stay as the supervisor: forward the program's diagnostics, wait for both processes, report how the
   program ended (exit status, CPU time from ``wait4``), and exit; with a PID namespace that makes
   the kernel kill every process left in it.

Example (what :mod:`rewards.sandbox` runs; not meant to be started by hand)::

    python -I -S -B -X utf8 rewards/sandbox/boot.py /w/.sandbox.json 5
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import errno
import importlib.util
import json
import os
import resource
import select
import signal
import struct
import sys
import threading
import time
import traceback

SETUP_FAILED = 121
"""Exit status when the sandbox could not be set up; the program never ran."""

# Linux constants (include/uapi/linux/*.h); identical on x86_64 and aarch64.
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_CAPABILITY_VERSION_3 = 0x20080522
_DIAGNOSTICS = {
    "limit": {"memory", "processes", "file_size", "network"}.__contains__,
    "exception": str.isidentifier,
}
"""What the program's process may report through the supervisor after its set-up line: limits it ran into
inside (the parent sees wall time, CPU time and output itself) and exception type names."""
_MAX_DIAGNOSTICS = 256
_DRAIN_S = 2.0
"""Seconds the supervisor reads the program's diagnostics after both processes ended (a process the program
started may hold the pipe open)."""
_MISSING = object()
_MAX_TASKS = 64
"""Tasks (processes and threads) of the sandbox's uid inside the boundary, with one process allowed."""


def _sibling(name: str):  # noqa: ANN202 - a module loaded by path
    """Load ``rewards/sandbox/<name>.py`` by path: the directory is not on ``sys.path`` (``-I``), and must not be,
    or a program could import the sandbox's own modules by their bare names."""
    spec = importlib.util.spec_from_file_location(
        f"_dna_sandbox_{name}", os.path.join(os.path.dirname(__file__), f"{name}.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


seccomp = _sibling("seccomp")
wire = _sibling("channel")
trusted = _sibling("trusted")
audit = _sibling("audit")


class Channel:
    """Writes ``<nonce> <kind> <payload>`` lines to the result pipe, each at most once per key."""

    def __init__(self, fd: int, nonce: str):
        self._fd = fd
        self._nonce = nonce
        self._sent: set[tuple[str, str]] = set()

    def send(self, kind: str, payload: str = "") -> None:
        payload = payload[:1000]
        if (kind, payload) in self._sent:
            return
        self._sent.add((kind, payload))
        line = f"{self._nonce} {kind} {payload}".rstrip().replace("\n", " ") + "\n"
        with contextlib.suppress(OSError):  # the reader is gone: the sandbox is being killed
            os.write(self._fd, line.encode("utf-8", "replace"))


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _set_limits(limits: dict, bounded_tasks: bool, slot_tasks: int = 0) -> None:
    cpu = max(1, int(limits["cpu_s"] + 0.999))
    memory = int(limits["memory_mb"]) * 1024 * 1024
    files = int(limits["max_file_mb"]) * 1024 * 1024
    settings = [
        ("RLIMIT_CORE", 0, 0),
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", memory, memory),
        ("RLIMIT_FSIZE", files, files),
        ("RLIMIT_NOFILE", int(limits["max_open_files"]), int(limits["max_open_files"])),
    ]
    if limits["max_processes"] > 1:
        # Counts threads too, and only for a non-root user: with one process allowed, the seccomp
        # filter forbids new processes instead, and threads stay free.
        tasks = int(limits["max_processes"]) + slot_tasks
        settings.append(("RLIMIT_NPROC", tasks, tasks))
    elif bounded_tasks:
        # Inside the boundary the uid is never host root, so the kernel enforces this: it caps the run's
        # threads (a raw-clone thread costs ~17 KiB, and without a bound they exhaust the host's PIDs).
        settings.append(("RLIMIT_NPROC", _MAX_TASKS + slot_tasks, _MAX_TASKS + slot_tasks))
    for name, soft, hard in settings:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Empty the bounding set (while ``CAP_SETPCAP`` allows it) and the effective, permitted and inheritable sets.

    Needed as root, and inside a pool slot (:mod:`rewards.sandbox.zygote`), whose processes hold
    ``CAP_SYS_ADMIN`` and ``CAP_SETPCAP`` in the slot's user namespace until its run drops them here. Each
    capability is dropped until the kernel answers ``EINVAL`` (past its last one); no ``/proc`` is read.
    """
    for cap in range(64):
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break  # EPERM (no CAP_SETPCAP: nothing to drop there, e.g. a non-root caller): keep going
    header = struct.pack("Ii", _CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all zero
    _check(libc.capset(header, data), "capset")


def _has_capabilities(libc: ctypes.CDLL) -> bool:
    """Whether this process holds any effective, permitted or inheritable capability (``capget``)."""
    header = ctypes.create_string_buffer(struct.pack("Ii", _CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(24)
    _check(libc.capget(header, data), "capget")
    return any(data.raw)


def confine(config: dict, protections: list[str]) -> None:
    """Limits, no privileges, the seccomp filter: everything the child does before the program."""
    libc = _libc()
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    # in a pool slot the zygote and the run's first process share the uid (rewards/sandbox/zygote.py)
    _set_limits(config["limits"], bounded_tasks=config["namespaces"], slot_tasks=config.get("slot_tasks", 0))
    protections.append("rlimits")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    protections.append("no_new_privs")
    if os.geteuid() == 0 or _has_capabilities(libc):
        _drop_capabilities(libc)
        protections.append("no_capabilities")
    allow_processes = config["limits"]["max_processes"] > 1
    deny_shared = not config.get(
        "memory_cgroup"
    )  # memfd and SysV pages escape RLIMIT_AS; a memory cgroup counts them
    if config["seccomp"] and seccomp.install(libc, os.getpid(), allow_processes, deny_shared):
        protections.append("seccomp")


def _report_exception(channel: Channel, exc: BaseException) -> None:
    if isinstance(exc, MemoryError):
        channel.send("limit", "memory")
    elif isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:
        channel.send("limit", "processes")
    elif isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        channel.send("limit", "file_size")
    channel.send("exception", type(exc).__name__)


def program_side(config: dict, diagnostics: Channel, requests: int | None, answers: int | None) -> int:
    """The program's process after :func:`confine`: run the program; with tests, then answer the tests' calls.

    Returns the exit status. With tests the program is imported as module ``solution``, not run as
    ``__main__``: its ``if __name__ == "__main__":`` block stays quiet, as in the HumanEval and MBPP harnesses.
    """
    testing = requests is not None
    namespace = {
        "__name__": "solution" if testing else "__main__",
        "__file__": os.path.abspath("main.py"),
        "__builtins__": builtins,
    }
    try:
        exec(compile(config["program"], "main.py", "exec"), namespace)  # noqa: S102 - running it is the point
    except SystemExit:
        if not testing:
            raise
        diagnostics.send("exception", "SystemExit")
        return 1  # exiting before the tests ran passes none of them
    except BaseException as exc:  # noqa: BLE001 - any failure of the program is reported, then fails the run
        _report_exception(diagnostics, exc)
        traceback.print_exc()
        return 1
    if not testing:
        return 0
    sys.stdout.flush()
    with contextlib.suppress(BrokenPipeError):  # the tests' process is done
        wire.serve(namespace, requests, answers, lambda exc: _report_exception(diagnostics, exc))
    return 0


def tests_side(
    tests: list[str], channel: Channel, requests: int, answers: int, setup: str | None = None
) -> int:
    """The tests' process after :func:`confine`: run the set-up, then each test against the program's globals,
    report passes.

    ``setup`` (e.g. MBPP's ``test_setup_code``) runs here, in the tests' namespace after the program's globals,
    so what it defines is the tests' own: the program can neither see nor rewrite it. A set-up that raises
    fails every test.
    """
    link = wire.Link(requests, answers, trusted)
    try:
        names, shadows = link.globals()
    except wire.ProgramGone as exc:
        print(f"--- the program did not load: {exc} ---", file=sys.stderr)
        return 1
    channel.send("loaded")
    namespace = {**names, "__name__": "__test__", "__builtins__": builtins}
    if setup:
        before = dict(namespace)
        try:
            exec(compile(setup, "<test set-up>", "exec"), namespace)  # noqa: S102 - the row's own set-up
        except BaseException as exc:  # noqa: BLE001 - a failing set-up fails the tests, it does not crash
            channel.send("exception", type(exc).__name__)
            print("--- the test set-up failed ---", file=sys.stderr)
            traceback.print_exc()
            return 1
        # What the set-up (re)defined is the tests' own: no program value under that name comes back.
        defined = {name for name, value in namespace.items() if before.get(name, _MISSING) is not value}
        shadows = {name: value for name, value in shadows.items() if name not in defined}
    failed = 0
    for index, test in enumerate(tests):
        visible = wire.shadows_for(test, names.keys() - shadows.keys(), shadows)
        saved = {name: namespace.get(name, _MISSING) for name in visible}
        namespace.update({name: shadows[name] for name in visible})
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)  # noqa: S102 - the row's own tests
        except BaseException as exc:  # noqa: BLE001 - a failing test is a result, not a crash
            failed += 1
            channel.send("exception", type(exc).__name__)
            print(f"--- test {index} failed ---", file=sys.stderr)
            traceback.print_exc()
            continue
        else:
            channel.send("pass", str(index))
        finally:
            for name, value in saved.items():
                if namespace.get(name) is shadows[name]:
                    if value is _MISSING:
                        del namespace[name]
                    else:
                        namespace[name] = value
    return 1 if failed else 0


class _Forwarder:
    """Passes on what the program's process reports: its first line (set-up) as it is, then limits and
    exceptions only, at most :data:`_MAX_DIAGNOSTICS` lines; never a verdict. The program's process waits on
    ``gate`` until its set-up line is on the result pipe: a run killed a moment later still reads as started.
    Fed by the supervisor's own poll loop (no thread: a thread per run costs a stack and a ``clone``)."""

    _MAX_LINE = 4096
    """Bytes kept of one line (a longer one is no diagnostic the supervisor passes on)."""

    def __init__(self, diagnostics: int, channel: Channel, gate: int):
        self.fd, self._channel, self._gate = diagnostics, channel, gate
        self._first, self._forwarded, self._partial = True, 0, b""

    def read(self) -> bool:
        """Read what is there (the pipe is ready); False at end-of-file (the pipe is closed then)."""
        try:
            data = os.read(self.fd, 65536)
        except InterruptedError:
            return True
        if not data:
            self.close()
            return False
        *lines, self._partial = (self._partial + data).split(b"\n")
        for raw in lines:
            self._line(raw)
        self._partial = self._partial[: self._MAX_LINE]
        return True

    def _line(self, raw: bytes) -> None:
        parts = raw[: self._MAX_LINE].decode("utf-8", "replace").split(" ", 2)
        kind, payload = (parts[1], parts[2] if len(parts) == 3 else "") if len(parts) >= 2 else ("", "")
        allowed = (
            kind in ("setup", "setup_error")
            if self._first
            else _DIAGNOSTICS.get(kind, lambda _: False)(payload)
        )
        if allowed and self._forwarded < _MAX_DIAGNOSTICS:
            self._forwarded += 1
            self._channel.send(kind, payload)
        if self._first:
            self._first = False
            os.close(self._gate)

    def close(self) -> None:
        """The pipe is done (end-of-file, or given up on): a last unterminated line counts, the gate opens."""
        if self.fd < 0:
            return
        if self._partial:
            self._line(self._partial)
            self._partial = b""
        os.close(self.fd)
        self.fd = -1
        if self._first:
            self._first = False
            os.close(self._gate)

    def drain(self, timeout_s: float | None) -> None:
        """Read until end-of-file, at most ``timeout_s`` (None: no limit; a process the program started may hold
        the pipe)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.fd >= 0:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if select.select([self.fd], [], [], left)[0] and not self.read():
                return
        self.close()


def _wait_all(
    program: int, tests: int | None, result_fd: int, forwarder: _Forwarder
) -> dict[int, tuple[int, object]]:
    """``{pid: (status, rusage)}`` once both processes ended, passing the program's diagnostics on meanwhile.
    When the tests' process ends first, the program's is killed (the verdict is in; it is not counted as the
    program's failure). If the caller dies first (``POLLERR`` on the result pipe, whose read end it holds), kill
    both and exit."""
    children = [pid for pid in (program, tests) if pid is not None]
    ended: dict[int, tuple[int, object]] = {}
    try:
        pidfds = {os.pidfd_open(pid): pid for pid in children}
    except (AttributeError, OSError):  # before Linux 5.3: wait in order; PR_SET_PDEATHSIG ends an orphan
        reader = threading.Thread(target=forwarder.drain, args=(None,), daemon=True)
        reader.start()
        for pid in reversed(children):
            _, status, usage = os.wait4(pid, 0)
            ended[pid] = (status, usage)
        reader.join(timeout=_DRAIN_S)
        return ended
    poller = select.poll()
    for fd in pidfds:
        poller.register(fd, select.POLLIN)
    poller.register(result_fd, 0)  # POLLERR and POLLHUP are always reported
    poller.register(forwarder.fd, select.POLLIN)
    while len(ended) < len(children):
        events = dict(poller.poll())
        if events.get(result_fd, 0) & (select.POLLERR | select.POLLHUP):
            for pid in children:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            os._exit(SETUP_FAILED)
        if forwarder.fd in events:
            diagnostics = forwarder.fd
            if not forwarder.read():
                poller.unregister(diagnostics)
        for fd, pid in pidfds.items():
            if fd in events and pid not in ended:
                poller.unregister(fd)
                _, status, usage = os.wait4(pid, 0)
                ended[pid] = (status, usage)
        if tests is not None and tests in ended and program not in ended:
            with contextlib.suppress(OSError):
                os.kill(program, signal.SIGKILL)
            _, status, usage = os.wait4(program, 0)
            ended[program] = (0, usage)  # stopped by us after the verdict: as if it exited 0
    forwarder.drain(_DRAIN_S)
    return ended


def supervise(
    program: int, tests: int | None, diagnostics: int, gate: int, channel: Channel, result_fd: int
) -> int:
    """Forward the program's diagnostics, wait for both processes, report how the run ended; the exit status.

    The exit status is the program's when it failed (exit status or signal), else the tests' (0 only when
    every test passed). The CPU time is the program's.
    """
    ended = _wait_all(program, tests, result_fd, _Forwarder(diagnostics, channel, gate))
    status, usage = ended[program]
    cpu_s = usage.ru_utime + usage.ru_stime
    code, sig = (None, os.WTERMSIG(status)) if os.WIFSIGNALED(status) else (os.WEXITSTATUS(status), None)
    if tests is not None and code == 0:
        tests_status = ended[tests][0]
        code = os.WEXITSTATUS(tests_status) if os.WIFEXITED(tests_status) else 1
    channel.send(
        "exit", json.dumps({"code": code, "signal": sig, "cpu_s": cpu_s, "maxrss_kb": usage.ru_maxrss})
    )
    return code if code is not None else 128 + sig


def _start_program(config: dict, keep: tuple[int, ...], drop: tuple[int, ...], protections: list[str]) -> int:
    """Fork the program's process; in it, close ``drop`` first thing, confine, run; never returns there."""
    pid = os.fork()
    if pid:
        return pid
    for fd in drop:
        os.close(fd)
    diagnostics = Channel(keep[0], "-")
    try:
        confine(config, protections)
    except OSError as exc:
        diagnostics.send("setup_error", str(exc))
        os._exit(SETUP_FAILED)
    if not config["namespaces"]:
        protections.append("file_write_guard")
    audit.install(config, diagnostics)
    diagnostics.send("setup", ",".join(protections))
    os.read(keep[1], 1)  # the gate: returns once the supervisor passed the set-up line on
    os.close(keep[1])
    requests, answers = (keep[2], keep[3]) if len(keep) == 4 else (None, None)
    sys.exit(program_side(config, diagnostics, requests, answers))


def _start_tests(
    config: dict, verdict: dict, channel: Channel, requests: int, answers: int, drop: int
) -> int:
    """Fork the tests' process (stdin from ``/dev/null``); in it, confine and run the tests; never returns there."""
    pid = os.fork()
    if pid:
        return pid
    for fd in drop:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        confine(config, [])
    except OSError as exc:
        channel.send("setup_error", f"tests: {exc}")
        os._exit(SETUP_FAILED)
    audit.install(config, channel)
    sys.exit(tests_side(verdict["tests"], channel, requests, answers, verdict.get("setup")))


def exit_as_interpreter(exc: SystemExit) -> None:
    """End a process forked without ``exec`` (a pool slot's, :mod:`rewards.sandbox.zygote`) the way an interpreter
    ends on ``SystemExit``: join non-daemon threads, run ``atexit`` handlers, flush stdio, exit with the same
    status (``None`` 0, an int itself, anything else printed to stderr and 1); never returns."""
    code = exc.code
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:
        with contextlib.suppress(Exception):
            print(code, file=sys.stderr)
        status = 1
    with contextlib.suppress(BaseException):
        threading._shutdown()  # what Py_FinalizeEx does first: wait for the program's non-daemon threads
    with contextlib.suppress(BaseException):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(status)


def main(argv: list[str]) -> None:
    """One run started as its own interpreter: the config and verdict files in ``/w``, the result pipe's fd."""
    config_path, result_fd = argv[1], int(argv[2])
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with whoever started the run
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    sys.path.extend(config["site_packages"])  # what site (off: -S) would add, without running any .pth file
    verdict_path = os.path.join(os.path.dirname(config_path), ".verdict.json")
    verdict_fd = os.open(verdict_path, os.O_RDONLY)
    os.unlink(config_path)
    os.unlink(verdict_path)
    run(config, verdict_fd, result_fd)


def run(config: dict, verdict_fd: int, result_fd: int) -> None:
    """Steps 2 to 5 (module docstring) for one run; never returns. ``verdict_fd`` is read only after the
    program's process is forked; :mod:`rewards.sandbox.zygote` calls this as a pool slot's run."""
    protections = [name for name in ("memory_cgroup", "tasks_cgroup") if config.get(name)]
    try:
        _check(_libc().prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")
    except OSError as exc:  # no nonce yet (it must never be in the program's memory): stderr says why
        print(f"sandbox set-up failed: {exc}", file=sys.stderr, flush=True)
        os._exit(SETUP_FAILED)
    testing = config["testing"]
    diagnostics_read, diagnostics_write = os.pipe()
    gate_read, gate_write = os.pipe()
    requests = os.pipe() if testing else None
    answers = os.pipe() if testing else None
    sys.stdout.flush()
    keep = (diagnostics_write, gate_read, *((requests[0], answers[1]) if testing else ()))
    drop = (
        result_fd,
        verdict_fd,
        diagnostics_read,
        gate_write,
        *((requests[1], answers[0]) if testing else ()),
    )
    program = _start_program(config, keep, drop, protections)
    for fd in keep:
        os.close(fd)
    with os.fdopen(verdict_fd, encoding="utf-8") as handle:  # only now: the program's process never held it
        verdict = json.load(handle)
    channel = Channel(result_fd, verdict["nonce"])
    tests = None
    if testing:
        tests = _start_tests(
            config, verdict, channel, requests[1], answers[0], (diagnostics_read, gate_write)
        )
        os.close(requests[1])
        os.close(answers[0])
    os._exit(supervise(program, tests, diagnostics_read, gate_write, channel, result_fd))


if __name__ == "__main__":
    main(sys.argv)
