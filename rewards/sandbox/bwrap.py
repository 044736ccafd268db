"""The isolation boundary of the code sandbox: bubblewrap, plus a cgroup and a dedicated uid when run as root.

Each pool slot (:mod:`rewards.sandbox.pool`) runs its zygote (:mod:`rewards.sandbox.zygote`) inside one
`bubblewrap <https://github.com/containers/bubblewrap>`_ (``bwrap`` 0.8 or newer, the engine Flatpak uses;
Debian/Ubuntu ``apt-get install bubblewrap``, Fedora ``dnf install bubblewrap``), :func:`slot_command`:

- **every namespace new**: user, mount, PID, network, IPC, UTS and cgroup (``--unshare-all``), no nested user
  namespaces (``--disable-userns``), a new session, ``--die-with-parent``, the zygote as PID 1 of its namespace
  (``--as-pid-1``), and of all capabilities only ``CAP_SYS_ADMIN`` and ``CAP_SETPCAP`` in the slot's own user
  namespace, which every run drops before its program starts;
- **a minimal root**: an empty ``tmpfs`` with read-only binds of ``/usr``, the interpreter's prefix, the
  virtualenv and this directory only (no ``/etc``, no ``/home``, no ``/root`` contents, no ``/sys``); a ``/dev``
  of ``null``/``zero``/``full``/``random``/``urandom``/``tty`` remounted read-only (no host device node);
- mount points ``/w``, ``/tmp`` and ``/dev/shm``, where every run mounts its own sized ``tmpfs``;
- an empty environment for ``bwrap`` itself, and the sandbox's own variables for the program.

As root, ``bwrap`` would map the program's uid onto host uid 0. So a root caller starts it through
:data:`LAUNCHER` (util-linux ``unshare``, ``mount``, ``setpriv``): in a private mount namespace it binds the
paths above into a world-readable staging ``tmpfs`` (the interpreter may live under a 0700 ``/root``) and drops
to the slot's own uid before ``bwrap`` runs. Each run's cgroups (:class:`Cgroups`) bound memory
(``memory.max``, or v1 ``memory.limit_in_bytes``; this counts memfd, SysV and ``tmpfs`` pages and inodes, which
``RLIMIT_AS`` misses) and tasks (``pids.max``; threads count) of the whole run. A caller that is not root uses
its own uid (mapped to 65534 inside) and gets no cgroup unless one is delegated to it; the seccomp filter then
refuses ``memfd_create``, ``shmget`` and ``msgget``, and ``RLIMIT_NPROC`` bounds tasks.

Example:
    >>> bwrap_version() is None or bwrap_version() >= (0, 8)
    True
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

MIN_VERSION = (0, 8)
"""``--disable-userns`` and ``--size`` (0.8.0, Debian 12 and Ubuntu 24.04)."""
SANDBOX_UID = 0x6D6E_0000
"""The first host uid (and gid) of a root caller's sandboxes: unprivileged, owning no file, high above any subuid
range (pool slot *i* runs as ``SANDBOX_UID + 4096 + i``, :data:`rewards.sandbox.pool.SLOT_UID`)."""
WORKDIR = "/w"
"""The working directory inside the sandbox."""
STAGE = "/run/dna-sandbox-stage"
"""Where a root caller's private mount namespace stages the read-only binds (empty on the host)."""
CGROUP_SLACK_MB = 96
"""Memory the cgroup allows on top of ``memory_mb``: the supervisor and the tests' interpreter."""
CGROUP_TASKS = 64
"""``pids.max`` of a run: supervisor, program, tests and their threads."""
LAUNCHER = r"""set -e
stage=$1; shift; n=0
mount -t tmpfs -o size=1m,mode=755,nosuid,nodev tmpfs "$stage"
while [ "$1" != -- ]; do mkdir "$stage/$n"; mount --bind -o ro "$1" "$stage/$n"; n=$((n+1)); shift; done
shift
exec setpriv --reuid=$SANDBOX_UID --regid=$SANDBOX_UID --clear-groups --inh-caps=-all "$@"
"""
"""The root caller's step before ``bwrap`` (run by ``unshare --mount --propagation private sh -c``)."""

