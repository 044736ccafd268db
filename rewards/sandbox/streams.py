"""Feed and read one run's pipes on the event loop, with caps, a timeout and a kill: shared by both run paths.

A run (a slot's, :mod:`rewards.sandbox.pool`, or a plain process's) has four host-side pipe ends: its stdin to
write, its stdout and stderr to read up to a cap each (past it the run is killed), and the result pipe, drained
while the program runs so that a program with any number of tests never blocks on it. :func:`communicate` works on
raw descriptors with ``add_reader``/``add_writer``, so any event loop can run it.

Example:
    >>> import asyncio, os
    >>> out_r, out_w = os.pipe(); os.write(out_w, b"hi"); os.close(out_w)
    2
    >>> null = [os.open(os.devnull, os.O_RDONLY) for _ in range(2)]
    >>> async def done(): return 0
    >>> asyncio.run(communicate([os.open(os.devnull, os.O_WRONLY), out_r, *null], b"", 5, 100, done, lambda: None))[0]
    b'hi'
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

from rewards.sandbox.result import MAX_REPORT_BYTES


async def ready(loop: asyncio.AbstractEventLoop, fd: int, write: bool) -> None:
    """Wait until ``fd`` is writable (``write``) or readable."""
    future = loop.create_future()
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: future.done() or future.set_result(None))
    try:
        await future
    finally:
        remove(fd)


async def communicate(
    fds: list[int],
    stdin: bytes | None,
    timeout_s: float,
    cap: int,
    wait: Callable[[], Awaitable[int | None]],
    kill: Callable[[], None],
    grace_s: float = 5.0,
) -> tuple[bytes, bytes, bytes, bool, bool, int | None]:
    """Feed stdin and read stdout, stderr and the result pipe until the run ends or ``timeout_s`` passes.

    Args:
        fds: The host's ends ``[stdin, stdout, stderr, result]``; this closes them.
        stdin: The bytes for the run's stdin.
        timeout_s: Wall-clock seconds before ``kill``.
        cap: Bytes kept of stdout and of stderr each; writing more calls ``kill``.
        wait: Resolves to the run's exit status (negative: killed by that signal) once it ended.
        kill: Kills the whole run; called on a timeout, an overflow, or when the caller gives up.
        grace_s: Seconds to wait, after a kill, for the pipes to close and ``wait`` to resolve.

    Returns:
        ``(stdout, stderr, reports, timed_out, overflow, returncode)``.
    """
    loop = asyncio.get_running_loop()
    for fd in fds:
        os.set_blocking(fd, False)
    overflow = False

    async def feed(fd: int) -> None:
        view = memoryview(stdin or b"")
        try:
            while view:
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    await ready(loop, fd, write=True)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the program exited without reading all of its input
        finally:
            os.close(fd)

    async def read(fd: int, limit: int, killing: bool) -> bytes:
        nonlocal overflow
        buffer = bytearray()
        try:
            while True:
                try:
                    chunk = os.read(fd, 65536)
                except BlockingIOError:
                    await ready(loop, fd, write=False)
                    continue
                if not chunk:
                    return bytes(buffer)
                room = limit - len(buffer)
                if len(chunk) > room and killing and not overflow:
                    overflow = True
                    kill()
                buffer += chunk[: max(0, room)]  # past the cap: read to the end and drop
        finally:
            os.close(fd)

    tasks = [
        asyncio.ensure_future(feed(fds[0])),
        out := asyncio.ensure_future(read(fds[1], cap, True)),
        err := asyncio.ensure_future(read(fds[2], cap, True)),
        reports := asyncio.ensure_future(read(fds[3], MAX_REPORT_BYTES, False)),
        waiter := asyncio.ensure_future(wait()),
    ]
    try:
        _, pending = await asyncio.wait(tasks, timeout=timeout_s)
    except asyncio.CancelledError:  # the caller gave up
        kill()
        for task in tasks:
            task.cancel()
        raise
    timed_out = not waiter.done()
    if pending:
        kill()
        _, pending = await asyncio.wait(pending, timeout=grace_s)
        for task in pending:
            task.cancel()
        if pending:
            await asyncio.wait(pending)  # let each task close its descriptor

    def result(task: asyncio.Future, default: object) -> object:
        return task.result() if task.done() and not task.cancelled() and task.exception() is None else default

    return (
        result(out, b""),
        result(err, b""),
        result(reports, b""),
        timed_out,
        overflow,
        result(waiter, None),
    )
