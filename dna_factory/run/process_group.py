"""Child processes that run in a process group of their own, and the cleanup that stops them with their owner.

A vLLM server (:mod:`dna_factory.serving.vllm_server`) and a checkpoint-eval harness run
(:mod:`dna_factory.eval.harness`) each start with ``start_new_session=True``: the child leads a new session
and process group, so one ``os.killpg`` reaches it and everything it spawned (vLLM's engine core, the
harness's workers). Both stop the same way (:func:`kill_group`: SIGTERM, a grace period, SIGKILL) and both
register here while they run, so that :func:`stop_all` — the ``atexit`` hook and the SIGTERM handler that
:func:`install_cleanup_hooks` installs — stops every group the owner started when the owner ends (a SLURM
preemption, a Ctrl-C that reaches only the trainer).

An owner killed outright (SIGKILL, the OOM killer, a native crash) runs none of that, so the children also
follow their owner themselves (:func:`follow_owner`): the harness exits, the async rollout child exits, and a
vLLM server runs under ``python -m dna_factory.run.process_group OWNER_PID GRACE_S MODULE ARGS...``, which runs
``MODULE`` as ``python -m`` would, in the same process, and stops its group (SIGTERM, then SIGKILL after
``GRACE_S``) once its owner is gone.

Example:
    >>> import subprocess, sys
    >>> proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    >>> kill_group(proc, grace_s=5.0), group_alive(proc.pid)
    (True, False)
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import runpy
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any, Protocol

logger = logging.getLogger(__name__)


class Stoppable(Protocol):
    def stop(self) -> None: ...


def group_alive(pgid: int) -> bool:
    """Whether any process (zombies included) is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_group(proc: subprocess.Popen, grace_s: float, what: str = "process") -> bool:
    """SIGTERM ``proc``'s group (``proc`` started with ``start_new_session=True``), wait up to ``grace_s`` for it
    to empty, then SIGKILL what is left; False when even SIGKILL did not empty it (an unkillable process)."""
    pgid = proc.pid  # start_new_session=True made the child the leader of a group with its pid
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            # Reap the leader; its orphaned children are reparented to init, which reaps them, so the group
            # empties without our help.
            if proc.poll() is not None and not group_alive(pgid):
                return True
            time.sleep(0.1)
        if sig == signal.SIGTERM:
            logger.warning("%s group %d ignored SIGTERM for %.0f s; sending SIGKILL.", what, pgid, grace_s)
    proc.poll()
    return not group_alive(pgid)


# ---------------------------------------------------------------------- cleanup on owner exit

_LIVE: dict[int, Stoppable] = {}
_LIVE_LOCK = threading.RLock()
_HOOKS: dict[str, Any] = {"atexit_pid": None, "sigterm_pid": None, "previous_sigterm": signal.SIG_DFL}


def register(owner: Stoppable) -> None:
    """Stop ``owner`` (its ``stop()``) when this process exits or gets SIGTERM, unless it was unregistered first."""
    with _LIVE_LOCK:
        _LIVE[id(owner)] = owner
    install_cleanup_hooks()


def unregister(owner: Stoppable) -> None:
    with _LIVE_LOCK:
        _LIVE.pop(id(owner), None)


def stop_all() -> None:
    """Stop every registered group this process started and has not stopped yet (the ``atexit`` hook).

    A child forked from the owner inherits this registry but not the groups' ownership, so it does nothing there.
    """
    if os.getpid() != _HOOKS["atexit_pid"]:
        return
    with _LIVE_LOCK:
        owners = list(_LIVE.values())
    for owner in owners:
        try:
            owner.stop()
        except Exception:  # noqa: BLE001 - one group failing to stop must not leak the others
            logger.exception("Could not stop %r.", owner)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """Stop the groups, then do what SIGTERM did before: call that handler, or die of SIGTERM."""
    stop_all()
    previous = _HOOKS["previous_sigterm"]
    if callable(previous):
        previous(signum, frame)
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)


def install_cleanup_hooks() -> None:
    """Register the ``atexit`` hook and, from the main thread, the SIGTERM handler. Idempotent.

    Registering a group calls this. A caller that starts groups from a worker thread (where Python cannot
    install signal handlers) should call it once from the main thread first, or SIGTERM to the owner leaves
    them running (nothing else runs on a default SIGTERM). SIGTERM is left alone when it is ignored; a Python
    handler already installed is chained.
    """
    pid = os.getpid()
    with _LIVE_LOCK:
        if _HOOKS["atexit_pid"] is None:
            atexit.register(stop_all)
        _HOOKS["atexit_pid"] = pid
        if _HOOKS["sigterm_pid"] == pid:
            return
        if threading.current_thread() is not threading.main_thread():
            logger.warning(
                "A vLLM server or eval harness was started outside the main thread, where no SIGTERM handler "
                "can be installed: SIGTERM to this process would leave it running. Call "
                "dna_factory.run.process_group.install_cleanup_hooks() from the main thread first."
            )
            return
        current = signal.getsignal(signal.SIGTERM)
        if current is signal.SIG_IGN:
            return
        if current is not _on_sigterm:
            _HOOKS["previous_sigterm"] = current if callable(current) else signal.SIG_DFL
            signal.signal(signal.SIGTERM, _on_sigterm)
        _HOOKS["sigterm_pid"] = pid


# ---------------------------------------------------------------------- an owner killed outright

OWNER_POLL_S = 1.0


def follow_owner(
    owner_pid: int, on_gone: Callable[[], object], name: str = "owner-watch"
) -> threading.Thread:
    """Call ``on_gone`` (in a daemon thread) once the process that started this one is gone, however it died.

    The kernel hands an orphan to PID 1 or a subreaper, which changes our parent pid: polling ``os.getppid()``
    sees every death, SIGKILL included, and does not depend on the thread that started us (``PR_SET_PDEATHSIG``
    fires when that *thread* exits)."""

    def watch() -> None:
        while os.getppid() == owner_pid:
            time.sleep(OWNER_POLL_S)
        on_gone()

    thread = threading.Thread(target=watch, name=name, daemon=True)
    thread.start()
    return thread


def stop_own_group(what: str, owner_pid: int, grace_s: float) -> None:
    """What a group leader does when its owner is gone: say so, SIGTERM its group, SIGKILL it after ``grace_s``."""
    print(
        f"{what}: owner {owner_pid} is gone; stopping (process group {os.getpgrp()}).",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(ProcessLookupError):
        os.killpg(0, signal.SIGTERM)
    time.sleep(grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(0, signal.SIGKILL)


def with_owner(module: str, grace_s: float) -> list[str]:
    """The argv prefix that runs ``python -m module`` in this process's service: it stops when we are gone."""
    return [sys.executable, "-m", __name__, str(os.getpid()), str(grace_s), module]


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m dna_factory.run.process_group OWNER_PID GRACE_S MODULE [ARGS...]`` (see the module's text)."""
    owner, grace, module, *args = sys.argv[1:] if argv is None else argv
    follow_owner(int(owner), lambda: stop_own_group(module, int(owner), float(grace)))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
