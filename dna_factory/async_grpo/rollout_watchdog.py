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
daemon thread: the child's liveness every second, the server's ``/health`` every 10 s. What it finds is
raised as one :class:`~dna_factory.errors.DnaServiceError` line (exit 2) the next time the trainer waits
for a sample. If the training thread has not ended ``grace_s`` seconds after that (it is blocked, e.g. on
a lock the dead child held), the watchdog prints the same ``error:`` line and ends the process (exit 2).
``stop()`` skips the stop Event when the child is dead and is bounded when it is alive.

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

import requests

from dna_factory.errors import DnaServiceError
from dna_factory.services import server_root

logger = logging.getLogger(__name__)

POLL_S = 1.0
"""How often the watchdog looks at the child."""
SERVER_PROBE_S = 10.0
"""How often it asks the vLLM server's ``/health``."""
SERVER_DOWN_S = 60.0
"""A server that has not answered ``/health`` for this long during training ends the run."""
STOP_TIMEOUT_S = 30.0
"""The longest a stop() of a live child may take (TRL's own: join 15 s, terminate, join 5 s, kill)."""


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is not None and exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class RolloutWatchdog:
    """Watches one ``AsyncRolloutWorker``; install it before the worker starts."""

    def __init__(self, worker, *, grace_s: float, server_down_s: float = SERVER_DOWN_S) -> None:
        self.worker = worker
        self.grace_s = grace_s
        self.server_down_s = server_down_s
        self.cause: str | None = None
        self._detected_at: float | None = None
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

    def _server_down(self, since: float | None, last: str) -> str:
        return (
            f"The vLLM server at {self.server} stopped answering /health during training ({last} for "
            f"{time.monotonic() - since:.0f} s; its engine may have crashed: see the server's log). Restart it and "
            "rerun (the run resumes from its last checkpoint)."
        )

    def _note(self, cause: str) -> None:
        if self.cause is None:
            self.cause = cause
            self._detected_at = time.monotonic()
            logger.error("%s", cause)

    # ------------------------------------------------------------------ the thread

    def _watch(self) -> None:
        down_since: float | None = None
        next_probe = time.monotonic() + SERVER_PROBE_S
        while not self._stopping.wait(POLL_S):
            if self.cause is not None:
                if time.monotonic() - self._detected_at > self.grace_s:
                    self._hard_exit()
                continue
            cause = self._child_cause()
            if cause is None and self.server and time.monotonic() >= next_probe:
                next_probe = time.monotonic() + SERVER_PROBE_S
                try:
                    status = requests.get(f"{self.server}/health", timeout=5).status_code
                    last = None if status == 200 else f"HTTP {status}"
                except requests.RequestException as exc:
                    last = type(exc).__name__
                if last is None:
                    down_since = None
                else:
                    down_since = down_since or time.monotonic()
                    if time.monotonic() - down_since >= self.server_down_s:
                        cause = self._server_down(down_since, last)
            if cause is not None:
                self._note(cause)

    def _hard_exit(self) -> None:
        """The training thread did not end after the cause was raised to it: it is blocked. End the process."""
        sys.stderr.write(
            f"error: {self.cause} (The trainer was still blocked {self.grace_s:g} s later, so it was stopped "
            "hard.)\n"
        )
        sys.stderr.flush()
        process = self.worker._process
        if process is not None and process.is_alive():
            os.kill(process.pid, signal.SIGKILL)
        os._exit(2)

    # ------------------------------------------------------------------ what TRL calls

    def check_health(self, stale_after_s: float) -> None:
        """TRL's check, first our own findings; any failure is one DnaServiceError line."""
        cause = self.cause or self._child_cause()
        if cause is not None:
            self._note(cause)
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
        if not done.wait(STOP_TIMEOUT_S):
            logger.warning(
                "The rollout worker did not stop within %g s; its child is killed.", STOP_TIMEOUT_S
            )
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            self.worker._process = None
