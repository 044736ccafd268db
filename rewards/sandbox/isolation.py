"""Which isolation this machine allows the code sandbox, found once per process by a real run.

:func:`sandbox_isolation` runs a probe inside the boundary (bubblewrap, :mod:`rewards.sandbox.bwrap`) and
checks what it sees: an unprivileged host uid, no ``/etc``, no caller's files. When that holds every
``isolation="auto"`` run uses the boundary; otherwise (:func:`auto_fallback`) plain processes for an
unprivileged caller, with one warning that says why and what to change, and a refusal for root. :func:`boundary_for` is the recipes' side of it: the code reward and the Coding Agent fail
closed where the boundary cannot be built.

Example:
    >>> sandbox_isolation().namespaces in (True, False)
    True
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass

import rewards.sandbox.bwrap as bwrap
from rewards.sandbox.execute import Limits, execute, run_blocking
from rewards.sandbox.workdir import sweep_stale_workdirs

logger = logging.getLogger(__name__)

_PROBE = (
    "import os\n"
    "caps = [line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff')]\n"
    "print(os.getuid(), caps[0], os.path.exists('/etc'), os.path.exists('/root/.netrc'))"
)
"""What the boundary probe prints: its uid, effective capabilities, and whether host files show."""
_lock = threading.Lock()
_isolation: Isolation | None = None


@dataclass(frozen=True)
class Isolation:
    """What this machine allows, found once per process by :func:`sandbox_isolation`."""

    namespaces: bool
    reason: str = ""
    missing_tool: bool = False
    """True when ``reason`` is a missing or old tool, False when the tools are there but the probe failed."""


def sandbox_isolation() -> Isolation:
    """Whether programs run in fresh namespaces here, probed once per process by a real run.

    Returns:
        The :class:`Isolation` every ``isolation="auto"`` run uses. When namespaces do not work,
        ``reason`` says why (logged at INFO: what follows is for the caller to say, see :func:`auto_fallback`
        and :func:`boundary_for`).

    Example:
        >>> sandbox_isolation().namespaces in (True, False)
        True
    """
    global _isolation

    with _lock:
        if _isolation is not None:
            return _isolation
        stale = sweep_stale_workdirs()
        if stale:
            logger.info("Deleted %d sandbox directories left by killed processes.", stale)
        reason = bwrap.missing_tools()
        if reason is None:
            probe = run_blocking(
                execute(_PROBE, None, tests=None, setup=None, timeout_s=30.0, limits=Limits(),
                        isolation="namespaces", seccomp=True)
            )  # fmt: skip
            seen = probe.stdout.split()
            if probe.ok and seen == ["65534", "0000000000000000", "False", "False"]:
                _isolation = Isolation(True)
                _report(probe.protections)
                return _isolation
            reason = (
                probe.sandbox_error
                or probe.stderr.strip()[-300:]
                or (
                    f"the probe saw uid, capabilities, files: {seen}"
                    if probe.ok
                    else f"probe ended with {probe.status}"
                )
            )
        _isolation = Isolation(False, reason, missing_tool=bwrap.missing_tools() is not None)
        logger.info("The code sandbox cannot build its boundary here: %s", reason)
        return _isolation


def advice(found: Isolation) -> str:
    """What to change so the boundary can be built, ending in a space; empty for a missing tool (``reason`` says
    which to install)."""
    if found.missing_tool:
        return ""
    return (
        "bubblewrap is installed but the boundary probe failed: allow unprivileged user namespaces "
        "(sysctl kernel.unprivileged_userns_clone=1, kernel.apparmor_restrict_unprivileged_userns=0; in Docker "
        "--security-opt seccomp=unconfined). "
    )


_warned_fallback = False


def auto_fallback(found: Isolation) -> str | None:
    """What ``run_python(isolation="auto")`` does where no boundary can be built.

    Returns:
        None: run as a plain process (unprivileged callers), warned once per process; or the one-line
        refusal to return as the run's ``sandbox_error``: a library fallback never runs model-written code as
        root (pass ``isolation="process"`` to ask for that explicitly).
    """
    global _warned_fallback
    if os.geteuid() == 0:
        return (
            f"isolation='auto' found no sandbox boundary here ({found.reason}) and does not run model-written code "
            f"as root without one. {advice(found)}Or pass isolation='process' to run it as a plain root process."
        )
    if not _warned_fallback:
        _warned_fallback = True
        logger.warning(
            "The code sandbox cannot build its boundary here (%s), so library calls with isolation='auto' run "
            "programs as plain processes: limits, seccomp (no sockets, no processes) and a scrubbed environment "
            "still apply, but the program can read what this user can. %s",
            found.reason,
            advice(found),
        )
    return None


def _report(protections: frozenset[str]) -> None:
    logger.info("Code sandbox protections: %s.", ", ".join(sorted(protections)))
    if "seccomp" not in protections:
        logger.warning(
            "The code sandbox has no seccomp filter on this architecture (only x86_64 and aarch64 are "
            "covered), so only the Python audit hook refuses sockets, new processes and signals; "
            "ctypes or C extensions can get past it. Run the trainer on x86_64/aarch64 or in a VM."
        )


POLICIES = ("auto", "namespaces", "unsafe_process")
"""What a recipe may set as the code reward's or the Coding Agent's ``isolation`` (:func:`boundary_for`)."""


_warned_unsafe: set[str] = set()


class NoBoundaryError(ValueError):
    """No sandbox boundary can be built here, and the recipe did not opt into ``isolation: unsafe_process``."""


def boundary_for(policy: str, who: str) -> str:
    """The :func:`run_python` isolation for a recipe's ``isolation`` setting, failing closed.

    ``auto`` and ``namespaces`` need the namespace boundary (probed once per process by
    :func:`sandbox_isolation`) and raise :class:`NoBoundaryError` where it cannot be built, instead of
    running model-written code without one. ``unsafe_process`` runs plain processes: rlimits, seccomp and
    an audit hook, which is no boundary (the program can read what the trainer's user can read), and
    says so in a warning at every start (once per process for each ``who``).

    Args:
        policy: One of :data:`POLICIES`.
        who: What asks, for the messages (``code reward 'code_execution'``, ``the Coding Agent``).

    Raises:
        NoBoundaryError: ``auto`` or ``namespaces`` where namespaces cannot be created.
        ValueError: An unknown ``policy``; ``process`` names its new spelling.
    """
    if policy == "process":
        raise ValueError(
            f"{who}: isolation 'process' is now spelled 'unsafe_process': it runs model-written code without a "
            "sandbox boundary. Write isolation: unsafe_process if that is what you want, or auto."
        )
    if policy not in POLICIES:
        raise ValueError(f"{who}: unknown isolation {policy!r}. Use one of: {', '.join(POLICIES)}.")
    if policy == "unsafe_process":
        if who in _warned_unsafe:  # once per run (process) and user: environments are built per rollout
            return "process"
        _warned_unsafe.add(who)
        logger.warning(
            "%s runs with isolation: unsafe_process: model-written code runs with no sandbox boundary, as plain "
            "processes under rlimits, seccomp and a Python audit hook. It can read whatever this user can read "
            "(tokens, keys, other runs). Use it only where the whole machine or container is disposable.",
            who,
        )
        return "process"
    found = sandbox_isolation()
    if not found.namespaces:
        raise NoBoundaryError(
            f"{who}: no sandbox boundary can be built on this machine ({found.reason}), so model-written code "
            f"will not run. {advice(found)}Or set isolation: unsafe_process to run it without a boundary "
            "(docs/rewards.md)."
        )
    return "namespaces"
