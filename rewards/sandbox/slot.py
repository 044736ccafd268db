"""One pool slot, host side: start its ``bwrap`` and zygote, get it ready for each run, kill it.

A slot (:mod:`rewards.sandbox.pool` lends them) is one long-lived ``bwrap`` (:func:`rewards.sandbox.bwrap.slot_command`)
running the zygote (:mod:`rewards.sandbox.zygote`) as PID 1. :func:`start_slot` starts it and waits for the
zygote's ``R``; :meth:`Slot.prepare` takes the zygote's next child into the next run's fresh cgroups (its host pid
from ``SO_PASSCRED``) ahead of the run; :meth:`Slot.close` kills it. :func:`receive` reads the slot's next message
on any event loop, :func:`memfd` seals a run's config or verdict.

Example:
    >>> SLOT_UID > bwrap.SANDBOX_UID
    True
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import select
import signal
import site
import socket
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import rewards.sandbox.bwrap as bwrap
from rewards.sandbox.streams import ready

logger = logging.getLogger(__name__)

ZYGOTE_SCRIPT = Path(__file__).with_name("zygote.py")
SLOT_UID = bwrap.SANDBOX_UID + 4096
"""A root caller's slot ``i`` runs as host uid ``SLOT_UID + i``."""
START_TIMEOUT_S = 60.0
"""Seconds a new slot may take to say it is ready, and a slot to fork a run's first process."""
DEFAULT_MEMORY_MB = 1024
"""The memory limit a run's cgroup is made with, ahead of the run (set to the run's own when it starts)."""
KILL_GRACE_S = 5.0
"""Seconds to wait for a killed run's pipes to close and its slot to report it reaped."""

_CREDENTIALS = struct.Struct("=iII")  # struct ucred: pid, uid, gid


class SlotError(RuntimeError):
    """A slot could not be started or stopped answering; the run gets ``sandbox_error``."""


