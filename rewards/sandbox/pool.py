"""Pre-forked sandbox slots: one boundary per slot, a fresh set of namespaces per run, no interpreter start per run.

Starting ``bwrap`` and a Python interpreter for every program costs most of a run (about 150 ms of a 190 ms
HumanEval check on two cores). A **slot** is one long-lived ``bwrap`` (:func:`rewards.sandbox.bwrap.slot_command`)
whose interpreter, the **zygote** (:mod:`rewards.sandbox.zygote`), forks a fresh sandbox per run: new mount, PID,
IPC, UTS and cgroup namespaces, fresh size- and inode-bounded ``tmpfs`` mounts, every capability dropped, then the
same program/tests split and seccomp filter as ever (:mod:`rewards.sandbox.boot`). The host side here:

- :class:`Pool` starts slots on demand, up to :data:`MAX_SLOTS` (``DNA_SANDBOX_SLOTS``), from one long-lived
  thread (``bwrap --die-with-parent`` is tied to the thread that starts it), and lends each to one run at a time;
  any event loop may borrow one (``run_python`` runs a new loop per call).
- Ahead of each run (:meth:`Slot.prepare`, on the pool's thread) the host makes the run's cgroups and moves the
  zygote's next child into them (its host pid comes from the kernel, ``SO_PASSCRED``); that child forks the run's
  PID 1, which waits. :func:`run` then sends the run's descriptors to it, feeds and reads the run's pipes
  (:mod:`rewards.sandbox.streams`), and kills the run (cgroup, pidfd) on a timeout. A slot that does not answer
  as expected is killed and replaced, never reused.
- A root caller's slots each run as their own host uid (:data:`SLOT_UID`), leased host-wide (:func:`_lease`),
  so no two concurrent runs share per-user kernel counters, not even across trainers; a slot is recycled after
  :data:`RUNS_PER_SLOT` runs.

Example:
    >>> MAX_SLOTS >= 1
    True
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import queue
import signal
import socket
import struct
import tempfile
import threading
import time
from dataclasses import dataclass

from rewards.sandbox.slot import (  # noqa: F401 - SlotError, Slot and memfd are this module's API too
    KILL_GRACE_S,
    SLOT_UID,
    START_TIMEOUT_S,
    Slot,
    SlotError,
    memfd,
    receive,
    start_slot,
)
from rewards.sandbox.streams import communicate

logger = logging.getLogger(__name__)

MAX_SLOTS = max(1, int(os.environ.get("DNA_SANDBOX_SLOTS") or min(16, 2 * (os.cpu_count() or 1))))
"""Slots alive at once in this process; a run waits for a free one past that."""

RUNS_PER_SLOT = 500
"""Runs before a slot is replaced by a fresh one."""
INODES = 4096
"""Inodes of each of a run's ``tmpfs`` mounts (``/w``, ``/tmp``, ``/dev/shm``)."""
_REQUEST = struct.Struct("=III")  # zygote.REQUEST: max_file_mb, inodes, run number
_DONE = struct.Struct("=ci")  # zygote.DONE: b"D", exit status


_index_lock = threading.Lock()
_taken: dict[int, int | None] = {}
"""Slot indices this process uses, each with the descriptor of its host-wide lease (None for a non-root caller)."""
LEASE_DIR = "/run/dna-sandbox-slots"
"""Where a root caller leases slot indices (one ``flock`` per index), so concurrent trainers never share a uid."""


