"""The isolation boundary against a hostile program (#17, item 2): what a program can reach or pin on the host.

Each probe is bounded in memory, time and processes and cleans up after itself; each asserts what the host
sees afterwards (its uid in ``/proc``, its SysV segments, its files), not what the sandbox reports. Probes that
need the boundary are skipped where this machine cannot build it (no bubblewrap, no user namespaces): there
the code reward refuses to run at all (``test_sandbox_hostile.py``).
"""

from __future__ import annotations

import os
import secrets
import subprocess
import threading
import time
from pathlib import Path

import pytest

from rewards.sandbox import Limits, run_python, sandbox_isolation

REPO = Path(__file__).resolve().parents[2]
BOUNDARY = sandbox_isolation().namespaces
needs_boundary = pytest.mark.skipif(not BOUNDARY, reason="this machine cannot build the sandbox boundary")
MODES = ["process", *(["namespaces"] if BOUNDARY else [])]

MEMFD_PROGRAM = (  # 540 MiB of memfd pages, each file under RLIMIT_FSIZE (64 MiB)
    "import os\n"
    "chunk, fds = b'x' * (1 << 20), []\n"
    "for _ in range(9):\n"
    "    fds.append(os.memfd_create('pin'))\n"
    "    for _ in range(60):\n"
    "        os.write(fds[-1], chunk)\n"
    "print('held')\n"
)
THREADS_PROGRAM = (  # up to 2,000 small-stack threads; prints how many started
    "import threading\n"
    "threading.stack_size(65536)\n"
    "stop, started = threading.Event(), 0\n"
    "for _ in range(2000):\n"
    "    try:\n"
    "        threading.Thread(target=stop.wait, daemon=True).start()\n"
    "    except RuntimeError:\n"
    "        break\n"
    "    started += 1\n"
    "print(started)\n"
    "stop.set()\n"
)
FILES_PROGRAM = (  # six 30 MiB files in the working directory; prints the MiB written (and ENOSPC's errno)
    "written = 0\n"
    "chunk = b'x' * (1 << 20)\n"
    "try:\n"
    "    for name in range(6):\n"
    "        with open(f'f{name}', 'wb') as handle:\n"
    "            for _ in range(30):\n"
    "                handle.write(chunk)\n"
    "                handle.flush()\n"
    "                written += 1\n"
    "except OSError as exc:\n"
    "    print('stopped', exc.errno)\n"
    "print(written)\n"
)


def _interpreter_uids(stop: threading.Event, seen: set[int]) -> None:
    while not stop.is_set():
        for entry in os.listdir("/proc"):
            try:
                argv = Path("/proc", entry, "cmdline").read_bytes().split(b"\0") if entry.isdigit() else []
                # the interpreter only (a pool slot's zygote and every run it forks, or a one-shot boot.py): its
                # launcher (unshare, sh, setpriv) is root until it drops the uid
                if (
                    argv
                    and os.path.basename(argv[0]).startswith(b"python")
                    and any(arg.endswith((b"sandbox/zygote.py", b"sandbox/boot.py")) for arg in argv)
                ):
                    status = Path("/proc", entry, "status").read_text()
                    seen.add(int(status.split("Uid:")[1].split()[0]))
            except (OSError, IndexError, ValueError):
                continue
        time.sleep(0.02)


@needs_boundary
def test_the_program_never_runs_as_the_callers_host_uid():
    """Seen from the host, every process of a run has an unprivileged uid, never root's."""
    stop, seen = threading.Event(), set()
    watcher = threading.Thread(target=_interpreter_uids, args=(stop, seen))
    watcher.start()
    try:
        result = run_python("import time\ntime.sleep(1.0)", timeout_s=20, isolation="namespaces")
    finally:
        stop.set()
        watcher.join()
    assert result.ok and seen
    assert 0 not in seen
    if os.geteuid() != 0:
        assert seen == {os.geteuid()}


@needs_boundary
def test_the_callers_files_and_host_secrets_are_not_there(tmp_path):
    """A 0600 file of the caller (in the repository and in the temp dir), /etc/shadow and ~/.netrc: none exists
    inside, so none can be read."""
    secret = secrets.token_hex(8)
    in_repo = REPO / "tests" / f".secret-{secrets.token_hex(4)}"
    in_tmp = tmp_path / "secret.txt"
    for path in (in_repo, in_tmp):
        path.write_text(secret)
        path.chmod(0o600)
    try:
        paths = [str(in_repo), str(in_tmp), "/etc/shadow", "/etc/passwd", os.path.expanduser("~/.netrc")]
        program = (
            f"for path in {paths!r}:\n"
            "    try:\n"
            "        print(path, open(path).read()[:40])\n"
            "    except OSError as exc:\n"
            "        print(path, type(exc).__name__)\n"
            "import os\nprint(sorted(os.listdir('/')), sorted(os.listdir('/dev')))"
        )
        result = run_python(program, timeout_s=20, isolation="namespaces")
    finally:
        in_repo.unlink()
    assert result.ok, result.stderr
    assert secret not in result.stdout
    lines = result.stdout.splitlines()
    assert all(line.endswith(("FileNotFoundError", "PermissionError")) for line in lines[:-1]), lines
    assert "root:" not in result.stdout
    root, dev = eval(lines[-1].replace("] [", "], ["))  # noqa: S307 - our own program's output
    assert "etc" not in root and "home" not in root and "sys" not in root
    links = {"stdin", "stdout", "stderr", "core", "fd", "ptmx"}  # symlinks into /proc and pts
    assert set(dev) <= {"null", "zero", "full", "random", "urandom", "tty", "shm", "pts", *links}


