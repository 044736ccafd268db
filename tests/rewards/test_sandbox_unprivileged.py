"""The boundary as an unprivileged caller builds it (#17, item 5: "run as root and as an unprivileged user").

A root caller's runs go through a launcher that stages the binds, joins memory and pids cgroups and drops to a
dedicated uid (``rewards/sandbox/bwrap.py``). A non-root caller gets none of that: bubblewrap in a user namespace,
seccomp instead of a memory cgroup, ``RLIMIT_NPROC`` instead of a pids cgroup, and its runs keep its host uid.
These tests run the same probes from such a caller: ``tests/rewards/sandbox_caller.py`` is started as uid 65534
(``setpriv``) with the system interpreter, from a copy of ``rewards/sandbox`` that user can read, and each probe's
outcome is judged here, from the host: the 0600 files of the caller, the host's SysV segments, a host socket, the
processes left. Each probe that could pass vacuously has a control that shows it can fail.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from rewards.sandbox import sandbox_isolation
from tests.rewards.test_sandbox_boundary import FILES_PROGRAM, MEMFD_PROGRAM, THREADS_PROGRAM
from tests.rewards.test_sandbox_verdicts import ATTACKS, SPECIAL_TESTS, TESTS

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")

pytestmark = [
    pytest.mark.skipif(
        os.geteuid() != 0,
        reason="becoming another user needs root (a non-root caller's whole suite already runs unprivileged)",
    ),  # fmt: skip
    pytest.mark.skipif(
        not sandbox_isolation().namespaces, reason="this machine cannot build the sandbox boundary"
    ),
    pytest.mark.skipif(
        SYSTEM_PYTHON is None or shutil.which("setpriv") is None, reason="no /usr/bin/python3 or setpriv"
    ),
]


def _processes_of(uid: int) -> set[int]:
    """Live processes of ``uid`` (a zombie holds nothing but its pid, and this container's init reaps late)."""
    found = set()
    for entry in os.listdir("/proc"):
        try:
            status = Path("/proc", entry, "status").read_text() if entry.isdigit() else ""
            if status and int(status.split("Uid:")[1].split()[0]) == uid and "State:\tZ" not in status:
                found.add(int(entry))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _left_of(uid: int, before: set[int], deadline_s: float = 10.0) -> set[int]:
    """Processes of ``uid`` not in ``before``, once the caller's slots had ``deadline_s`` to die with it."""
    end = time.monotonic() + deadline_s
    while (left := _processes_of(uid) - before) and time.monotonic() < end:
        time.sleep(0.05)
    return left


@pytest.fixture(scope="module")
def caller():
    """A world-readable copy of rewards/sandbox and the driver, and a 0700 home of uid 65534 holding a 0600 secret
    and a ``.netrc``. Yields ``run(jobs) -> report``; afterwards no process of uid 65534 is left and the copy is gone."""
    stage = Path(tempfile.mkdtemp(prefix="dna-unprivileged-", dir="/tmp"))
    try:
        stage.chmod(0o755)
        ignore = shutil.ignore_patterns("__pycache__")
        shutil.copytree(REPO / "rewards" / "sandbox", stage / "rewards" / "sandbox", ignore=ignore)
        shutil.copy(REPO / "rewards" / "__init__.py", stage / "rewards" / "__init__.py")
        shutil.copy(Path(__file__).with_name("sandbox_caller.py"), stage / "sandbox_caller.py")
        for path in stage.rglob("*"):
            path.chmod(0o755 if path.is_dir() else 0o644)
        home = stage / "home"
        home.mkdir(mode=0o700)
        secret = secrets.token_hex(8)
        for name in ("secret.txt", ".netrc"):
            (home / name).write_text(f"machine example.org password {secret}\n")
            (home / name).chmod(0o600)
            os.chown(home / name, NOBODY, NOBODY)
        os.chown(home, NOBODY, NOBODY)
        before = _processes_of(NOBODY)
        env = {"PATH": "/usr/bin:/bin", "HOME": str(home), "LANG": "C.UTF-8"}
        command = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "--",
                   SYSTEM_PYTHON, "-E", "-s", "-B", str(stage / "sandbox_caller.py")]  # fmt: skip
        started = subprocess.run([*command[:-1], "-c", "import rewards.sandbox"], cwd=stage, env=env,
                                 capture_output=True, text=True, timeout=60)  # fmt: skip
        if started.returncode != 0:
            pytest.skip(
                f"{SYSTEM_PYTHON} cannot import rewards.sandbox as uid {NOBODY}: {started.stderr[-500:]}"
            )

        def run(jobs: list[dict]) -> dict:
            proc = subprocess.run(command, input=json.dumps(jobs), cwd=stage, env=env, capture_output=True,
                                  text=True, timeout=300)  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            report = json.loads(proc.stdout)
            assert report["uid"] == NOBODY
            return report

        run.home, run.secret = home, secret
        yield run
        left = _left_of(NOBODY, before)
        assert not left, f"processes of uid {NOBODY} left behind: {sorted(left)}"
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def test_an_unprivileged_caller_builds_the_boundary(caller):
    report = caller(
        [{"code": "import os\nprint(os.getuid(), sum(name.isdigit() for name in os.listdir('/proc')))"}]
    )
    assert report["isolation"] == {"namespaces": True, "reason": "", "missing_tool": False}
    (result,) = report["results"]
    assert result["status"] == "ok", result["stderr"]
    assert result["isolation"] == "namespaces"
    assert {"bwrap", "userns", "netns", "pidns", "seccomp", "minimal_root", "readonly_root"} <= set(
        result["protections"]
    )
    uid, pids = result["stdout"].split()
    assert uid == "65534" and int(pids) < 5  # its own pid namespace: bwrap's init, the program's, the tests'?


