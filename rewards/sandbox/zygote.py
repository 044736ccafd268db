"""A pool slot's zygote: one long-lived interpreter inside the boundary that forks a fresh sandbox per run.

:mod:`rewards.sandbox.pool` starts ``python -I -S -B -X utf8 zygote.py CONTROL_FD`` inside one ``bwrap`` per slot
(:func:`rewards.sandbox.bwrap.slot_command`): every namespace new, no nested user namespaces (``--disable-userns``),
uid 65534, and the capabilities ``CAP_SYS_ADMIN`` and ``CAP_SETPCAP`` *in the slot's own user namespace*, which
are what building a run's namespaces and dropping the bounding set need. It imports :mod:`~rewards.sandbox.boot`
once, so a run costs a ``fork``, not an interpreter start (that is the pool's whole point).

The zygote receives nothing at all: it forks one process ahead of each run and reports how it ended. The
run's descriptors (its stdin/stdout/stderr pipes, its result pipe, and two sealed memfds: the program's config
and the verdict) go straight to the run's own PID 1 (``SCM_RIGHTS`` on ``CONTROL_FD``, a ``SOCK_SEQPACKET``
socket). So no program, test or nonce is ever in the zygote's memory, and nothing of one run is in the next
run's copy of it. Per run:

1. The zygote forks the run's **PID 1** ahead of the run, straight into a new PID namespace (``clone`` with
   ``CLONE_NEWPID``, between the interpreter's own fork hooks: :func:`_fork_pid1`). PID 1 says ``P`` on the
   control socket. The host reads its host pid from the message's credentials (``SO_PASSCRED``), moves it into
   the next run's fresh cgroups (root), keeps a pidfd on it, and answers ``G``.
2. PID 1 unshares mount, IPC, UTS and cgroup namespaces (the network namespace is the slot's own: it has only
   a loopback device, and the seccomp filter refuses ``socket()``), makes every mount private, and waits for the
   run. It dies with the zygote (``PR_SET_PDEATHSIG``; the zygote is the slot's PID 1, so its death ends every
   process of the slot anyway).
3. The run arrives: PID 1 moves its six descriptors to 0..5 and closes every other one (the control socket
   included), mounts fresh ``nosuid,nodev`` ``tmpfs`` for ``/w``, ``/tmp`` and ``/dev/shm`` (bounded in size and
   inodes), drops every capability and the bounding set, writes ``/w/main.py`` (for tracebacks), and becomes
   the supervisor of :func:`rewards.sandbox.boot.run`: the program's process and the tests' process, as in a
   one-shot run. When it exits, the kernel kills whatever is left in its PID namespace.
4. The zygote reaps PID 1 (and any orphan) and sends ``D`` and PID 1's exit status, then forks the next one.

One process fewer than forking a helper that unshares the PID namespace and forks PID 1 (what a zygote that
calls ``os.fork`` must do, since ``unshare(CLONE_NEWPID)`` works once per process and the slot's user namespace
may not ``setns`` back): every forked copy of the interpreter costs its page tables, its copy-on-write faults
and its exit, the largest share of a run (bench/sandbox_throughput.py).

Not meant to be started by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import errno
import gc
import importlib
import importlib.util
import json
import os
import platform
import signal
import socket
import struct
import sys


def _load_boot():  # noqa: ANN202 - a module loaded by path, as boot.py loads its siblings
    spec = importlib.util.spec_from_file_location(
        "_dna_sandbox_boot", os.path.join(os.path.dirname(__file__), "boot.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


boot = _load_boot()

PRELOAD = (
    "bisect",
    "collections",
    "copy",
    "dataclasses",
    "fractions",
    "functools",
    "hashlib",
    "heapq",
    "itertools",
    "math",
    "random",
    "re",
    "statistics",
    "string",
    "typing",
)
"""Standard-library modules imported once here, so a run's ``import typing`` (15 ms) costs nothing, as in a
harness that forks its workers from a warm interpreter. Each run gets a pristine copy (``fork``); ``random``
reseeds itself in every forked process (``os.register_at_fork``)."""

REQUEST = struct.Struct("=III")
"""A run request: ``max_file_mb``, the inode limit of each mount, and the slot's run number."""
DONE = struct.Struct("=ci")
"""The zygote's answer once a run's PID 1 is reaped: ``b"D"`` and its exit status (negative: killed by that signal)."""
FDS = 6
"""stdin, stdout, stderr, result pipe, config memfd, verdict memfd, in that order."""

