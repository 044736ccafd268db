"""The in-sandbox half of :mod:`rewards.sandbox`: confine this interpreter, then run the program.

:func:`rewards.sandbox.run_python_async` starts this file as a script, ``python -I -B -X utf8
boot.py CONFIG RESULT_FD``, in a private working directory with a scrubbed environment,
either inside fresh namespaces (``unshare --net --pid --mount-proc --fork``, plus ``--user`` when
not root) or as a plain process. It uses the standard library only and never imports the project.

Steps, in order:

1. Read the JSON config (limits, program, tests, a random nonce) and delete the file, so the
   program never sees the nonce.
2. With namespaces, as PID 1 of the new PID namespace: make every mount read-only, mount private
   ``tmpfs`` on ``/tmp``, ``/var/tmp`` and ``/dev/shm``, and bind the working directory back
   read-write at its own path.
3. Fork. The parent stays as a supervisor: it waits for the child, reports its exit status and
   CPU time, and exits; with a PID namespace its exit makes the kernel kill every process left in
   it. The child confines itself: ``PR_SET_PDEATHSIG``, resource limits, ``PR_SET_NO_NEW_PRIVS``,
   no capabilities, a seccomp filter (no new processes, no sockets, no signals to other
   processes, no mounts or namespaces, no ptrace, no io_uring), and a Python audit hook that
   enforces the same rules in Python and reports which limit a program ran into.
4. The child runs the program as ``__main__`` (script mode), or runs it and then each test
   snippet in the same globals, reporting each passing test on the result pipe (tests mode).

Every report is one line ``<nonce> <kind> <payload>`` on the result pipe (file descriptor
``RESULT_FD``), so the program cannot forge a passing test by printing, and ``sys.exit(0)`` or
``os._exit(0)`` before the tests run passes none. A program that digs the nonce out of the
interpreter's memory could still forge one; tests that share an interpreter with the code they
test cannot be made tamper-proof.

Example (what :mod:`rewards.sandbox` runs; not meant to be started by hand)::

    python -I -B -X utf8 rewards/sandbox/boot.py /tmp/dna-sandbox-x/.sandbox.json 5
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import platform
import resource
import select
import signal
import struct
import sys
import traceback

SETUP_FAILED = 121
"""Exit status when the sandbox could not be set up; the program never ran."""

# Linux constants (include/uapi/linux/*.h); identical on x86_64 and aarch64.
_MS_NOSUID, _MS_NODEV, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x2, 0x4, 0x1000, 0x4000, 0x40000
_AT_FDCWD, _AT_RECURSIVE, _MOUNT_ATTR_RDONLY = -100, 0x8000, 0x1
_SYS_MOUNT_SETATTR = 442
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP = 1, 24, 38, 22
_SECCOMP_MODE_FILTER = 2
_CAPABILITY_VERSION_3 = 0x20080522
_CLONE_THREAD = 0x00010000

# seccomp return values and classic-BPF opcodes.
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0 = 0, 4, 16

# Per architecture: the audit arch value, a syscall-number floor to refuse (x32 on x86_64), and the
# syscall numbers the filter handles (None: the architecture has no such call).
_ARCHES = {
    "x86_64": (0xC000003E, 0x40000000),
    "aarch64": (0xC00000B7, None),
}
_SYSCALLS = {  # name: (x86_64, aarch64)
    "fork": (57, None),
    "vfork": (58, None),
    "clone": (56, 220),
    "clone3": (435, 435),
    "socket": (41, 198),
    "kill": (62, 129),
    "tkill": (200, 130),
    "tgkill": (234, 131),
    "rt_sigqueueinfo": (129, 138),
    "rt_tgsigqueueinfo": (297, 240),
    "pidfd_send_signal": (424, 424),
    "pidfd_open": (434, 434),
    "ptrace": (101, 117),
    "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271),
    "setsid": (112, 157),
    "setpgid": (109, 154),
    "mount": (165, 40),
    "umount2": (166, 39),
    "mount_setattr": (442, 442),
    "move_mount": (429, 429),
    "open_tree": (428, 428),
    "fsopen": (430, 430),
    "fsconfig": (431, 431),
    "fsmount": (432, 432),
    "fspick": (433, 433),
    "pivot_root": (155, 41),
    "chroot": (161, 51),
    "unshare": (272, 97),
    "setns": (308, 268),
    "bpf": (321, 280),
    "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219),
    "add_key": (248, 217),
    "request_key": (249, 218),
    "io_uring_setup": (425, 425),
    "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
}
_PROCESS_CALLS = ("fork", "vfork", "clone", "clone3")
_SIGNAL_SELF_ONLY = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo")
_DENIED = tuple(name for name in _SYSCALLS if name not in (*_PROCESS_CALLS, *_SIGNAL_SELF_ONLY, "socket"))
"""Refused outright (EPERM): tracing, mounts, namespaces, new sessions, bpf, keyrings, io_uring."""

# Audit events (CPython 3.11) that start a process, and those that change the filesystem.
_PROCESS_EVENTS = frozenset(
    {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen"}
)
_PATH_EVENTS = frozenset(
    {
        "os.remove",
        "os.rename",
        "os.rmdir",
        "os.mkdir",
        "os.symlink",
        "os.link",
        "os.chmod",
        "os.chown",
        "os.truncate",
        "os.utime",
        "os.chflags",
        "os.mkfifo",
        "os.mknod",
        "shutil.rmtree",
        "shutil.move",
        "shutil.copyfile",
    }
)
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
_WRITABLE_DEVICES = frozenset({"/dev/null", "/dev/stdout", "/dev/stderr", "/dev/tty"})


class Channel:
    """Writes ``<nonce> <kind> <payload>`` lines to the result pipe, each at most once per key."""

    def __init__(self, fd: int, nonce: str):
        self._fd = fd
        self._nonce = nonce
        self._sent: set[tuple[str, str]] = set()

    def send(self, kind: str, payload: str = "") -> None:
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


class _MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


def _mount_setattr(libc: ctypes.CDLL, path: str, recursive: bool, set_: int = 0, clear: int = 0) -> None:
    attr = _MountAttr(set_, clear, 0, 0)
    flags = _AT_RECURSIVE if recursive else 0
    result = libc.syscall(
        _SYS_MOUNT_SETATTR, _AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    _check(result, f"mount_setattr {path}")


def private_filesystem(temp_mb: int, protections: list[str]) -> None:
    """Read-only mounts, private temp dirs, and the working directory bound back read-write.

    Runs as root of the fresh mount namespace (real root, or root of a fresh user namespace).
    The working directory usually lies under ``/tmp``, which the private tmpfs hides, so it is
    re-created on the tmpfs and the original is bound onto it through ``/proc/self/cwd``.
    """
    libc = _libc()
    workdir = os.getcwd()
    _check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make / private")
    _mount_setattr(libc, "/", recursive=True, set_=_MOUNT_ATTR_RDONLY)
    protections.append("readonly_root")
    options = f"size={max(1, temp_mb)}m,mode=1777".encode()
    for path in ("/tmp", "/var/tmp", "/dev/shm"):
        if os.path.isdir(path):
            _check(libc.mount(b"tmpfs", path.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options), path)
    protections.append("private_tmp")
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    _check(libc.mount(b"/proc/self/cwd", workdir.encode(), None, _MS_BIND, None), "bind workdir")
    _mount_setattr(libc, workdir, recursive=False, clear=_MOUNT_ATTR_RDONLY)
    os.chdir(workdir)


def _set_limits(limits: dict) -> None:
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
        settings.append(("RLIMIT_NPROC", int(limits["max_processes"]), int(limits["max_processes"])))
    for name, soft, hard in settings:
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Empty the bounding set and the effective, permitted and inheritable sets."""
    try:
        with open("/proc/sys/kernel/cap_last_cap") as handle:
            last = int(handle.read())
    except OSError:
        last = 40
    for cap in range(last + 1):
        libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # EINVAL for caps this kernel lacks: fine
    header = struct.pack("Ii", _CAPABILITY_VERSION_3, 0)
    data = bytes(24)  # two {effective, permitted, inheritable} u32 triples, all zero
    _check(libc.capset(header, data), "capset")


