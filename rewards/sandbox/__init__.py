"""Run untrusted Python in a sandbox: one process per program, resource limits, no network.

:func:`run_python_async` (and its blocking twin :func:`run_python`, both in :mod:`rewards.sandbox.run`) runs one program in a fresh
interpreter and returns an :class:`ExecutionResult`. The code reward (:mod:`rewards.code`) uses
it to run completions against tests; an agent's "python execution" tool can use it as it is.

What every run gets:

- **separate processes**, killed when the run ends: inside the boundary, forked for the run from a
  pool slot's interpreter (:mod:`rewards.sandbox.pool`, :mod:`rewards.sandbox.zygote`), in ``process``
  mode a fresh ``python -I`` (no user site, no ``PYTHON*`` variables) in its own session; with tests,
  the program and the tests in two processes (:mod:`rewards.sandbox.boot`), so the program cannot
  forge a verdict;
- **a scrubbed environment**: ``PATH``, ``HOME``/``TMPDIR``, a UTF-8 locale and single-thread math
  libraries; nothing from the caller's environment, so no API key or token is inherited;
- **limits** (:class:`Limits`): CPU seconds (``RLIMIT_CPU``), address space (``RLIMIT_AS``),
  file size (``RLIMIT_FSIZE``), open files, no core dumps, a wall-clock timeout, and a cap on
  captured stdout and stderr (the process is killed when it writes more);
- **the seccomp filter** (:mod:`rewards.sandbox.seccomp`): no new processes by default (threads are
  fine; a Python audit hook refuses ``os.fork``, ``subprocess`` and ``os.exec*`` first), no
  ``socket()``, no signal or ``prlimit`` aimed at another process, no ``ptrace``, mounts, new
  namespaces, ``setsid`` or io_uring.

Isolation is detected once per process (:func:`rewards.sandbox.isolation.sandbox_isolation`):

``namespaces``
    The boundary (:mod:`rewards.sandbox.bwrap`): bubblewrap per pool slot and fresh namespaces per run
    (:mod:`rewards.sandbox.pool`) with every namespace new, an unprivileged uid that is never the host's root, a minimal read-only root with no host files or secrets, sized
    ``nosuid,nodev`` ``tmpfs`` mounts for the working directory ``/w``, ``/tmp`` and ``/dev/shm``
    (nothing touches the host's disk), and for a root caller cgroups that bound the run's memory and
    tasks.
``process``
    No boundary: where bubblewrap cannot run (not installed, Docker's default seccomp profile,
    user namespaces disabled). The limits and the seccomp filter still hold, the run gets a private
    working directory (``tempfile.mkdtemp``, removed afterwards; a caller killed outright leaves it
    to :func:`sweep_stale_workdirs`), and file writes outside it are refused by the audit hook only.
    The program runs as the caller's user and can read what that user can read. The code reward
    and the Coding Agent only use it when a recipe says ``isolation: unsafe_process``.

Example:
    >>> result = run_python("import sys; print(sum(map(int, sys.stdin.read().split())))", stdin="2 3")
    >>> result.status, result.stdout
    ('ok', '5\\n')
"""

# The package's face: it hands the public names on; the code lives in its modules, which never import it.
from rewards.sandbox.execute import BOOT_SCRIPT, Limits
from rewards.sandbox.isolation import POLICIES, Isolation, NoBoundaryError, boundary_for, sandbox_isolation
from rewards.sandbox.result import LIMIT_KINDS, ExecutionResult
from rewards.sandbox.run import run_python, run_python_async
from rewards.sandbox.workdir import sweep_stale_workdirs

__all__ = [
    "BOOT_SCRIPT",
    "ExecutionResult",
    "Isolation",
    "LIMIT_KINDS",
    "NoBoundaryError",
    "POLICIES",
    "boundary_for",
    "Limits",
    "run_python",
    "run_python_async",
    "sandbox_isolation",
    "sweep_stale_workdirs",
]