def _host_shm_keys() -> set[int]:
    lines = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    return {int(line.split()[0]) for line in lines}


@pytest.mark.parametrize("mode", MODES)
def test_sysv_shared_memory_never_reaches_the_host(mode):
    """A SysV segment made inside is either refused or lives in the run's own IPC namespace and dies with it."""
    key = int.from_bytes(secrets.token_bytes(3), "big") + 1
    program = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        f"print(libc.shmget({key}, 1 << 20, 0o1600), ctypes.get_errno())\n"
    )
    result = run_python(program, timeout_s=20, isolation=mode)
    leaked = key in _host_shm_keys()
    if leaked:  # clean up what the probe left before failing
        subprocess.run(["ipcrm", "-M", str(key)], check=False)
    assert not leaked, result.stdout


@pytest.mark.parametrize("mode", MODES)
def test_memfd_pages_count_against_the_memory_limit(mode):
    """540 MiB in memfds under memory_mb=256: refused, or the run is killed for memory; never held."""
    result = run_python(MEMFD_PROGRAM, timeout_s=30, limits=Limits(memory_mb=256), isolation=mode)
    assert "held" not in result.stdout
    assert result.status in ("error", "memory_limit")


@needs_boundary
def test_threads_of_a_run_are_bounded():
    """Threads with tiny stacks (each costs the host a PID): a run gets at most a few dozen."""
    result = run_python(THREADS_PROGRAM, timeout_s=30, isolation="namespaces")
    assert result.ok, result.stderr
    assert (
        30 < int(result.stdout) < 100
    )  # a program still gets dozens (glibc's arenas capped: MALLOC_ARENA_MAX)


@needs_boundary
def test_the_working_directory_is_size_limited():
    """Several files each under the per-file limit still cannot fill more than one max_file_mb in total."""
    result = run_python(FILES_PROGRAM, timeout_s=30, limits=Limits(max_file_mb=64), isolation="namespaces")
    assert int(result.stdout.split()[-1]) <= 64
    assert "stopped 28" in result.stdout  # ENOSPC


@pytest.mark.parametrize("mode", MODES)
def test_no_signal_or_limit_reaches_another_process(mode):
    """fcntl(F_SETOWN, F_SETSIG), ioctl(FIOSETOWN, SIOCSPGRP) and prlimit aimed at another process are refused,
    also without the boundary."""
    victim = subprocess.Popen(["sleep", "30"])
    try:
        program = (
            "import _socket, fcntl, os, resource\n"
            "r, w = os.pipe()\n"
            "pair = _socket.socketpair()  # no audit event, unlike socket.socketpair\n"
            "sv = [sock.fileno() for sock in pair]\n"
            "for what, call in (('setown', lambda: fcntl.fcntl(r, fcntl.F_SETOWN, VICTIM)),\n"
            "                   ('setsig', lambda: fcntl.fcntl(r, 10, 9)),\n"
            "                   ('prlimit', lambda: resource.prlimit(VICTIM, resource.RLIMIT_CPU, (0, 0))),\n"
            "                   ('fiosetown', lambda: fcntl.ioctl(sv[0], 0x8901, (VICTIM).to_bytes(4, 'little'))),\n"
            "                   ('siocspgrp', lambda: fcntl.ioctl(sv[0], 0x8902, (VICTIM).to_bytes(4, 'little')))):\n"
            "    try:\n"
            "        call()\n"
            "        print(what, 'done')\n"
            "    except OSError as exc:\n"
            "        print(what, exc.errno)\n"
            "fcntl.fcntl(w, fcntl.F_SETFL, os.O_NONBLOCK | os.O_ASYNC)\n"
            "os.write(w, b'x')\n"
        ).replace("VICTIM", str(victim.pid))
        result = run_python(program, timeout_s=20, isolation=mode)
        time.sleep(0.2)
        assert victim.poll() is None, "the program's signal reached another process"
        assert "done" not in result.stdout, result.stdout
        probes = [line.split()[0] for line in result.stdout.splitlines()]
        assert probes == ["setown", "setsig", "prlimit", "fiosetown", "siocspgrp"], result.stderr
    finally:
        victim.kill()
        victim.wait()