_CLONE_NEWNS, _CLONE_NEWCGROUP, _CLONE_NEWUTS, _CLONE_NEWIPC, _CLONE_NEWPID = (
    0x20000,
    0x02000000,
    0x04000000,
    0x08000000,
    0x20000000,
)
_MS_NOSUID, _MS_NODEV, _MS_REC, _MS_PRIVATE = 2, 4, 0x4000, 1 << 18
_PR_SET_PDEATHSIG, _PR_SET_DUMPABLE = 1, 4
_SYS_CLONE = {"x86_64": 56, "aarch64": 220}
_ZEROS = tuple(ctypes.c_long(0) for _ in range(4))  # clone's stack (the caller's, as fork), tid pointers, TLS
_RESULT, _CONFIG, _VERDICT = 3, 4, 5
"""Where PID 1 puts the result pipe, the config and the verdict."""


def _mount(libc: ctypes.CDLL, target: str, size_mb: int, inodes: int, mode: str) -> None:
    options = f"size={size_mb << 20},nr_inodes={inodes},mode={mode}".encode()
    boot._check(
        libc.mount(b"tmpfs", target.encode(), b"tmpfs", _MS_NOSUID | _MS_NODEV, options), f"mount {target}"
    )


def _place(fds: list[int]) -> None:
    """Put the run's descriptors at 0..5, then close every other descriptor (the control socket included)."""
    moved = [os.dup(fd) for fd in fds]  # above every target first: no dup2 clobbers a source
    for target, fd in enumerate(moved):
        os.dup2(fd, target, inheritable=target < 3)
    os.closerange(len(moved), 1 << 20)  # close_range(2): the zygote's own fds and the copies made above


def _fork_pid1(libc: ctypes.CDLL) -> int:
    """``os.fork()`` whose child is PID 1 of a new PID namespace: ``clone(CLONE_NEWPID | SIGCHLD)``, with the fork
    hooks ``os.fork`` runs around ``fork(2)`` (the import lock, ``threading``'s and ``random``'s reinit in the
    child). The child's pid (0 in the child).

    Sound because the zygote has one thread (:func:`main` checks): glibc's own fork-time resets (malloc's and
    stdio's locks, ``pthread_atfork`` handlers) matter only with other threads. No tid pointer is passed, so
    glibc's cached tid in the child is the zygote's: 1 there and 1 in the new namespace (the zygote is its
    slot's PID 1, ``--as-pid-1``), and ``raise``/``pthread_kill`` of itself ask the kernel anyway. Only zeros
    follow the flags, so the architectures' different argument orders (x86_64: stack, parent tid, child tid,
    TLS; aarch64: stack, parent tid, TLS, child tid) do not matter."""
    number = _SYS_CLONE.get(platform.machine())
    if number is None:
        raise OSError(errno.ENOSYS, f"sandbox slots know clone(2) on {', '.join(_SYS_CLONE)} only")
    arguments = (ctypes.c_long(number), ctypes.c_long(_CLONE_NEWPID | signal.SIGCHLD), *_ZEROS)
    api = ctypes.pythonapi
    api.PyOS_BeforeFork()
    pid = -1
    try:
        pid = libc.syscall(*arguments)
    finally:
        if pid == 0:
            api.PyOS_AfterFork_Child()
        else:
            api.PyOS_AfterFork_Parent()
    if pid < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"clone: {os.strerror(code)}")
    return pid