def test_the_callers_own_secrets_are_not_there(caller):
    """The caller's 0600 files (its ``~/.netrc``, a secret in its home) and /etc: none can be read inside. The
    control, the same program in ``process`` mode, reads the secret: the probe can see a leak."""
    paths = [str(caller.home / "secret.txt"), str(caller.home / ".netrc"), "/etc/shadow", "/etc/passwd"]
    program = (
        f"for path in {paths!r}:\n"
        "    try:\n"
        "        print(path, open(path).read()[:80])\n"
        "    except OSError as exc:\n"
        "        print(path, type(exc).__name__)\n"
    )
    inside, control = caller([{"code": program}, {"code": program, "isolation": "process"}])["results"]
    assert inside["status"] == "ok", inside["stderr"]
    assert caller.secret not in inside["stdout"] and "root:" not in inside["stdout"]
    assert inside["stdout"].count("FileNotFoundError") == 4, inside["stdout"]
    assert caller.secret in control["stdout"]


def test_wrong_code_scores_nothing_however_it_attacks_the_verdict(caller):
    correct = "def add(a, b):\n    return a + b\n"
    jobs = [{"code": correct, "tests": TESTS}]
    jobs += [{"code": code, "tests": SPECIAL_TESTS.get(name, TESTS)} for name, code in ATTACKS.items()]
    control, *attacks = caller(jobs)["results"]
    assert control["tests_passed"] == [True, True, True], control["stderr"]
    for name, result in zip(ATTACKS, attacks, strict=True):
        assert not any(result["tests_passed"] or []), f"{name} scored: {result}"


def test_memory_threads_and_files_are_bounded_without_cgroups(caller):
    """No memory cgroup for a non-root caller: memfd pages (which RLIMIT_AS does not count) are refused by
    seccomp; no pids cgroup: RLIMIT_NPROC bounds the threads; the working directory is a sized tmpfs."""
    pinned, many, filled = caller([
        {"code": MEMFD_PROGRAM, "limits": {"memory_mb": 256}, "timeout_s": 30},
        {"code": THREADS_PROGRAM, "timeout_s": 30},
        {"code": FILES_PROGRAM, "limits": {"max_file_mb": 64}, "timeout_s": 30},
    ])["results"]  # fmt: skip
    assert "held" not in pinned["stdout"] and pinned["status"] in ("error", "memory_limit"), pinned
    assert many["status"] == "ok", many["stderr"]
    assert 10 < int(many["stdout"]) < 100
    assert int(filled["stdout"].split()[-1]) <= 64 and "stopped 28" in filled["stdout"], filled


def test_no_host_socket_or_sysv_segment_is_reachable(caller):
    """A TCP listener of the host on 127.0.0.1 sees no connection, and a SysV segment made inside is not among
    the host's. The control: a connection from the host reaches the listener."""
    key = int.from_bytes(secrets.token_bytes(3), "big") + 1
    with socket.create_server(("127.0.0.1", 0)) as listener:
        connect = (
            "import socket\n"
            "try:\n"
            f"    socket.create_connection(('127.0.0.1', {listener.getsockname()[1]}), timeout=3).close()\n"
            "    print('connected')\n"
            "except OSError as exc:\n"
            "    print('refused', type(exc).__name__)\n"
        )
        segment = (
            "import ctypes\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            f"print('shm', libc.shmget({key}, 1 << 20, 0o1600), ctypes.get_errno())\n"
        )
        inside, made = caller([{"code": connect}, {"code": segment}])["results"]
        socket.create_connection(
            listener.getsockname(), timeout=3
        ).close()  # the control: the host's does arrive
        listener.settimeout(0.5)
        accepted = 0
        try:
            while True:
                listener.accept()[0].close()
                accepted += 1
        except TimeoutError:
            pass
    leaked = key in {int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]}
    if leaked:
        subprocess.run(["ipcrm", "-M", str(key)], check=False)
    assert "refused" in inside["stdout"], inside
    assert accepted == 1, f"{accepted - 1} connection(s) from inside the sandbox reached the host"
    assert made["status"] == "ok" and made["stdout"].startswith("shm "), made
    assert not leaked, made["stdout"]