def _lease(index: int) -> tuple[bool, int | None]:
    """Whether ``index`` is free host-wide, and the descriptor that holds it until closed (or the process ends).

    Only a root caller's slots run as their own host uid (``SLOT_UID + index``): an exclusive ``flock`` on
    ``LEASE_DIR/<index>`` keeps two trainers on one host (each with its own pool) from running slots as the
    same uid, which would share per-uid kernel counters (inotify instances, processes, locked memory). The
    kernel drops the lock when the holder dies, even by SIGKILL.
    """
    if os.geteuid() != 0:
        return True, None  # every slot runs as this user's uid: nothing to share out
    fd = None
    for folder in (LEASE_DIR, os.path.join(tempfile.gettempdir(), "dna-sandbox-slots")):
        try:  # /run may be missing or read-only in a container: the temp dir is the fallback every trainer uses
            os.makedirs(folder, mode=0o700, exist_ok=True)
            fd = os.open(os.path.join(folder, str(index)), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            break
        except OSError:
            continue
    if fd is None:
        raise SlotError(
            f"cannot lease sandbox slot {index}: neither {LEASE_DIR} nor the temp dir is writable"
        )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False, None
    return True, fd


def _take_index(mine: set[int]) -> int:
    """The lowest slot index neither a pool of this process nor another process on this host uses (a root caller's
    slot ``i`` runs as uid SLOT_UID + i)."""
    with _index_lock:
        index = 0
        while True:
            if index not in _taken:
                free, fd = _lease(index)
                if free:
                    break
            index += 1
        _taken[index] = fd
    mine.add(index)
    return index


def _free_index(mine: set[int], index: int) -> None:
    mine.discard(index)
    with _index_lock:
        fd = _taken.pop(index, None)
    if fd is not None:
        os.close(fd)


class PoolClosed(SlotError):
    """The pool was closed while a run waited for one of its slots; the run asks the new pool."""


class Pool:
    """The slots of this process; :func:`pool` gives the one instance.

    Two long-lived threads do the slow work off every event loop: one starts slots (``bwrap --die-with-parent``
    is tied to the thread that starts it), the other gets a used slot ready for its next run (removes the last
    run's cgroups, takes the next run's PID 1 into fresh ones). A slot is lent only when it is ready. Both threads end
    once the pool is closed and nothing of it is left running.
    """

    def __init__(self, size: int = MAX_SLOTS):
        self.size = size
        self._lock = threading.Lock()
        self._free: list[Slot] = []
        self._busy: set[Slot] = set()
        self._indices: set[int] = set()
        """The indices of this pool's slots (started, lent or being made ready); each is unique in the process."""
        self._waiters: collections.deque[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = (
            collections.deque()
        )
        self._closed = False
        self._readying = 0
        self._starts: queue.SimpleQueue = queue.SimpleQueue()
        self._returns: queue.SimpleQueue = queue.SimpleQueue()
        for name, target in (
            ("sandbox-pool-start", self._start_slots),
            ("sandbox-pool-ready", self._ready_slots),
        ):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _start_slots(self) -> None:
        while (job := self._starts.get()) is not None:
            index, env, future = job
            try:
                slot = start_slot(index, env)
            except BaseException as exc:  # noqa: BLE001 - handed to the run that asked
                with self._lock:
                    _free_index(self._indices, index)
                future.set_exception(exc if isinstance(exc, SlotError) else SlotError(str(exc)))
            else:
                if self._lend(slot):
                    future.set_result(None)
                else:
                    slot.close()
                    future.set_exception(PoolClosed("the sandbox pool was closed"))
            self._wake()

    def _ready_slots(self) -> None:
        while (job := self._returns.get()) is not None:
            slot, keep = job
            try:
                slot.finish()
                if keep:
                    slot.prepare()
            except BaseException as exc:  # noqa: BLE001 - a slot that cannot go on is replaced
                logger.warning("Sandbox slot %d is replaced: %s", slot.index, exc)
                keep = False
            if not (keep and self._lend(slot)):
                slot.close()
                with self._lock:
                    _free_index(self._indices, slot.index)
            with self._lock:
                self._readying -= 1
                done = self._closed and not self._busy and not self._readying
            self._wake()
            if done:
                break
        # Only now may the start thread end: a slot's bwrap dies with the thread that started it.
        self._starts.put(None)

    def _lend(self, slot: Slot) -> bool:
        """Make ``slot`` free for the next run; False (the caller closes it) once the pool is closed."""
        with self._lock:
            self._busy.discard(slot)
            if self._closed:
                _free_index(self._indices, slot.index)
                return False
            self._free.append(slot)
            return True

    async def acquire(self, env: dict[str, str]) -> Slot:
        """A ready slot: a free one, a new one (while fewer than :attr:`size` exist), or the next one ready.

        Raises:
            SlotError: A new slot could not be started.
            PoolClosed: The pool was closed meanwhile.
        """
        loop = asyncio.get_running_loop()
        while True:
            started = None
            with self._lock:
                if self._closed:
                    raise PoolClosed("the sandbox pool was closed")
                if self._free:
                    slot = self._free.pop()
                    self._busy.add(slot)
                    return slot
                index = _take_index(self._indices) if len(self._indices) < self.size else None
                if index is not None:
                    started = concurrent.futures.Future()
                    self._starts.put((index, env, started))
                else:
                    waiter = loop.create_future()
                    self._waiters.append((loop, waiter))
            if started is not None:
                await asyncio.wrap_future(started)  # SlotError when it failed; a started slot is free now
                continue
            try:
                await waiter
            except asyncio.CancelledError:
                with self._lock:
                    woken = (loop, waiter) not in self._waiters
                if woken:
                    self._wake()  # the wake-up this run took is passed on
                raise
            finally:
                with self._lock, contextlib.suppress(ValueError):
                    self._waiters.remove((loop, waiter))

    def release(self, slot: Slot, healthy: bool) -> None:
        """Give ``slot`` back after a run: it is made ready again on the pool's thread, or closed when it misbehaved
        (or ran :data:`RUNS_PER_SLOT` runs)."""
        slot.runs += 1
        with self._lock:
            self._busy.discard(slot)
            self._readying += 1
        self._returns.put((slot, healthy and slot.runs < RUNS_PER_SLOT))

    def _wake(self, everyone: bool = False) -> None:
        """Let the first waiting run (or every one) try again."""
        with self._lock:
            while self._waiters:
                loop, waiter = self._waiters.popleft()
                if waiter.done():  # cancelled meanwhile
                    continue
                try:
                    loop.call_soon_threadsafe(lambda w=waiter: w.done() or w.set_result(None))
                except RuntimeError:  # that loop is closed
                    continue
                if not everyone:
                    return

    def close(self) -> None:
        """Kill every idle slot and wait (a few seconds at most) for those being made ready; a running one is
        closed when its run ends, and a run waiting for a slot asks the next pool. Never raises."""
        with self._lock:
            self._closed = True
            slots = list(self._free)
            self._free.clear()
            for slot in slots:
                _free_index(self._indices, slot.index)
            idle = not self._busy and not self._readying
        if idle:  # else the ready thread ends both threads once the last running slot is back and closed
            self._returns.put(None)
        self._wake(everyone=True)
        for slot in slots:
            slot.close()
        deadline = time.monotonic() + KILL_GRACE_S
        while self._readying and time.monotonic() < deadline:
            time.sleep(0.01)

    def forget(self) -> None:
        """In a forked child: drop the parent's slots without killing them (they are the parent's)."""
        for slot in [*self._free, *self._busy]:
            with contextlib.suppress(OSError):
                slot.control.close()
            if (
                slot.process.stderr is not None
            ):  # its buffer's lock may be held by the parent's reader thread:
                with contextlib.suppress(OSError):  # no close() here; /dev/null under the same number instead
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, slot.process.stderr.fileno(), inheritable=False)
                    os.close(null)
            for fd in (slot.zygote, slot.waiting):
                if fd is not None:
                    with contextlib.suppress(OSError):
                        os.close(fd)


_pool: Pool | None = None
_pool_lock = threading.Lock()


def pool() -> Pool:
    """This process's :class:`Pool`, made on first use."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = Pool()
        return _pool


def close_pool() -> None:
    """Close this process's pool (:meth:`Pool.close`; at exit, and in tests); the next run makes a new one."""
    global _pool
    with _pool_lock:
        closing, _pool = _pool, None
    if closing is not None:
        closing.close()


def _forget_pool() -> None:
    global _pool, _pool_lock, _index_lock, _taken
    for fd in _taken.values():  # a fork shares the parent's leases (flock is per open file): not its to hold
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
    _pool_lock, _index_lock, _taken = threading.Lock(), threading.Lock(), {}
    if _pool is not None:
        _pool.forget()
    _pool = None


atexit.register(close_pool)
os.register_at_fork(after_in_child=_forget_pool)


@dataclass
class Outcome:
    """What the host saw of one run."""

    returncode: int | None
    stdout: bytes
    stderr: bytes
    reports: bytes
    timed_out: bool
    overflow: bool
    oom_killed: bool = False


async def run(
    config: dict,
    verdict: str,
    stdin: bytes | None,
    timeout_s: float,
    memory_mb: int,
    max_file_mb: int,
    max_output_bytes: int,
    env: dict[str, str],
) -> Outcome:
    """One run in a slot: ``config`` (completed with the cgroups it gets) and ``verdict`` (JSON,
    :mod:`rewards.sandbox.boot`) go in as sealed memfds.

    Raises:
        SlotError: No slot could be started, or the slot failed before the run started (the slot is replaced).
    """
    while True:
        owner = pool()
        try:
            slot = await owner.acquire(env)
            break
        except PoolClosed:
            continue  # closed while this run waited: the next pool
    healthy = False
    fds: list[int] = []
    cgroups = slot.cgroups
    try:
        try:
            cgroups.limit(memory_mb)
            config = {
                **config,
                "memory_cgroup": cgroups.memory is not None,
                "tasks_cgroup": cgroups.pids is not None,
                "slot_tasks": 1,  # the zygote counts against the uid's RLIMIT_NPROC too
            }
            for _ in range(4):  # stdin, stdout, stderr, result: fds[0:8] as (read, write) pairs
                fds += os.pipe()
            fds.append(memfd("config", json.dumps(config)))
            fds.append(memfd("verdict", verdict))
            sent = [fds[0], fds[3], fds[5], fds[7], fds[8], fds[9]]
            socket.send_fds(slot.control, [_REQUEST.pack(int(max_file_mb), INODES, slot.runs)], sent)
            for fd in sent:
                fds.remove(fd)
                os.close(fd)
            message, _ = await asyncio.wait_for(receive(slot), timeout=START_TIMEOUT_S)
        except (OSError, TimeoutError) as exc:
            raise SlotError(f"the sandbox slot failed before the run started: {exc}") from exc
        if message != b"S":  # its PID 1 did not take the run (it died): the request may still be queued
            raise SlotError(
                f"the sandbox slot lost the run ({message!r}): {' | '.join(slot.stderr) or 'no output'}"
            )

        def kill() -> None:
            cgroups.kill()
            with contextlib.suppress(OSError):
                signal.pidfd_send_signal(slot.waiting, signal.SIGKILL)

        async def wait() -> int | None:
            nonlocal healthy
            message, _ = await receive(slot)
            if len(message) == _DONE.size and message[:1] == b"D":
                healthy = True
                return _DONE.unpack(message)[1]
            return None

        ends, fds = (
            fds,
            [],
        )  # stdin's write end, stdout's, stderr's and the result pipe's read ends: closed there
        stdout, stderr, reports, timed_out, overflow, returncode = await communicate(
            ends, stdin, timeout_s, max_output_bytes, wait, kill, KILL_GRACE_S
        )
        return Outcome(returncode, stdout, stderr, reports, timed_out, overflow, cgroups.oom_killed())
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        owner.release(slot, healthy)
