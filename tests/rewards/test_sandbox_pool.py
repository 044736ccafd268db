"""The pre-forked pool (#17, item 5): runs that share one slot share nothing else.

A slot (``rewards/sandbox/pool.py``) is one long-lived boundary whose zygote forks a fresh sandbox per run. Every
test here forces a pool of **one** slot, so consecutive runs are known to share it (its zygote keeps the same host
pid throughout), and pairs a hostile run A with a checking run B right after it: what A leaves, pins or changes
must not reach B. Each B also runs first on a fresh slot as the control, and the assertions compare the two.
Host-side checks read the host's own view (``/proc``, the cgroup tree), not what the sandbox reports.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import threading
import time
from pathlib import Path

import pytest

from rewards.sandbox import Limits, bwrap, run_python, sandbox_isolation
from rewards.sandbox import pool as pool_module

pytestmark = pytest.mark.skipif(
    not sandbox_isolation().namespaces, reason="this machine cannot build the sandbox boundary"
)

STATE = (  # what a run sees of its sandbox, as JSON (stdlib only; runs under the seccomp filter)
    "import ctypes, errno, json, os, random, resource, signal\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "def call(f, *a):\n"
    "    r = f(*a)\n"
    "    return errno.errorcode.get(ctypes.get_errno(), 0) if r != 0 else 'allowed'\n"
    "status = dict(line.split(':', 1) for line in open('/proc/self/status'))\n"
    "w, t = os.statvfs('/w'), os.statvfs('/tmp')\n"
    "print(json.dumps({\n"
    "    'w': sorted(os.listdir('/w')), 'tmp': os.listdir('/tmp'), 'shm': os.listdir('/dev/shm'),\n"
    "    'w_free': [w.f_bfree, w.f_ffree], 'tmp_free': [t.f_bfree, t.f_ffree],\n"
    "    'sysv': call(libc.shmget, KEY, 0, 0), 'fds': sorted(os.listdir('/proc/self/fd')),\n"
    "    'caps': [status[k].strip() for k in ('CapInh', 'CapPrm', 'CapEff', 'CapBnd', 'CapAmb')],\n"
    "    'nnp': status['NoNewPrivs'].strip(), 'seccomp': status['Seccomp'].strip(),\n"
    "    'blocked': status['SigBlk'].strip(), 'ignored': status['SigIgn'].strip(),\n"
    "    'handlers': [str(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGALRM)],\n"
    "    'itimer': signal.getitimer(signal.ITIMER_REAL), 'nofile': resource.getrlimit(resource.RLIMIT_NOFILE),\n"
    "    'hostname': os.uname().nodename, 'pids': sorted(int(p) for p in os.listdir('/proc') if p.isdigit()),\n"
    "    'random': random.random(), 'cwd': os.getcwd(),\n"
    "    'unshare': call(libc.unshare, 0x20000), 'mount': call(libc.mount, b'none', b'/w', b'tmpfs', 0, None),\n"
    "}))\n"
)
HOSTILE = (  # run A: leaves files, a SysV segment, a changed hostname, signal state, and a marker in memory
    "import ctypes, os, random, resource, signal, socket\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "MARK = 'A-MARK-' + 'MARKER'\n"
    "for d in ('/w', '/tmp', '/dev/shm'):\n"
    "    for i in range(50):\n"
    "        open(f'{d}/left-{i}', 'w').write(MARK * 100)\n"
    "print('shm', libc.shmget(KEY, 1 << 16, 0o1666))\n"
    "libc.sethostname(b'pwned', 5)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})\n"
    "signal.setitimer(signal.ITIMER_REAL, 100)\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (20, 20))\n"
    "os.environ['LEFT'] = MARK\n"
    "keep = [MARK * 1000]\n"
    "print('A done')\n"
)


@pytest.fixture
def one_slot(monkeypatch):
    """A pool of one slot for the test (the process's own pool is closed first and again afterwards)."""
    pool_module.close_pool()
    single = pool_module.Pool(size=1)
    monkeypatch.setattr(pool_module, "_pool", single)
    yield single
    single.close()
    assert not bwrap.leftover_cgroups()


def _zygote_pid(single: pool_module.Pool) -> int:
    """The host pid of the one slot's ``bwrap``, once the slot is ready for its next run."""
    deadline = time.monotonic() + 30
    while not single._free and time.monotonic() < deadline:
        time.sleep(0.01)
    (slot,) = single._free
    return slot.process.pid


def _interpreters() -> int:
    """Live processes of the slot's interpreter (the zygote, and whatever it forked), as the host sees them."""
    count = 0
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        count += (
            bool(argv) and b"python" in argv[0] and b"sandbox/zygote.py" in b" ".join(argv) and state != "Z"
        )
    return count


def _state(key: int, **kwargs) -> dict:
    result = run_python(STATE.replace("KEY", str(key)), timeout_s=20, isolation="namespaces", **kwargs)
    assert result.ok, result.stderr
    return json.loads(result.stdout)


def test_a_hostile_run_leaves_nothing_for_the_next_run_in_its_slot(one_slot):
    key = int.from_bytes(secrets.token_bytes(3), "big") + 1
    fresh = _state(key)  # the control: a slot's first run
    slot = _zygote_pid(one_slot)
    hostile = run_python(HOSTILE.replace("KEY", str(key)), timeout_s=20, isolation="namespaces")
    assert hostile.ok and "A done" in hostile.stdout, hostile.stderr
    assert hostile.stdout.split()[1] != "-1", "the control failed: A could not make its SysV segment"
    after = _state(key)
    assert _zygote_pid(one_slot) == slot, "the runs did not share one slot"
    assert after["w"] == ["main.py"] and after["tmp"] == [] and after["shm"] == []
    assert after["w_free"] == fresh["w_free"] and after["tmp_free"] == fresh["tmp_free"]
    assert after["sysv"] == "ENOENT"
    assert after["hostname"] == fresh["hostname"] == "sandbox"
    for key_ in (
        "fds",
        "caps",
        "nnp",
        "seccomp",
        "blocked",
        "ignored",
        "handlers",
        "itimer",
        "nofile",
        "cwd",
    ):
        assert after[key_] == fresh[key_], key_
    assert after["random"] != fresh["random"]


def test_every_run_holds_no_capability_and_cannot_build_namespaces():
    """The slot's zygote holds CAP_SYS_ADMIN and CAP_SETPCAP in the slot's user namespace; no run does, the
    bounding and ambient sets included, and mounts and new namespaces are refused with and without processes."""
    for processes in (1, 8):
        state = _state(1, limits=Limits(max_processes=processes))
        assert state["caps"] == ["0000000000000000"] * 5, state["caps"]
        assert state["nnp"] == "1" and state["seccomp"] == "2"
        assert state["unshare"] == "EPERM" and state["mount"] == "EPERM"
    clone = (
        "import ctypes, errno, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "for flag in (0x10000000, 0x20000, 0x20000000, 0x40000000):\n"
        "    pid = libc.syscall(56, flag | 17, 0, 0, 0, 0)\n"
        "    if pid == 0:\n"
        "        os._exit(0)\n"
        "    print(errno.errorcode.get(ctypes.get_errno()) if pid < 0 else 'made')\n"
    )
    result = run_python(clone, timeout_s=20, limits=Limits(max_processes=8), isolation="namespaces")
    assert result.ok and result.stdout.split() == ["EPERM"] * 4, result


def test_the_working_directory_is_bounded_in_inodes():
    """A tmpfs bounded in size only still hands out an inode per file (kernel memory the size does not count)."""
    program = (
        "n = 0\n"
        "try:\n"
        "    for n in range(20000):\n"
        "        open(f'f{n}', 'w').close()\n"
        "except OSError as exc:\n"
        "    print('stopped', exc.errno)\n"
        "print(n)\n"
    )
    result = run_python(program, timeout_s=30, isolation="namespaces")
    assert result.ok, result.stderr
    assert "stopped 28" in result.stdout and int(result.stdout.split()[-1]) <= pool_module.INODES


def _memory_holds(pid: int, needles: list[bytes]) -> set[bytes]:
    """Which ``needles`` are in the writable memory of host process ``pid`` (read as root through /proc)."""
    found = set()
    with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", buffering=0) as memory:
        for line in maps:
            fields = line.split()
            if not fields[1].startswith("rw") or (len(fields) > 5 and fields[5] not in ("[heap]", "[stack]")):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                memory.seek(start)
                data = memory.read(end - start)
            except OSError:
                continue
            found |= {needle for needle in needles if needle in data}
    return found


@pytest.mark.skipif(os.geteuid() != 0, reason="reading another process's memory needs root")
def test_the_zygote_and_the_waiting_run_never_hold_a_program_or_its_tests(one_slot):
    """The zygote only receives descriptors, so nothing of a run (its program, tests, nonce) is ever in the memory
    that the next run starts from. Read from the host: the zygote's and the next run's waiting processes' memory.
    The control reads a run's own PID 1 while it runs, and finds the program there."""
    program_mark, test_mark = "PROG" + secrets.token_hex(8), "TEST" + secrets.token_hex(8)
    needles = [program_mark.encode(), test_mark.encode()]
    program = f"import time\nx = {program_mark!r}\ndef f():\n    time.sleep(1.5)\n    return 1\n"
    holds: dict[str, set[bytes]] = {}

    def watch() -> None:  # the control, during the run: its PID 1 (the supervisor) read the config
        time.sleep(0.7)
        (slot,) = one_slot._busy
        holds["running"] = set().union(*(_memory_holds(pid, needles) for pid in _descendants(slot)))

    assert run_python("print(1)", timeout_s=20, isolation="namespaces").ok  # the slot is started
    _zygote_pid(one_slot)
    watcher = threading.Thread(target=watch)
    watcher.start()
    result = run_python(
        program, tests=[f"# {test_mark}\nassert f() == 1"], timeout_s=20, isolation="namespaces"
    )
    watcher.join()
    assert result.tests_passed == (True,), result.stderr
    assert program_mark.encode() in holds["running"], (
        "the control failed: the probe cannot see a run's memory"
    )
    _zygote_pid(one_slot)
    (slot,) = one_slot._free
    for pid in _descendants(slot):
        assert _memory_holds(pid, needles) == set(), f"process {pid} of the idle slot holds a run's data"


def _descendants(slot: pool_module.Slot) -> list[int]:
    """The host pids of the slot's zygote and every process under it."""
    fdinfo = Path(f"/proc/self/fdinfo/{slot.zygote}").read_text()
    pids, queue = [], [int(fdinfo.split("Pid:")[1].split()[0])]
    while queue:
        pid = queue.pop()
        pids.append(pid)
        for task in Path(f"/proc/{pid}/task").iterdir():
            queue += [int(child) for child in (task / "children").read_text().split()]
    return pids


def test_a_killed_run_does_not_take_its_slot_down_and_a_stuck_one_is_killed(one_slot):
    """A run killed by the wall-clock timeout ends as a timeout, and the same slot serves the next run."""
    assert run_python("print(1)", timeout_s=20, isolation="namespaces").ok  # the slot is started
    slot = _zygote_pid(one_slot)
    stuck = run_python("import time\ntime.sleep(60)", timeout_s=1, isolation="namespaces")
    assert stuck.status == "timeout"
    assert run_python("print('next')", timeout_s=20, isolation="namespaces").stdout == "next\n"
    assert _zygote_pid(one_slot) == slot
    # the zygote, and the next run's PID 1, waiting: no sleeper. The waiting PID 1 is forked after the run
    # returns, so under load it may take a moment to appear.
    deadline = time.monotonic() + 20
    while _interpreters() < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _interpreters() == 2


def test_closing_the_pool_never_strands_a_waiting_run(one_slot):
    """A run waiting for the one busy slot when the pool is closed (at exit, or by a test) asks the next pool."""
    assert run_python("print(1)", timeout_s=20, isolation="namespaces").ok
    results = {}

    def run(name: str, code: str) -> None:
        results[name] = run_python(code, timeout_s=20, isolation="namespaces")

    busy = threading.Thread(target=run, args=("busy", "import time\ntime.sleep(1.5)\nprint('a')"))
    busy.start()
    time.sleep(0.5)
    waiting = threading.Thread(target=run, args=("waiting", "print('b')"))
    waiting.start()
    time.sleep(0.3)
    pool_module.close_pool()
    busy.join(timeout=30)
    waiting.join(timeout=30)
    assert results["busy"].stdout == "a\n" and results["waiting"].stdout == "b\n", results
    pool_module.close_pool()  # the pool the waiting run started


def test_a_dead_slot_is_a_sandbox_error_and_is_replaced(one_slot):
    """The zygote of an idle slot is killed: the next run is a sandbox error (never an exception in the caller),
    and the run after it gets a fresh slot."""
    assert run_python("print(1)", timeout_s=20, isolation="namespaces").ok
    _zygote_pid(one_slot)
    (slot,) = one_slot._free
    signal.pidfd_send_signal(slot.zygote, signal.SIGKILL)
    slot.process.wait(timeout=10)
    lost = run_python("print(2)", timeout_s=20, isolation="namespaces")
    assert lost.status == "sandbox_error" and lost.sandbox_error, lost
    again = run_python("print(3)", timeout_s=20, isolation="namespaces")
    assert again.stdout == "3\n", again


def test_runs_killed_before_they_start_never_answer_for_the_next_run(one_slot):
    """A timeout shorter than a run's start: each run is a timeout or a sandbox error, and a later run still gets
    its own output and verdict, never a stale request's or a stale exit status."""
    for _ in range(5):
        early = run_python("print('early')", timeout_s=0.0005, isolation="namespaces")
        assert early.status in ("timeout", "sandbox_error", "ok"), early
    for n in range(3):
        result = run_python(
            "def f():\n    return 7", tests=["assert f() == 7"], timeout_s=20, isolation="namespaces"
        )
        assert result.tests_passed == (True,) and result.status == "ok", (n, result)
        printed = run_python(f"print({n})", timeout_s=20, isolation="namespaces")
        assert printed.stdout == f"{n}\n", printed


def test_max_processes_counts_only_the_programs_own_processes():
    """The slot's zygote and the run's PID 1 share the uid (and so RLIMIT_NPROC): they are not charged to
    the program's ``max_processes`` (a one-shot run's program could start 5 children at max_processes=8)."""
    forks = (
        "import os, time\n"
        "children = 0\n"
        "try:\n"
        "    for _ in range(8):\n"
        "        pid = os.fork()\n"
        "        if pid == 0:\n"
        "            time.sleep(2)\n"
        "            os._exit(0)\n"
        "        children += 1\n"
        "except OSError:\n"
        "    pass\n"
        "print(children)\n"
    )
    result = run_python(forks, timeout_s=20, limits=Limits(max_processes=8), isolation="namespaces")
    assert result.ok, result.stderr
    assert 5 <= int(result.stdout) <= 6, result.stdout
