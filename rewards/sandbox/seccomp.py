"""The seccomp filter of the code sandbox: a classic-BPF program assembled by hand (standard library only).

:func:`program` builds the filter for x86_64 or aarch64 as ``(code, jt, jf, k)`` instructions; :func:`packed`
gives the bytes of its ``sock_filter[]`` array (what ``prctl(PR_SET_SECCOMP)`` and ``bwrap --seccomp`` take);
:func:`install` installs it on the calling thread's process. What it refuses: new processes (``fork``,
``clone`` without ``CLONE_THREAD``, ``execve``; threads stay allowed) unless processes are allowed, ``socket()``,
signals and ``prlimit`` aimed at any other process, ``fcntl`` ``F_SETOWN``/``F_SETSIG`` and ``ioctl``
``FIOSETOWN``/``SIOCSPGRP`` (signals on I/O), ``prctl(PR_SET_DUMPABLE)``,
``memfd_create``/``shmget``/``msgget`` unless a memory cgroup counts their pages, ``ptrace`` and ``process_vm_*``, mounts, new namespaces,
``setsid``/``setpgid``, ``bpf``, ``perf_event_open``, ``userfaultfd``, keyrings and io_uring. A call of another
architecture's ABI (x32 on x86_64, a foreign audit arch) kills the process.

Example:
    >>> program("x86_64", 1, allow_processes=False)[0]
    (32, 0, 0, 4)
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
import platform
import struct

_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 22, 2
_INSTRUCTION_BYTES = struct.calcsize("HBBI")
"""One ``struct sock_filter``."""

_CLONE_THREAD = 0x00010000
_CLONE_NEW_ANY = 0x7E020000
"""Every ``CLONE_NEW*`` flag (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET)."""

# seccomp return values and classic-BPF opcodes.
_RET_ALLOW, _RET_ERRNO, _RET_KILL_PROCESS = 0x7FFF0000, 0x00050000, 0x80000000
_LD_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_OFFSET_NR, _OFFSET_ARCH, _OFFSET_ARG0, _OFFSET_ARG1 = 0, 4, 16, 24
_F_SETOWN, _F_SETSIG, _F_SETOWN_EX = 8, 10, 15
"""fcntl commands that make the kernel signal a chosen process (SIGIO or any signal) on I/O."""
_FIOSETOWN, _SIOCSPGRP = 0x8901, 0x8902
"""The same through ioctl on a socket."""
_PR_SET_DUMPABLE = 4
"""Refused: the sandbox's processes stay non-dumpable (no /proc access between them, no core dump)."""

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
    "fcntl": (72, 25),
    "ioctl": (16, 29),
    "prctl": (157, 167),
    "execve": (59, 221),
    "execveat": (322, 281),
    "memfd_create": (319, 279),
    "memfd_secret": (447, 447),
    "shmget": (29, 194),
    "msgget": (68, 186),
    "prlimit64": (302, 261),
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
_PROCESS_CALLS = ("fork", "vfork", "clone", "clone3", "execve", "execveat")
_SELF_ONLY = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "prlimit64")
"""Allowed only aimed at this process (argument 0 is its pid; for ``prlimit64`` also 0, "this process"): signals,
and limits of another process. A signal to pid 0 or a negative pid reaches a whole process group, which holds the
slot's zygote and the tests' process: refused."""
_SHARED_MEMORY = ("memfd_create", "memfd_secret", "shmget", "msgget")
"""Refused where no memory cgroup counts their pages (``RLIMIT_AS`` does not)."""
_DENIED = tuple(
    name
    for name in _SYSCALLS
    if name not in (*_PROCESS_CALLS, *_SELF_ONLY, *_SHARED_MEMORY, "socket", "fcntl", "ioctl", "prctl")
)
"""Refused outright (EPERM): tracing, mounts, namespaces, new sessions, bpf, keyrings, io_uring."""