def _seccomp_program(arch: str, own_pid: int, allow_processes: bool) -> list[tuple[int, int, int, int]]:
    """The classic-BPF seccomp filter as ``(code, jt, jf, k)`` instructions."""
    audit_arch, x32_floor = _ARCHES[arch]
    column = 0 if arch == "x86_64" else 1
    allow, kill = (_RET, 0, 0, _RET_ALLOW), (_RET, 0, 0, _RET_KILL_PROCESS)

    def deny(code: int) -> tuple[int, int, int, int]:
        return (_RET, 0, 0, _RET_ERRNO | code)

    def arg0_in(values: tuple[int, ...], code: int) -> list[tuple[int, int, int, int]]:
        body = [(_LD_ABS, 0, 0, _OFFSET_ARG0)]
        for i, value in enumerate(values):
            body.append((_JEQ, len(values) - i, 0, value & 0xFFFFFFFF))  # jump to the final allow
        return [*body, deny(code), allow]

    rules: list[tuple[str, list[tuple[int, int, int, int]]]] = []
    if not allow_processes:
        rules += [("fork", [deny(errno.EAGAIN)]), ("vfork", [deny(errno.EAGAIN)])]
        # Threads (CLONE_THREAD) stay allowed; clone3 reports ENOSYS so glibc falls back to clone.
        thread_only = [(_LD_ABS, 0, 0, _OFFSET_ARG0), (_JSET, 0, 1, _CLONE_THREAD), allow, deny(errno.EAGAIN)]
        rules += [("clone", thread_only), ("clone3", [deny(errno.ENOSYS)])]
    rules.append(("socket", [deny(errno.EACCES)]))
    for name in _SIGNAL_SELF_ONLY:
        targets = (own_pid,) if name in ("tgkill", "rt_tgsigqueueinfo", "tkill") else (0, own_pid)
        rules.append((name, arg0_in(targets, errno.EPERM)))
    rules += [(name, [deny(errno.EPERM)]) for name in _DENIED]

    program = [(_LD_ABS, 0, 0, _OFFSET_ARCH), (_JEQ, 1, 0, audit_arch), kill, (_LD_ABS, 0, 0, _OFFSET_NR)]
    if x32_floor is not None:
        program += [(_JGE, 0, 1, x32_floor), deny(errno.ENOSYS)]
    for name, body in rules:
        number = _SYSCALLS[name][column]
        if number is None:
            continue
        program.append((_JEQ, 0, len(body), number))
        program += body
    program.append(allow)
    return program


