"""The supervisor's half of a run (:mod:`rewards.sandbox.boot`, step 5): pass the program's diagnostics on, wait
for the program's process or stop it, report how the run ended.

Standard library only; ``boot.py`` loads it by path, like its other siblings. It runs in the run's first
process: the supervisor of a run without tests, or the tests' process once the tests are done.

Example:
    >>> DRAIN_S > 0
    True
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import threading
import time

SETUP_FAILED = 121
"""Exit status when the sandbox could not be set up (or its caller went away); the program never ran."""
DIAGNOSTICS = {
    "limit": {"memory", "processes", "file_size", "network"}.__contains__,
    "exception": str.isidentifier,
}
"""What the program's process may report through the supervisor after its set-up line: limits it ran into
inside (the parent sees wall time, CPU time and output itself) and exception type names."""
MAX_DIAGNOSTICS = 256
DRAIN_S = 2.0
"""Seconds the supervisor reads the program's diagnostics after it ended (a process the program started may
hold the pipe open)."""


class Forwarder:
    """Passes on what the program's process reports: its first line (set-up) as it is, then limits and
    exceptions only, at most :data:`MAX_DIAGNOSTICS` lines; never a verdict. The program's process waits on
    ``gate`` until its set-up line is on the result pipe: a run killed a moment later still reads as started.
    Read by the supervisor itself, between its other waits (no thread: a thread per run costs a stack and a
    ``clone``)."""

    _MAX_LINE = 4096
    """Bytes kept of one line (a longer one is no diagnostic the supervisor passes on)."""

    def __init__(self, diagnostics: int, channel, gate: int):  # noqa: ANN001 - boot.Channel
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
            else DIAGNOSTICS.get(kind, lambda _: False)(payload)
        )
        if allowed and self._forwarded < MAX_DIAGNOSTICS:
            self._forwarded += 1
            self._channel.send(kind, payload)
        if self._first:
            self._first = False
            os.close(self._gate)

    def until_first_line(self) -> None:
        """Read until the program's first line (its set-up) is passed on, or the pipe ends."""
        while self._first and self.fd >= 0:
            select.select([self.fd], [], [])
            self.read()

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
        """Read until end-of-file, at most ``timeout_s`` (None: no limit)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.fd >= 0:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            if select.select([self.fd], [], [], left)[0] and not self.read():
                return
        self.close()


def wait_program(program: int, result_fd: int, forwarder: Forwarder) -> tuple[int, object]:
    """The program's ``(status, rusage)`` once it ended (a run without tests), passing its diagnostics on
    meanwhile. If the caller dies first (``POLLERR`` on the result pipe, whose read end it holds), kill the
    program and exit."""
    try:
        pidfd = os.pidfd_open(program)
    except (AttributeError, OSError):  # before Linux 5.3: PR_SET_PDEATHSIG ends an orphan
        reader = threading.Thread(target=forwarder.drain, args=(None,), daemon=True)
        reader.start()
        _, status, usage = os.wait4(program, 0)
        reader.join(timeout=DRAIN_S)
        return status, usage
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(result_fd, 0)  # POLLERR and POLLHUP are always reported
    poller.register(forwarder.fd, select.POLLIN)
    while True:
        events = dict(poller.poll())
        if events.get(result_fd, 0) & (select.POLLERR | select.POLLHUP):
            with contextlib.suppress(OSError):
                os.kill(program, signal.SIGKILL)
            os._exit(SETUP_FAILED)
        if forwarder.fd in events:
            diagnostics = forwarder.fd
            if not forwarder.read():
                poller.unregister(diagnostics)
        if pidfd in events:
            break
    _, status, usage = os.wait4(program, 0)
    os.close(pidfd)
    forwarder.drain(DRAIN_S)
    return status, usage


def stop_program(
    program: int, forwarder: Forwarder, ended: tuple[int, int, object] | None, drain: bool = True
) -> tuple[int, object]:
    """The program's ``(status, rusage)`` once the tests are done: as it ended on its own (``ended``: its
    ``wait4(WNOHANG)`` taken before the tests' channel closed), or else killed and counted as if it exited 0
    (the verdict is in; not the program's failure, whatever it did after). Its last diagnostics passed on."""
    if ended is not None and ended[0] != 0:
        status, usage = ended[1], ended[2]
    else:
        with contextlib.suppress(OSError):
            os.kill(program, signal.SIGKILL)
        _, _, usage = os.wait4(program, 0)
        status = 0
    if drain:
        forwarder.drain(DRAIN_S)
    return status, usage


def report(channel, status: int, usage, failed: int | None) -> int:  # noqa: ANN001 - boot.Channel, rusage
    """Report how the run ended on ``channel``; the exit status.

    The exit status is the program's when it failed (exit status or signal), else the tests' (``failed``: 0 only
    when every test passed; None without tests). The CPU time is the program's.
    """
    cpu_s = usage.ru_utime + usage.ru_stime
    code, sig = (None, os.WTERMSIG(status)) if os.WIFSIGNALED(status) else (os.WEXITSTATUS(status), None)
    if failed is not None and code == 0:
        code = failed
    channel.send(
        "exit", json.dumps({"code": code, "signal": sig, "cpu_s": cpu_s, "maxrss_kb": usage.ru_maxrss})
    )
    return code if code is not None else 128 + sig