def program(
    arch: str,
    own_pid: int,
    allow_processes: bool,
    deny_shared_memory: bool = True,
    signal_also: int | None = None,
) -> list[tuple[int, int, int, int]]:
    """The classic-BPF seccomp filter as ``(code, jt, jf, k)`` instructions. ``signal_also``: one more pid that
    ``kill`` may aim at (the tests' side stops the program's process with it)."""
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
        # No new program either (it would also make the process dumpable again).
        rules += [("execve", [deny(errno.EPERM)]), ("execveat", [deny(errno.EPERM)])]
    else:
        # New processes, never new namespaces (the kernel refuses most without capabilities anyway; this holds
        # even where it would not). clone3's flags sit in memory a filter cannot read: ENOSYS, glibc uses clone.
        no_namespaces = [
            (_LD_ABS, 0, 0, _OFFSET_ARG0),
            (_JSET, 0, 1, _CLONE_NEW_ANY),
            deny(errno.EPERM),
            allow,
        ]
        rules += [("clone", no_namespaces), ("clone3", [deny(errno.ENOSYS)])]
    rules.append(("socket", [deny(errno.EACCES)]))
    for name in _SELF_ONLY:
        targets = (0, own_pid) if name == "prlimit64" else (own_pid,)
        if name == "kill" and signal_also is not None and signal_also > 0:
            targets += (signal_also,)
        rules.append((name, arg0_in(targets, errno.EPERM)))
    rules += [(name, [deny(errno.EPERM)]) for name in _DENIED]
    owner = [
        (_LD_ABS, 0, 0, _OFFSET_ARG1),
        (_JEQ, 2, 0, _F_SETOWN),
        (_JEQ, 1, 0, _F_SETSIG),
        (_JEQ, 0, 1, _F_SETOWN_EX),
    ]
    rules.append(("fcntl", [*owner, deny(errno.EPERM), allow]))  # F_SETOWN/F_SETSIG: signals to any process
    socket_owner = [(_LD_ABS, 0, 0, _OFFSET_ARG1), (_JEQ, 1, 0, _FIOSETOWN), (_JEQ, 0, 1, _SIOCSPGRP)]
    rules.append(("ioctl", [*socket_owner, deny(errno.EPERM), allow]))
    dumpable = [(_LD_ABS, 0, 0, _OFFSET_ARG0), (_JEQ, 0, 1, _PR_SET_DUMPABLE)]
    rules.append(("prctl", [*dumpable, deny(errno.EPERM), allow]))
    if deny_shared_memory:
        rules += [(name, [deny(errno.EPERM)]) for name in _SHARED_MEMORY]

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


def install(
    libc: ctypes.CDLL,
    own_pid: int,
    allow_processes: bool,
    deny_shared_memory: bool = True,
    signal_also: int | None = None,
) -> bool:
    """Install the filter (arguments as :func:`program`); False when this architecture is not covered."""
    arch = platform.machine()
    if arch not in _ARCHES:
        return False
    data = compiled(arch, own_pid, allow_processes, deny_shared_memory, signal_also)
    buffer = ctypes.create_string_buffer(data, len(data))
    prog = struct.pack("HP", len(data) // _INSTRUCTION_BYTES, ctypes.addressof(buffer))  # struct sock_fprog
    if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, prog, 0, 0) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"seccomp: {os.strerror(code)}")
    return True


@functools.lru_cache(maxsize=32)
def compiled(
    arch: str, own_pid: int, allow_processes: bool, deny_shared_memory: bool, signal_also: int | None
) -> bytes:
    """:func:`packed` :func:`program`, built once per set of arguments: a pool slot's zygote builds the ones its
    runs use before it forks them (:func:`rewards.sandbox.zygote.main`), so no run spends its own memory on it."""
    return packed(program(arch, own_pid, allow_processes, deny_shared_memory, signal_also))


def packed(instructions: list[tuple[int, int, int, int]]) -> bytes:
    """The instructions as the bytes of a ``struct sock_filter[]`` array."""
    return b"".join(struct.pack("HBBI", *instruction) for instruction in instructions)


def warm(own_pids: tuple[int, int]) -> None:
    """Build the filters a pool slot's runs install (:func:`compiled`): the program's process (``own_pids[1]``,
    one process or many) and the tests' side (``own_pids[0]``, which may signal the program's), with and without
    a memory cgroup. For a zygote, before it forks them."""
    arch = platform.machine()
    if arch not in _ARCHES:
        return
    tests, program_pid = own_pids
    for deny in (False, True):
        for processes in (False, True):
            compiled(arch, program_pid, processes, deny, None)
        compiled(arch, tests, False, deny, program_pid)
