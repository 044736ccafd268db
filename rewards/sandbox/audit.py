"""The sandbox's Python audit hook (PEP 578), installed by :mod:`rewards.sandbox.boot` in both processes of a run.

Standard library only; ``boot.py`` loads it by path, like its other siblings.

Example:
    >>> "os.fork" in _PROCESS_EVENTS
    True
"""

from __future__ import annotations

import errno
import os
import sys

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


def install(config: dict, channel, may_signal: int | None = None) -> None:  # noqa: ANN001 - boot.Channel
    """Enforce the sandbox rules at the Python level and report the limits a program runs into.
    ``may_signal``: one more pid ``os.kill`` may aim at (the tests' side stops the program's process).

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
            # Only this process: pid 0 (killpg too) is the whole process group, the zygote and the tests' process.
            if event == "signal.pthread_kill" or (
                event == "os.kill" and target is not None and target in (own_pid, may_signal)
            ):
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
