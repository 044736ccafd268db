"""The in-sandbox half of :mod:`rewards.sandbox`: confine, run the program, and judge it from outside it.

:func:`rewards.sandbox.run_python_async` starts this file, ``python -I -S -B -X utf8 boot.py CONFIG RESULT_FD``,
inside the boundary (:mod:`rewards.sandbox.bwrap`) or as a plain process, with a scrubbed environment. It uses
the standard library only (its siblings :mod:`~rewards.sandbox.seccomp`, :mod:`~rewards.sandbox.channel`,
:mod:`~rewards.sandbox.trusted`, :mod:`~rewards.sandbox.audit` and :mod:`~rewards.sandbox.supervisor` are loaded
by path).

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
4. Only then read the verdict file. Without tests, stay as the supervisor: forward the program's
   diagnostics, wait for it, report how it ended (exit status, CPU time from ``wait4``), and exit.
5. With tests, become the **tests' process** (:func:`_judge`): confine this process the same way (its
   seccomp filter and audit hook let it signal the program's process, and no other), wait for the
   program's set-up line, then run each test snippet. It never executes the program's code: it sees the
   program's globals as proxies that carry plain values only, and reports each pass as ``<nonce> pass <i>``
   on the result pipe (file descriptor ``RESULT_FD``). While it waits for the program's answers it also
   passes the program's diagnostics on as they come (:mod:`~rewards.sandbox.supervisor`), so they survive a
   timeout and never fill their pipe. Then stop the program's process if it still runs, report how the run
   ended, and exit; with a
   PID namespace that makes the kernel kill every process left in it. One process fewer than a tests'
   process of its own, which is most of a run's cost (each forked interpreter pays its page tables, its
   copy-on-write faults and its exit).

Example (what :mod:`rewards.sandbox` runs; not meant to be started by hand)::

    python -I -S -B -X utf8 rewards/sandbox/boot.py /w/.sandbox.json 5
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import errno
import functools
import importlib.util
import json
import os
import resource
import signal
import struct
import sys
import threading
import traceback

# Linux constants (include/uapi/linux/*.h); identical on x86_64 and aarch64.
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 4, 24, 38
_CAPABILITY_VERSION_3 = 0x20080522
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
supervisor = _sibling("supervisor")
SETUP_FAILED = supervisor.SETUP_FAILED


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


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc, loaded once per interpreter: a pool slot's runs inherit the zygote's, its functions already looked
    up (:mod:`rewards.sandbox.zygote`); each ``CDLL`` made anew would build a class and its function objects in
    every forked process."""
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


def confine(config: dict, protections: list[str], signal_also: int | None = None) -> None:
    """Limits, no privileges, the seccomp filter: everything a process of the run does before the program or the
    tests. ``signal_also``: the one other process it may signal (the tests' side stops the program's)."""
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
    if config["seccomp"] and seccomp.install(libc, os.getpid(), allow_processes, deny_shared, signal_also):
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


def tests_side(link, tests: list[str], channel: Channel, setup: str | None = None) -> int:  # noqa: ANN001
    """The tests' side after :func:`confine`: run the set-up, then each test against the program's globals
    (``link``: a ``channel.Link`` to the program's process), report passes; 1 when a test failed, else 0.

    ``setup`` (e.g. MBPP's ``test_setup_code``) runs here, in the tests' namespace after the program's globals,
    so what it defines is the tests' own: the program can neither see nor rewrite it. A set-up that raises
    fails every test.
    """
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
    forwarder = supervisor.Forwarder(diagnostics_read, channel, gate_write)
    if not testing:
        os._exit(supervisor.report(channel, *supervisor.wait_program(program, result_fd, forwarder), None))
    os._exit(_judge(config, verdict, channel, program, requests[1], answers[0], forwarder))  # or _leave


def _judge(  # noqa: PLR0913
    config: dict,
    verdict: dict,
    channel: Channel,
    program: int,
    requests: int,
    answers: int,
    forwarder,  # noqa: ANN001 - supervisor.Forwarder (a module loaded by path)
) -> int:
    """Step 5: this process becomes the tests' process, then reports how the run ended; its exit status.

    It confines itself as the program's process did (the seccomp filter and the audit hook let it signal the
    program's process and no other), waits for the program's set-up line, runs the tests (passing the
    program's diagnostics on as they come), stops the program's process if it still runs (the verdict is in:
    not counted as the program's failure) and reports.
    """
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    try:
        confine(config, [], signal_also=program)
    except OSError as exc:
        channel.send("setup_error", f"tests: {exc}")
        return SETUP_FAILED
    audit.install(config, channel, may_signal=program)

    def out_of_cpu(signum: int, frame: object) -> None:
        # As the PID namespace's init this process ignores SIGXCPU by default (and would die by the hard
        # limit's SIGKILL a second later, unreported); a tests' side out of CPU fails the run, reported.
        _leave(channel, supervisor.stop_program(program, forwarder, None, drain=False), 1)

    signal.signal(signal.SIGXCPU, out_of_cpu)
    forwarder.until_first_line()  # the program's set-up (or set-up error) is on the result pipe
    link = wire.Link(requests, answers, trusted, watch=(forwarder.fd, forwarder.read))
    try:
        failed = tests_side(link, verdict["tests"], channel, verdict.get("setup"))
    except BaseException:  # noqa: BLE001 - whatever the tests do, the run is reported
        failed = 1
    # Whether the program's process ended on its own, asked before the channel closes (it ends at end-of-file
    # then): a program that ends later is stopped after the verdict, not failing, whatever its exit status.
    ended = os.wait4(program, os.WNOHANG)
    link.close()
    _leave(channel, supervisor.stop_program(program, forwarder, ended), failed)


def _leave(channel: Channel, ended: tuple[int, object], failed: int) -> None:
    """Report how a run with tests ended and exit; never returns."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(BaseException):
            stream.flush()
    os._exit(supervisor.report(channel, *ended, failed))


if __name__ == "__main__":
    main(sys.argv)
