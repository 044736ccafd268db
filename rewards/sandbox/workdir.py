"""Process mode's working directory on the host: made per run, removed afterwards, swept after a killed caller.

Inside the boundary (:mod:`rewards.sandbox.bwrap`) the working directory is a ``tmpfs`` that never exists on
the host; only ``isolation="process"`` runs use a host directory, ``<tempdir>/dna-sandbox-<caller pid>-*``.
Removal never raises into the reward and never follows a link.

Example:
    >>> sweep_stale_workdirs() >= 0
    True
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import rewards.sandbox.bwrap as bwrap

logger = logging.getLogger(__name__)

WORKDIR_PREFIX = "dna-sandbox-"
"""Working directories are ``<tempdir>/dna-sandbox-<caller pid>-<random>``."""


def _open_up(top: str) -> None:
    """Give the owner ``rwx`` on every directory under ``top`` (a program may have locked some), never following
    a link: each directory is opened with ``O_NOFOLLOW`` and changed through that descriptor, so nothing outside
    the tree changes. Runs after the program's processes are dead, so the tree no longer moves."""
    stack = [top]
    while stack:
        path = stack.pop()
        try:
            handle = os.open(path, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # a link or a file (rmtree unlinks it without following), or gone
        try:
            os.chmod(f"/proc/self/fd/{handle}", stat.S_IRWXU)  # the opened directory itself, not a path
            with os.scandir(f"/proc/self/fd/{handle}") as entries:
                names = [entry.name for entry in entries if entry.is_dir(follow_symlinks=False)]
        except OSError:
            names = []
        finally:
            os.close(handle)
        stack.extend(os.path.join(path, name) for name in names)


def _remove_tree(path: str) -> None:
    """Delete a working directory, even parts the program locked; never follows a link, never raises.

    ``shutil.rmtree`` itself never follows links (it works through directory descriptors); what it cannot
    delete is logged, not raised: a leftover directory must not fail the reward of a whole batch.
    """
    try:
        if not os.path.lexists(path):
            return
        if os.path.islink(path) or not os.path.isdir(path):
            os.unlink(path)
            return
        _open_up(path)
        shutil.rmtree(path, ignore_errors=True)
        if os.path.lexists(path):
            logger.warning("Could not delete the sandbox working directory %s; delete it by hand.", path)
    except Exception as exc:  # noqa: BLE001 - cleanup must never fail a reward
        logger.warning("Could not delete the sandbox working directory %s: %s", path, exc)


def sweep_stale_workdirs() -> int:
    """Delete working directories left by callers that were killed mid-run; return how many.

    A run removes its own directory; only a caller killed outright (``SIGKILL``, the OOM killer)
    leaves one behind. Its processes die with it, and the first :func:`sandbox_isolation` of a
    later process calls this to delete directories of ours whose caller PID no longer exists.

    Example:
        >>> sweep_stale_workdirs() >= 0
        True
    """
    removed = bwrap.sweep_stale_cgroups()
    for path in Path(tempfile.gettempdir()).glob(f"{WORKDIR_PREFIX}*-*"):
        pid = path.name.removeprefix(WORKDIR_PREFIX).split("-", 1)[0]
        try:
            info = path.lstat()  # the entry itself: a link planted under our name is not ours to follow
            if not pid.isdigit() or info.st_uid != os.geteuid() or not stat.S_ISDIR(info.st_mode):
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            _remove_tree(str(path))
            removed += 1
        except OSError:
            continue  # alive (another user's process) or vanished meanwhile
    return removed
