"""A watchdog around TRL's async rollout worker: a dead child, a failing server or a stuck stop() is one error, never a hang.

TRL 1.16's ``AsyncRolloutWorker`` runs generation in a spawned child. Left alone:

* a child that dies during its start-up is a ``RuntimeError`` traceback (here: one line);
* a child that dies (out of memory, killed) is noticed only when its heartbeat is older than
  ``heartbeat_stale_after_s`` (default 300 s), as a ``RuntimeError`` with a traceback;
* ``stop()`` then sets the stop ``multiprocessing.Event``, whose ``notify_all`` waits for every waiter
  to wake — the dead child's stop-watcher thread never does, so ``stop()`` blocks for ever (and with it
  the trainer's ``finally``: the run hangs instead of failing; docs/async-grpo.md has the reproduction);
* a vLLM server whose engine died keeps the child retrying each request (30 tries of 3, back-off up to
  16 s) while its heartbeat stays fresh: minutes before the first error.

:class:`RolloutWatchdog` replaces the worker's ``check_health`` and ``stop`` (instance attributes; TRL calls
``self.rollout_worker.check_health(...)`` from ``RolloutQueueDataset`` every ``poll_interval_s`` the queue is
empty, and ``self.rollout_worker.stop()`` in ``_inner_training_loop``'s ``finally``) and watches from a
daemon thread: the child's liveness every second, the server's ``/health`` every ``server_probe_interval_s``.
A dead or failed child, or a server that has not answered for ``server_down_after_s``, is raised as one
:class:`~dna_factory.errors.DnaServiceError` line (exit 2) the next time the trainer waits for a sample. A
server outage is a cause only while it lasts: the watchdog keeps probing and forgets it once ``/health``
answers again, and ``check_health`` probes once more before raising one (a blip during a long step is ridden
out, as TRL's own request retries ride it out).

The watchdog ends the process itself (the same ``error:`` line, exit 2) only when the training loop is
blocked: the cause has stood for ``heartbeat_stale_after_s`` and for as long the loop has shown no progress
(:class:`Progress`: the trainer marks each sample it takes and each health check, and holds a busy mark
through a training step, a weight sync and a checkpoint save, which are never cut). ``stop()`` skips the stop
Event when the child is dead and is bounded by ``rollout_stop_timeout_s`` when it is alive.

TRL 1.16 private attributes used (canary: ``tests/test_async_grpo.py::test_trl_rollout_worker_watchdog_canary``):
``AsyncRolloutWorker._process``, ``._failed_event``, ``._exception_info_queue``, ``._loop_kwargs["vllm_server_url"]``.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import requests

from dna_factory.errors import DnaServiceError
from dna_factory.serving.services import server_root

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""How often the watchdog looks at the child."""
PROBE_TIMEOUT_S = 5.0
"""One ``/health`` request's timeout."""


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


@dataclass(frozen=True)
class WatchdogTimeouts:
    """The watchdog's keys (async GRPO's ``heartbeat_stale_after_s``, ``server_down_after_s``,
    ``server_probe_interval_s``, ``rollout_stop_timeout_s``; docs/async-grpo.md)."""

    grace_s: float = 300.0
    server_down_s: float = 60.0
    probe_s: float = 10.0
    stop_s: float = 30.0