def _pid1(control: int) -> None:
    """The run's PID 1 (module docstring, steps 1 to 3), forked ahead of its run; never returns."""
    libc = boot._libc()
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    control_socket = socket.socket(fileno=control)
    control_socket.setblocking(True)
    control_socket.send(b"P")
    if control_socket.recv(1) != b"G":  # the host is gone
        os._exit(boot.SETUP_FAILED)
    boot._check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "PR_SET_PDEATHSIG")
    boot._check(libc.unshare(_CLONE_NEWNS | _CLONE_NEWIPC | _CLONE_NEWUTS | _CLONE_NEWCGROUP), "unshare")
    boot._check(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "private mounts")
    message, fds, _, _ = socket.recv_fds(control_socket, REQUEST.size, FDS)  # the run, at last
    if len(message) != REQUEST.size or len(fds) != FDS:  # the host is gone (b"") or speaks another protocol
        os._exit(boot.SETUP_FAILED)
    control_socket.send(b"S")  # taken: the host starts the run's clock; no other message answers this one
    control_socket.detach()  # closed with the rest by _place
    max_file_mb, inodes, _ = REQUEST.unpack(message)
    _place(fds)
    try:
        _mount(libc, "/w", max_file_mb, inodes, "0700")
        _mount(libc, "/tmp", max_file_mb, inodes, "1777")
        _mount(libc, "/dev/shm", max_file_mb, inodes, "1777")
        boot._drop_capabilities(libc)
        with os.fdopen(_CONFIG, "rb") as handle:
            config = json.loads(handle.read())
        os.chdir("/w")
        with open("/w/main.py", "w", encoding="utf-8", errors="replace") as handle:  # for tracebacks
            handle.write(config["program"])
    except OSError as exc:
        print(f"sandbox set-up failed: {exc}", file=sys.stderr, flush=True)
        os._exit(boot.SETUP_FAILED)
    boot.run(config, _VERDICT, _RESULT)


def main(argv: list[str]) -> None:
    control = socket.socket(fileno=int(argv[1]))
    control.setblocking(True)
    libc = boot._libc()
    boot._check(libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0), "PR_SET_DUMPABLE")  # no run reads this process
    sys.path.extend(json.loads(os.environ.pop("DNA_SANDBOX_SITE", "[]")))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for name in PRELOAD:
        importlib.import_module(name)
    fork_libc = ctypes.PyDLL(None, use_errno=True)  # keeps the GIL across clone(2), as os.fork does
    if len(os.listdir("/proc/self/task")) != 1:  # what _fork_pid1 relies on
        raise SystemExit("sandbox zygote: another thread is running; cannot fork runs with clone(2)")
    # What every run would otherwise build in its own copy-on-write memory: libc's functions, the seccomp filters
    # (a run's PID 1 runs the tests; the program's process is its first child, pid 2).
    for name in ("prctl", "unshare", "mount", "capget", "capset"):
        getattr(libc, name)
    boot.seccomp.warm((1, 2))
    gc.freeze()  # the zygote's objects are never collected again: a run's collections do not touch (copy) them
    control.send(b"R")
    while True:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = _fork_pid1(fork_libc)
        if pid == 0:
            atexit._clear()  # nothing of the zygote's runs at a run's exit
            try:
                _pid1(control.fileno())
            except SystemExit as exc:  # the program's or the tests' process (forked in boot.run) ends
                boot.exit_as_interpreter(exc)
            except BaseException as exc:  # noqa: BLE001 - PID 1 must never return into the zygote's loop
                with contextlib.suppress(OSError):
                    os.write(2, f"sandbox set-up failed: {exc}\n".encode())  # the run's stderr, once placed
            finally:
                os._exit(boot.SETUP_FAILED)
        while True:  # reap PID 1, and any orphan that was reparented to this process (the slot's PID 1)
            reaped, status = os.waitpid(-1, 0)
            if reaped == pid:
                break
        try:
            control.send(DONE.pack(b"D", os.waitstatus_to_exitcode(status)))
        except OSError:
            break  # the host is gone


if __name__ == "__main__":
    main(sys.argv)