def _install_seccomp(libc: ctypes.CDLL, own_pid: int, allow_processes: bool) -> bool:
    """Install the filter; False when this architecture is not covered."""
    arch = platform.machine()
    if arch not in _ARCHES:
        return False
    instructions = _seccomp_program(arch, own_pid, allow_processes)
    packed = b"".join(struct.pack("HBBI", *instruction) for instruction in instructions)
    buffer = ctypes.create_string_buffer(packed, len(packed))
    prog = struct.pack("HP", len(instructions), ctypes.addressof(buffer))  # struct sock_fprog
    _check(libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, prog, 0, 0), "seccomp")
    return True


def confine(config: dict, protections: list[str]) -> None:
    """Limits, no privileges, the seccomp filter: everything the child does before the program."""
    libc = _libc()
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    _set_limits(config["limits"])
    protections.append("rlimits")
    _check(libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    protections.append("no_new_privs")
    if os.geteuid() == 0:
        _drop_capabilities(libc)
        protections.append("no_capabilities")
    allow_processes = config["limits"]["max_processes"] > 1
    if config["seccomp"] and _install_seccomp(libc, os.getpid(), allow_processes):
        protections.append("seccomp")


def install_audit_hook(config: dict, channel: Channel) -> None:
    """Enforce the sandbox rules at the Python level and report the limits a program runs into.

    Under seccomp this mostly turns kernel refusals into clear errors and limit reports. Without
    namespaces it also refuses file writes outside the working directory and ``ctypes`` (which
    would reach libc directly); audit hooks are no security boundary on their own (PEP 578).
    """
    own_pid = os.getpid()
    workdir = os.path.realpath(os.getcwd())
    allow_processes = config["limits"]["max_processes"] > 1
    guard_files = not config["namespaces"]

    def outside(path: object) -> bool:
        if isinstance(path, int) or path is None:
            return False
        text = os.fsdecode(path)
        real = os.path.realpath(text)
        return real not in _WRITABLE_DEVICES and real != workdir and not real.startswith(workdir + os.sep)

    def hook(event: str, args: tuple) -> None:
        if event in _PROCESS_EVENTS and not allow_processes:
            channel.send("limit", "processes")
            raise BlockingIOError(errno.EAGAIN, "The sandbox does not allow new processes")
        if event == "socket.__new__":
            channel.send("limit", "network")
            raise PermissionError(errno.EACCES, "The sandbox has no network")
        if event in ("os.kill", "os.killpg", "signal.pthread_kill"):
            target = args[0] if args else None
            if event == "signal.pthread_kill" or (event == "os.kill" and target in (0, own_pid)):
                return
            raise PermissionError(errno.EPERM, "The sandbox may only signal itself")
        if guard_files:
            if event == "ctypes.dlopen":
                raise PermissionError(errno.EPERM, "The sandbox does not allow ctypes")
            if event == "open" and len(args) >= 3:
                path, mode, flags = args[0], args[1] or "", args[2] or 0
                writing = any(c in str(mode) for c in "wax+") or bool(int(flags) & _WRITE_FLAGS)
                if writing and outside(path):
                    raise PermissionError(errno.EACCES, f"The sandbox may only write in {workdir}")
            elif (
                event in _PATH_EVENTS
                and args
                and any(outside(a) for a in args[:2] if isinstance(a, (str, bytes)))
            ):
                raise PermissionError(errno.EACCES, f"The sandbox may only change files in {workdir}")

    sys.addaudithook(hook)


def _report_exception(channel: Channel, exc: BaseException) -> None:
    if isinstance(exc, MemoryError):
        channel.send("limit", "memory")
    elif isinstance(exc, BlockingIOError) and exc.errno == errno.EAGAIN:
        channel.send("limit", "processes")
    elif isinstance(exc, OSError) and exc.errno == errno.EFBIG:
        channel.send("limit", "file_size")
    channel.send("exception", type(exc).__name__)


def run_program(config: dict, channel: Channel) -> int:
    """Run the program (and the tests); return the exit status for the child."""
    source = config["program"]
    # With tests the program is imported, not run: its `if __name__ == "__main__":` block stays
    # quiet, as in the HumanEval and MBPP harnesses.
    name = "__main__" if config["tests"] is None else "solution"
    namespace = {"__name__": name, "__file__": os.path.abspath("main.py"), "__builtins__": __builtins__}
    try:
        exec(compile(source, "main.py", "exec"), namespace)  # noqa: S102 - running it is the point
    except SystemExit:
        if config["tests"] is None:
            raise
        channel.send("exception", "SystemExit")
        return 1  # exiting before the tests ran passes none of them
    except BaseException as exc:  # noqa: BLE001 - any failure of the program is reported, then fails the run
        _report_exception(channel, exc)
        traceback.print_exc()
        return 1
    if config["tests"] is None:
        return 0
    channel.send("loaded")
    failed = 0
    for index, test in enumerate(config["tests"]):
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)  # noqa: S102
        except BaseException as exc:  # noqa: BLE001 - a failing test is a result, not a crash
            failed += 1
            _report_exception(channel, exc)
            print(f"--- test {index} failed ---", file=sys.stderr)
            traceback.print_exc()
            continue
        channel.send("pass", str(index))
    return 1 if failed else 0