_counter = itertools.count()


@functools.cache
def bwrap_version() -> tuple[int, ...] | None:
    """The installed ``bwrap`` version, or None when it is missing or does not answer."""
    path = shutil.which("bwrap")
    if path is None:
        return None
    try:
        text = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10, env={}).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(part) for part in found.groups() if part is not None) if found else None


def missing_tools() -> str | None:
    """Why this machine cannot build the boundary (a missing or old tool), or None."""
    version = bwrap_version()
    if version is None:
        return "bubblewrap (bwrap) is not installed; install it: apt-get install bubblewrap (or dnf install bubblewrap)"
    if version < MIN_VERSION:
        return f"bubblewrap {'.'.join(map(str, version))} is older than 0.8; install a newer bubblewrap"
    if os.geteuid() == 0:
        for tool in ("unshare", "mount", "setpriv", "sh"):
            if shutil.which(tool) is None:
                return f"util-linux '{tool}' is not installed (apt-get install util-linux mount)"
    return None


@functools.cache
def _cgroup_roots() -> dict[str, Path]:
    """Where this process's memory and pids cgroups are, per controller, when it may create children there
    (found once per process)."""
    roots: dict[str, Path] = {}
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return roots
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: both controllers, if they are enabled for our children
            base = Path("/sys/fs/cgroup", path.lstrip("/"))
            try:
                enabled = (base / "cgroup.subtree_control").read_text().split()
            except OSError:
                continue
            for controller in ("memory", "pids"):
                if controller in enabled and os.access(base, os.W_OK):
                    roots.setdefault(controller, base)
        else:
            for controller in controllers.split(","):
                base = Path("/sys/fs/cgroup", controller, path.lstrip("/"))
                if controller in ("memory", "pids") and os.access(base, os.W_OK):
                    roots[controller] = base
    return roots