@dataclass(eq=False)
class Slot:
    """One long-lived boundary and its zygote."""

    index: int
    process: subprocess.Popen
    control: socket.socket
    zygote: int | None = None
    """A pidfd of the zygote (the slot's PID 1), once it said it is ready."""
    stderr: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=20))
    runs: int = 0
    cgroups: bwrap.Cgroups = field(default_factory=bwrap.Cgroups)
    """The cgroups of the slot's next run, which its waiting PID 1 is already in."""
    waiting: int | None = None
    """A pidfd of the next run's PID 1, forked ahead of the run and waiting for its request."""

    def prepare(self) -> None:
        """Take the zygote's next PID 1 (``P``), make the next run's cgroups and move it into them; blocking, off any
        event loop (a move into a v1 cgroup waits for an RCU grace period, about 5 ms)."""
        self.control.settimeout(START_TIMEOUT_S)
        try:
            message, ancillary, _, _ = self.control.recvmsg(16, socket.CMSG_SPACE(_CREDENTIALS.size))
        except OSError as exc:
            raise SlotError(f"the sandbox slot stopped answering: {exc}") from exc
        finally:
            self.control.setblocking(False)
        pid = sender(ancillary)
        if message != b"P" or pid is None:
            raise SlotError(
                f"the sandbox slot answered {message!r}: {' | '.join(self.stderr) or 'no output'}"
            )
        self.waiting = os.pidfd_open(pid)  # PID 1 waits for G: it is alive, so this pid is its
        self.cgroups = bwrap.Cgroups.make(DEFAULT_MEMORY_MB, bwrap.CGROUP_TASKS)
        try:
            self.cgroups.join(pid)
            if select.select([self.waiting], [], [], 0)[
                0
            ]:  # PID 1 died: that pid may be another process's now
                raise OSError(errno.ESRCH, "the slot's first process died")
            self.control.send(b"G")  # PID 1 makes the run's namespaces and waits for the request
        except OSError as exc:
            raise SlotError(f"cannot move the sandbox run into its cgroups: {exc}") from exc

    def finish(self) -> None:
        """Forget the last run: kill what is left of it, remove its cgroups; never raises."""
        if self.waiting is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.waiting, signal.SIGKILL)
            os.close(self.waiting)
            self.waiting = None
        self.cgroups.remove()
        self.cgroups = bwrap.Cgroups()

    def close(self) -> None:
        """Kill the slot (the zygote first, so that ``bwrap`` reaps it and exits; then the launcher's process
        group, and every run with the slot's PID namespace); never raises."""
        if self.zygote is not None:
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(self.zygote, signal.SIGKILL)
            with contextlib.suppress(OSError, subprocess.TimeoutExpired):
                self.process.wait(timeout=KILL_GRACE_S)
            with contextlib.suppress(OSError):
                os.close(self.zygote)
            self.zygote = None
        with contextlib.suppress(OSError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            self.control.close()
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            self.process.wait(timeout=KILL_GRACE_S)
        self.finish()


@functools.cache
def site_packages() -> list[str]:
    """This interpreter's (or virtualenv's) ``site-packages``: the sandbox runs ``python -S`` and adds them itself."""
    return [path for path in site.getsitepackages() if os.path.isdir(path)]


def _drain(slot: Slot) -> None:
    """Keep the last lines the slot writes to its stderr (the zygote's own errors), logging each."""
    assert slot.process.stderr is not None
    with contextlib.suppress(OSError, ValueError):
        for raw in slot.process.stderr:
            line = raw.decode("utf-8", "replace").rstrip()
            slot.stderr.append(line)
            logger.warning("Sandbox slot %d: %s", slot.index, line)


def start_slot(index: int, env: dict[str, str]) -> Slot:
    """Start slot ``index`` and wait for its zygote's ``R``; runs on the pool's thread."""
    if (missing := bwrap.missing_tools()) is not None:
        raise SlotError(missing)
    host, inside = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    host.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    argv = [sys.executable, "-I", "-S", "-B", "-X", "utf8", str(ZYGOTE_SCRIPT), str(inside.fileno())]
    slot_env = {**env, "DNA_SANDBOX_SITE": json.dumps(site_packages())}
    bwrap.ensure_stage()
    command = bwrap.slot_command(argv, slot_env)
    uid = SLOT_UID + index
    try:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(inside.fileno(),),
            env=bwrap.launcher_env(uid),
            cwd="/",
            start_new_session=True,
        )
    except OSError as exc:
        host.close()
        raise SlotError(f"cannot start {command[0]}: {exc}") from exc
    finally:
        inside.close()
    slot = Slot(index, process, host)
    host.settimeout(START_TIMEOUT_S)
    try:
        hello, ancillary, _, _ = host.recvmsg(16, socket.CMSG_SPACE(_CREDENTIALS.size))
        slot.zygote = os.pidfd_open(sender(ancillary) or 0)
    except OSError:
        hello = b""
    if hello != b"R":
        slot.close()
        tail = process.stderr.read().decode("utf-8", "replace").strip()[-500:] if process.stderr else ""
        raise SlotError(
            f"the sandbox slot did not start (exit status {process.returncode}): {tail or 'no output'}"
        )
    host.setblocking(False)
    threading.Thread(target=_drain, args=(slot,), name=f"sandbox-slot-{index}-stderr", daemon=True).start()
    try:
        slot.prepare()
    except BaseException:
        slot.close()
        raise
    return slot


def memfd(name: str, text: str) -> int:
    """A sealed memfd holding ``text`` (UTF-8), positioned at its start."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    data = text.encode("utf-8", "replace")  # a lone surrogate in the program: '?' in the copy for tracebacks
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    fcntl.fcntl(
        fd,
        fcntl.F_ADD_SEALS,
        fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE,
    )
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def receive(slot: Slot) -> tuple[bytes, int | None]:
    """The slot's next message and the host pid of its sender (``SO_PASSCRED``); ``b""`` when the slot is gone."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            message, ancillary, _, _ = slot.control.recvmsg(64, socket.CMSG_SPACE(_CREDENTIALS.size))
        except BlockingIOError:
            await ready(loop, slot.control.fileno(), write=False)
            continue
        except OSError:
            return b"", None
        return message, sender(ancillary)


def sender(ancillary: list[tuple[int, int, bytes]]) -> int | None:
    """The host pid in a message's ``SCM_CREDENTIALS`` (the kernel's, with ``SO_PASSCRED``: never forged)."""
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS and len(data) >= _CREDENTIALS.size:
            return _CREDENTIALS.unpack(data[: _CREDENTIALS.size])[0]
    return None