def _wait_or_orphaned(child: int, result_fd: int) -> None:
    """Block until the child exits; if the caller dies first, kill the child and exit.

    The caller holds the read end of the result pipe for the whole run, so ``POLLERR`` on our
    write end means it is gone, even when it died before ``PR_SET_PDEATHSIG`` was set. Then the
    child is killed and this process exits, which in a PID namespace takes every other process in
    it down too (the caller's next process sweeps the directory). Needs ``pidfd_open`` (Linux
    5.3); without it this just waits, and ``PR_SET_PDEATHSIG`` alone ends the run.
    """
    try:
        pidfd = os.pidfd_open(child)
    except (AttributeError, OSError):
        return
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(result_fd, 0)  # POLLERR and POLLHUP are always reported
    while True:
        events = dict(poller.poll())
        if pidfd in events:
            os.close(pidfd)
            return
        if events.get(result_fd, 0) & (select.POLLERR | select.POLLHUP):
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
            os._exit(SETUP_FAILED)


def supervise(child: int, channel: Channel, result_fd: int) -> int:
    """Wait for the child, report how it ended, and return the status to exit with."""
    _wait_or_orphaned(child, result_fd)
    while True:
        try:
            pid, status, usage = os.wait4(-1, 0)
        except ChildProcessError:
            return SETUP_FAILED
        if pid == child:
            break
    cpu_s = usage.ru_utime + usage.ru_stime
    if os.WIFSIGNALED(status):
        code, sig = None, os.WTERMSIG(status)
    else:
        code, sig = os.WEXITSTATUS(status), None
    channel.send(
        "exit", json.dumps({"code": code, "signal": sig, "cpu_s": cpu_s, "maxrss_kb": usage.ru_maxrss})
    )
    return code if code is not None else 128 + sig


def main(argv: list[str]) -> None:
    config_path, result_fd = argv[1], int(argv[2])
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # die with whoever started the run
    with open(config_path, encoding="utf-8") as handle:
        config = json.load(handle)
    os.unlink(config_path)
    channel = Channel(result_fd, config["nonce"])
    protections: list[str] = []
    try:
        if config["namespaces"]:
            private_filesystem(int(config["limits"]["max_file_mb"]), protections)
    except OSError as exc:
        channel.send("setup_error", str(exc))
        os._exit(SETUP_FAILED)
    sys.stdout.flush()
    child = os.fork()
    if child:
        os._exit(supervise(child, channel, result_fd))
    try:
        confine(config, protections)
    except OSError as exc:
        channel.send("setup_error", str(exc))
        os._exit(SETUP_FAILED)
    if not config["namespaces"]:
        protections.append("file_write_guard")
    install_audit_hook(config, channel)
    channel.send("setup", ",".join(protections))
    sys.exit(run_program(config, channel))


if __name__ == "__main__":
    main(sys.argv)