@dataclass
class Cgroups:
    """One run's memory and pids cgroups (v2 or v1), made before it starts and removed after it ends."""

    memory: Path | None = None
    pids: Path | None = None
    made: list[Path] = field(default_factory=list)
    memory_mb: int | None = None
    """The run's memory limit as set (before :data:`CGROUP_SLACK_MB`): :meth:`limit` writes only a change."""
    v2: bool = False
    """The memory cgroup is v2 (``memory.max``, ``memory.events``), else v1."""

    @classmethod
    def make(cls, memory_mb: int, max_tasks: int) -> Cgroups:
        """New cgroups under this process's own, where it may make them; none (logged once) where not."""
        roots = _cgroup_roots()
        groups = cls()
        name = f"dna-sandbox-{os.getpid()}-{next(_counter)}"
        for controller in ("memory", "pids"):
            root = roots.get(controller)
            if root is None:
                continue
            path = root / name
            try:
                if path not in groups.made:
                    path.mkdir()
                    groups.made.append(path)
                if controller == "memory":
                    limit = str((memory_mb + CGROUP_SLACK_MB) << 20)
                    groups.v2 = (path / "memory.max").exists()
                    if groups.v2:
                        (path / "memory.max").write_text(limit)
                        with contextlib.suppress(OSError):
                            (path / "memory.swap.max").write_text("0")
                    else:
                        (path / "memory.limit_in_bytes").write_text(limit)
                        with contextlib.suppress(OSError):  # swap counted too, where the host accounts it
                            (path / "memory.memsw.limit_in_bytes").write_text(limit)
                    groups.memory, groups.memory_mb = path, memory_mb
                else:
                    (path / "pids.max").write_text(str(max_tasks))
                    groups.pids = path
            except OSError as exc:
                logger.warning("Could not set up the sandbox's %s cgroup %s: %s", controller, path, exc)
        return groups

    @property
    def procs(self) -> list[str]:
        """The ``cgroup.procs`` files a run's first process writes its pid into."""
        return sorted({str(path / "cgroup.procs") for path in (self.memory, self.pids) if path is not None})

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of the run for the memory limit."""
        if self.memory is None:
            return False
        with contextlib.suppress(OSError):
            text = (self.memory / ("memory.events" if self.v2 else "memory.oom_control")).read_text()
            found = re.search(r"^oom_kill (\d+)", text, re.MULTILINE)
            if found:
                return int(found[1]) > 0
        return False

    def limit(self, memory_mb: int) -> None:
        """Set the memory limit to ``memory_mb`` plus :data:`CGROUP_SLACK_MB` (a run's own, on cgroups made ahead)."""
        if self.memory is None or memory_mb == self.memory_mb:
            return
        limit = str((memory_mb + CGROUP_SLACK_MB) << 20)
        if self.v2:
            (self.memory / "memory.max").write_text(limit)
        else:  # v1: memory+swap may never be below memory; write in the order that keeps that true
            names = ["memory.limit_in_bytes", "memory.memsw.limit_in_bytes"]
            for name in names if int((self.memory / names[0]).read_text()) > int(limit) else names[::-1]:
                with contextlib.suppress(FileNotFoundError):
                    (self.memory / name).write_text(limit)
        self.memory_mb = memory_mb

    def join(self, pid: int) -> None:
        """Move process ``pid`` (a host pid) into the run's cgroups."""
        for procs in self.procs:
            Path(procs).write_text(str(pid))

    def kill(self) -> None:
        """SIGKILL every process in the run's cgroups (``cgroup.kill`` where v2 has it); never raises."""
        for path in self.made:
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
                continue
            with contextlib.suppress(OSError, ValueError):
                for pid in (path / "cgroup.procs").read_text().split():
                    with contextlib.suppress(OSError):
                        os.kill(int(pid), 9)

    def remove(self) -> None:
        """Kill what is left in the run's cgroups and remove them; never raises."""
        for path in reversed(self.made):
            with contextlib.suppress(OSError):
                (path / "cgroup.kill").write_text("1")
            for _ in range(100):
                try:
                    path.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    with contextlib.suppress(OSError, ValueError):
                        for pid in (path / "cgroup.procs").read_text().split():
                            os.kill(int(pid), 9)
                    time.sleep(0.01)
            else:
                logger.warning("Could not remove the sandbox cgroup %s.", path)


def leftover_cgroups() -> list[Path]:
    """This machine's sandbox cgroups (``dna-sandbox-<pid>-<n>`` under the cgroups this process may use)."""
    return sorted(path for root in set(_cgroup_roots().values()) for path in root.glob("dna-sandbox-*-*"))


def sweep_stale_cgroups() -> int:
    """Remove the cgroups of callers that were killed mid-run (their pid is gone); how many."""
    removed = 0
    for path in leftover_cgroups():
        pid = path.name.removeprefix("dna-sandbox-").split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            Cgroups(made=[path]).remove()
            removed += 1
        except OSError:
            continue
    return removed


def _binds() -> list[tuple[str, str]]:
    """``(host source, path inside)`` of each read-only bind: the interpreter, the virtualenv, this directory.

    Each is bound at its real path and, where the process reaches it through a symbolic link, at that path
    too: the slot runs ``sys.executable`` and imports from ``sys.path`` as this process names them (a ``.venv``
    that links to a shared environment is common on clusters), and an interpreter reached by a path that does
    not exist inside would fail every slot. Sources are real paths; a bind inside another with the same real
    contents is left out.
    """
    paths = [sys.base_prefix, sys.prefix, os.path.dirname(os.path.abspath(sys.executable))]
    paths.append(str(Path(__file__).resolve().parent))
    wanted: dict[str, str] = {}
    for path in paths:
        real = os.path.realpath(path)
        for target in (real, os.path.abspath(path)):
            wanted.setdefault(target, real)
    binds: list[tuple[str, str]] = []
    for target in sorted(wanted, key=len):
        real = wanted[target]
        covered = any(
            target.startswith(outer + os.sep) and real == os.path.join(source, os.path.relpath(target, outer))
            for source, outer in binds
        )
        if not covered:
            binds.append((real, target))
    return binds


def slot_command(argv: list[str], env: dict[str, str]) -> list[str]:
    """The command line of a pool slot (:mod:`rewards.sandbox.pool`): ``argv`` (the zygote) inside a boundary
    that every run then narrows (fresh mount, PID, IPC, UTS and cgroup namespaces and ``tmpfs`` mounts)."""
    size = str(1 << 20)  # the mount points' own tmpfs: every run mounts its own over them
    binds = _binds()
    targets = [target for _, target in binds]
    sources = [f"{STAGE}/{i}" for i in range(len(binds))] if os.geteuid() == 0 else [src for src, _ in binds]
    inner = [
        # The bwrap whose version was checked (this process's PATH): a root caller's launcher has its own PATH,
        # without /usr/local/bin, where a bwrap newer than the distribution's often lives.
        shutil.which("bwrap") or "bwrap",
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--uid",
        "65534",
        "--gid",
        "65534",
    ]
    inner += ["--hostname", "sandbox", "--die-with-parent", "--new-session", "--as-pid-1"]
    # A slot's zygote builds each run's namespaces and drops the bounding set: it keeps these two (in the slot's
    # own user namespace; one capability per flag, bwrap 0.8 ignores a list). Every run drops them before the
    # program starts (rewards/sandbox/zygote.py).
    inner += ["--cap-add", "CAP_SYS_ADMIN", "--cap-add", "CAP_SETPCAP"]
    inner += ["--tmpfs", "/", "--ro-bind", "/usr", "/usr"]
    for link in ("lib", "lib64", "bin", "sbin"):
        if os.path.islink(f"/{link}") or not os.path.exists(f"/{link}"):
            inner += ["--symlink", f"usr/{link}", f"/{link}"]
        else:
            inner += ["--ro-bind", f"/{link}", f"/{link}"]
    inner += [
        "--dev",
        "/dev",
        "--size",
        size,
        "--perms",
        "1777",
        "--tmpfs",
        "/dev/shm",
        "--remount-ro",
        "/dev",
    ]
    inner += ["--proc", "/proc", "--size", size, "--perms", "1777", "--tmpfs", "/tmp"]
    inner += ["--size", size, "--perms", "0700", "--tmpfs", WORKDIR]
    # after the tmpfs mounts: an interpreter, venv or checkout under /tmp would be hidden under the empty /tmp
    for source, target in zip(sources, targets, strict=True):
        inner += ["--ro-bind", source, target]
    inner += ["--chdir", WORKDIR, "--remount-ro", "/", "--clearenv"]
    for key, value in env.items():
        inner += ["--setenv", key, value]
    inner += ["--", *argv]
    if os.geteuid() != 0:
        return inner
    launcher = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        LAUNCHER,
        "sh",
        STAGE,
        *(source for source, _ in binds),
        "--",
    ]
    return [*launcher, *inner]


def launcher_env(uid: int) -> dict[str, str]:
    """The environment of the root launcher, which runs ``bwrap`` as host ``uid`` (``bwrap`` itself gets none of
    the caller's)."""
    if os.geteuid() != 0:
        return {}
    return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SANDBOX_UID": str(uid)}


def ensure_stage() -> None:
    """Create the (empty, root-owned) staging directory a root caller's launcher mounts over privately."""
    if os.geteuid() == 0:
        os.makedirs(STAGE, mode=0o755, exist_ok=True)