class Progress:
    """What the training loop last showed of itself: marks (a sample taken, a health check) and busy spans (a
    step, a weight sync, a save). ``blocked_for`` is how long it has shown nothing, None while it is busy."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._busy: list[str] = []

    def mark(self) -> None:
        self._last = time.monotonic()

    @contextmanager
    def busy(self, what: str) -> Iterator[None]:
        with self._lock:
            self._busy.append(what)
        try:
            yield
        finally:
            with self._lock:
                self._busy.remove(what)
            self.mark()

    def doing(self) -> str | None:
        with self._lock:
            return self._busy[-1] if self._busy else None

    def blocked_for(self, now: float) -> float | None:
        return None if self.doing() is not None else now - self._last


class RolloutWatchdog:
    """Watches one ``AsyncRolloutWorker``; install it before the worker starts."""

    def __init__(self, worker, timeouts: WatchdogTimeouts = WatchdogTimeouts()) -> None:
        self.worker = worker
        self.timeouts = timeouts
        self.grace_s = timeouts.grace_s
        self.progress = Progress()
        self.cause: str | None = None
        self._server_cause = False  # the cause is an outage: forgotten when /health answers again
        self._lock = threading.Lock()
        self._detected_at: float | None = None
        self._down_since: float | None = None
        self._stopping = threading.Event()
        self._failure: tuple[str, str] | None = None
        url = worker._loop_kwargs.get("vllm_server_url")
        self.server = server_root(url, "vllm_server_base_url") if url else None
        self._trl_check_health = worker.check_health
        self._trl_stop = worker.stop
        trl_start = worker.start

        def start() -> None:
            try:
                trl_start()
            # TRL 1.16: "AsyncRolloutWorker child exited during init (exitcode=N). ..."
            except RuntimeError as exc:
                found = re.search(r"child exited during init \(exitcode=(-?\d+)\)", str(exc))
                if found is None:
                    raise
                raise DnaServiceError(
                    f"The async rollout worker's child process did not start: it ended during its start-up "
                    f"({_how_it_ended(int(found.group(1)))}; out of memory, or killed?). Its traceback, if any, is in "
                    "the log above; fix the cause and rerun."
                ) from None
            threading.Thread(target=self._watch, name="dna-rollout-watchdog", daemon=True).start()

        worker.start = start
        worker.check_health = self.check_health
        worker.stop = self.stop

    # ------------------------------------------------------------------ what is wrong

    def _child_cause(self) -> str | None:
        process = self.worker._process
        if process is None or self._stopping.is_set():
            return None
        if self.worker._failed_event.is_set() and self._failure is None:
            with self._lock:  # one reader of the exception queue: the other thread must not see it empty
                if self._failure is None:
                    try:
                        type_name, message, _ = self.worker._exception_info_queue.get_nowait()
                        self._failure = (type_name, message)
                    except queue.Empty:
                        self._failure = ("an exception", "")
        if self._failure is not None:
            type_name, message = self._failure
            text = " ".join(f"{type_name}: {message}".split())[:400]
            return (
                f"The async rollout worker's child process (pid {process.pid}) failed: {text}. Its traceback is "
                "in the log above; fix the cause and rerun (the run resumes from its last checkpoint)."
            )
        if not process.is_alive():
            return (
                f"The async rollout worker's child process (pid {process.pid}) died while training "
                f"({_how_it_ended(process.exitcode)}; out of memory, or killed?), so no more samples come. Find "
                "the cause in the system log (dmesg for the OOM killer) and rerun (the run resumes from its last "
                "checkpoint)."
            )
        return None

    def _server_down(self, since: float, last: str) -> str:
        return (
            f"The vLLM server at {self.server} stopped answering /health during training ({last} for "
            f"{time.monotonic() - since:.0f} s, over server_down_after_s={self.timeouts.server_down_s:g}; its engine "
            "may have crashed: see the server's log). Restart it and rerun (the run resumes from its last checkpoint)."
        )

    def _note(self, cause: str, server: bool = False) -> None:
        with self._lock:
            if self.cause is None:
                self.cause, self._server_cause = cause, server
                self._detected_at = time.monotonic()
                logger.error("%s", cause)

    def _probe(self) -> str | None:
        """Ask ``/health`` once: None when it answers 200, else what went wrong. Updates the outage clock, notes
        an outage past its bound, and forgets a noted outage that has ended."""
        try:
            status = requests.get(f"{self.server}/health", timeout=PROBE_TIMEOUT_S).status_code
            last = None if status == 200 else f"HTTP {status}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        now = time.monotonic()
        if last is None:
            with self._lock:
                was_down, self._down_since = self._down_since, None
                forget = self.cause is not None and self._server_cause
                if forget:
                    self.cause, self._server_cause, self._detected_at = None, False, None
            if forget:
                logger.warning(
                    "The vLLM server at %s answers /health again after %.0f s; training goes on.",
                    self.server,
                    now - was_down,
                )
            return None
        with self._lock:  # the watch thread and check_health both probe
            since = self._down_since = self._down_since or now
        if now - since >= self.timeouts.server_down_s:
            self._note(self._server_down(since, last), server=True)
        return last

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        next_probe = time.monotonic() + self.timeouts.probe_s
        while not self._stopping.wait(POLL_S):
            if self.cause is None or self._server_cause:
                cause = self._child_cause()
                if cause is not None:
                    with self._lock:  # a dead child outranks an outage: it does not come back
                        self.cause, self._server_cause = None, False
                    self._note(cause)
            if self.server and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + self.timeouts.probe_s
                self._probe()
            if self._blocked():
                self._hard_exit()

    def _blocked(self) -> bool:
        """A cause has stood for ``grace_s`` and the training loop has shown no progress for as long."""
        now = time.monotonic()
        detected = self._detected_at
        if self.cause is None or detected is None or now - detected <= self.grace_s:
            return False
        idle = self.progress.blocked_for(now)
        return idle is not None and idle > self.grace_s

    def _hard_exit(self) -> None:
        """The training thread did not end after the cause was raised to it: it is blocked. End the process."""
        sys.stderr.write(
            f"error: {self.cause} (The training loop showed no progress for {self.grace_s:g} s "
            "(heartbeat_stale_after_s) after that, so the process was stopped.)\n"
        )
        sys.stderr.flush()
        process = self.worker._process
        if process is not None and process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        os._exit(2)

    # ------------------------------------------------------------------ what TRL calls

    def check_health(self, stale_after_s: float) -> None:
        """TRL's check, first our own findings; any failure is one DnaServiceError line. An outage is
        probed once more first: a server that answers again is no cause."""
        self.progress.mark()
        child = self._child_cause()
        if child is not None and (self.cause is None or self._server_cause):
            with self._lock:
                self.cause, self._server_cause = None, False
            self._note(child)
        if self.cause is not None and self._server_cause and self.server:
            self._probe()
        cause = self.cause
        if cause is not None:
            raise DnaServiceError(cause)
        try:
            self._trl_check_health(stale_after_s)
        except RuntimeError as exc:
            pid = getattr(self.worker._process, "pid", None)
            self._note(
                f"The async rollout worker's child process (pid {pid}) is hung: {exc}. Its log is above; raise "
                "heartbeat_stale_after_s if it is only slow."
            )
            raise DnaServiceError(self.cause) from None

    def stop(self) -> None:
        """TRL's stop(), minus its deadlock on a dead child and bounded for a live one."""
        self._stopping.set()
        process = self.worker._process
        if process is None:
            return
        if process._popen is not None and not process.is_alive():
            # TRL would set the stop Event: its notify_all waits for the dead child's waiter to wake, for ever.
            process.join(timeout=1)
            self.worker._process = None
            logger.info("The rollout child had already ended (%s).", _how_it_ended(process.exitcode))
            return
        done = threading.Event()

        def trl_stop() -> None:
            try:
                self._trl_stop()
            finally:
                done.set()

        threading.Thread(target=trl_stop, name="dna-rollout-stop", daemon=True).start()
        if not done.wait(self.timeouts.stop_s):
            logger.warning(
                "The rollout worker did not stop within %g s (rollout_stop_timeout_s); its child is killed.",
                self.timeouts.stop_s,
            )
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            self.worker._process = None
