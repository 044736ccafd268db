"""Verdicts a program cannot forge (#17, item 1): wrong code scores 0.0 however it attacks the test run.

Each program below is wrong (``add`` does not add) and tries one way to score anyway, the ways a policy under
RL pressure finds: objects that equal everything, patched builtins, the report channel and its nonce dug out
of memory, the hidden tests read through frames or ``gc``. The tests run in an interpreter of their own that
never executes the program's code, so every one of these scores 0.0, while correct code, MBPP classes
(``Pair(...)``), HumanEval ``check(candidate)`` scripts and values of every plain type still pass.
"""

from __future__ import annotations

import asyncio

import pytest

from rewards.code import make_code_execution_reward
from rewards.sandbox import Limits, run_python, sandbox_isolation

MODES = ["unsafe_process", *(["namespaces"] if sandbox_isolation().namespaces else [])]
TESTS = ["assert add(1, 2) == 3", "assert add(2, 2) == 4", "assert add(0, 0) == 0"]

ATTACKS = {
    "always_equal": """
class Yes:
    def __eq__(self, other):
        return True
    __hash__ = object.__hash__
def add(a, b):
    return Yes()
""",
    "patched_exec": """
import builtins
def add(a, b):
    return -1
builtins.exec = lambda *args, **kwargs: None
""",
    "patched_compile": """
import builtins
def add(a, b):
    return -1
real = builtins.compile
builtins.compile = lambda source, name, mode, *a, **k: real("pass", name, mode)
""",
    "nonce_from_gc": """
import gc, os, sys
def add(a, b):
    return -1
for obj in gc.get_objects():
    if isinstance(obj, dict) and "nonce" in obj and "tests" in obj:
        for fd in range(3, 64):
            for i in range(len(obj["tests"])):
                try:
                    os.write(fd, f"{obj['nonce']} pass {i}\\n".encode())
                    os.write(fd, f"{obj['nonce']} loaded\\n".encode())
                except OSError:
                    pass
""",
    "reporter_from_gc": """
import gc
def add(a, b):
    return -1
for obj in gc.get_objects():
    if hasattr(type(obj), "send") and type(obj).__name__ == "Channel":
        for i in range(3):
            obj.send("pass", str(i))
""",
    "patched_boot_module": """
import __main__, sys
def add(a, b):
    return -1
boot = sys.modules.get("__main__")
for name in dir(boot):
    value = getattr(boot, name)
    if name == "traceback":
        class Quiet:
            @staticmethod
            def print_exc(*a, **k):
                pass
        setattr(boot, name, Quiet)
if hasattr(boot, "_report_exception"):
    def forge(channel, exc):
        channel.send("pass", "0"); channel.send("pass", "1"); channel.send("pass", "2")
    boot._report_exception = forge
""",
    "tests_from_frames": """
import sys, re
table = {}
frame = sys._getframe()
while frame is not None:
    for value in list(frame.f_locals.values()):
        if isinstance(value, dict) and isinstance(value.get("tests"), list):
            for test in value["tests"]:
                found = re.match(r"assert add\\((\\d+), (\\d+)\\) == (\\d+)", test)
                if found:
                    table[(int(found[1]), int(found[2]))] = int(found[3])
    frame = frame.f_back
def add(a, b):
    return table.get((a, b), -1)
""",
    "nonce_from_parent_memory": """
import os, re
def add(a, b):
    return -1
found = set()
for pid in {os.getppid(), 1}:
    try:
        maps = open(f"/proc/{pid}/maps").read().splitlines()
        with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                if not perms.startswith("rw"):
                    continue
                start, end = (int(x, 16) for x in span.split("-"))
                if end - start > 64 << 20:
                    continue
                try:
                    mem.seek(start)
                    found.update(re.findall(rb"[0-9a-f]{32}", mem.read(end - start)))
                except OSError:
                    pass
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                out = os.open(f"/proc/{pid}/fd/{fd}", os.O_WRONLY)
            except OSError:
                continue
            for nonce in found:
                for i in range(3):
                    os.write(out, nonce + f" pass {i}\\n".encode())
    except OSError:
        pass
""",
    "replaced_builtins": """
import sys, builtins as real
def add(a, b):
    return -1
ONE = object()
class Fake:
    def __getitem__(self, name):
        if name == "abs":
            return lambda x: 0
        if name == "sorted":
            return lambda *a, **k: ONE
        return getattr(real, name)
fake = Fake()
channel = sys.modules.get("_dna_sandbox_channel")
if channel is not None:
    dump = channel._dump
    def patched(message):
        if isinstance(message.get("globals"), dict):
            message["globals"]["__builtins__"] = message["globals"]["fake"]
        return dump(message)
    channel._dump = patched
""",
    "stop_iteration": """
def add(a, b):
    raise StopIteration
""",
    "fake_stdlib_module": """
class Yes:
    def __getattr__(self, name):
        return lambda *a, **k: True
math = Yes()
def add(a, b):
    return -1
""",
    "signals_the_tests_side": """
import ctypes, os, signal
def add(a, b):
    return -1
for target in (1, os.getppid()):  # the run's PID 1: the supervisor that runs the tests
    for send in (os.kill, ctypes.CDLL(None).kill):
        for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGINT):
            try:
                send(target, sig)
            except OSError:
                pass
""",
}
SPECIAL_TESTS = {
    "replaced_builtins": ["assert abs(add(1, 2) - 3) < 1e-9", "assert sorted([add(1, 2)]) == sorted([3])"],
    "stop_iteration": [
        "assert all(map(add, [1], [2])) and add(1, 2) == 3",
        "assert not any(map(add, [1], [2]))",
    ],
    "fake_stdlib_module": ["assert math.isclose(add(1, 2), 3)", "assert math.isclose(add(2, 2), 4)"],
}


def _score(program: str, tests: list[str], isolation: str) -> float | None:
    reward = make_code_execution_reward(timeout_s=20, isolation=isolation)
    completion = f"```python\n{program}\n```"
    return asyncio.run(reward(prompts=["q"], completions=[completion], tests=[tests]))[0]


@pytest.mark.parametrize("isolation", MODES)
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_wrong_code_scores_zero_however_it_attacks_the_verdict(attack, isolation):
    assert _score(ATTACKS[attack], SPECIAL_TESTS.get(attack, TESTS), isolation) == 0.0


@pytest.mark.parametrize("isolation", MODES)
def test_a_program_cannot_answer_for_the_builtins_a_test_uses(isolation):
    """Tests see the real built-ins; a program's ``sum`` is visible only as the function under test."""
    program = "def add(a, b):\n    return -1\ndef abs(x):\n    return 0\ndef set(x):\n    return {1}\n"
    tests = ["assert abs(add(1, 2) - 3) < 0.5", "assert set([add(1, 2)]) == set([3])"]
    assert _score(program, tests, isolation) == 0.0
    two = "def max(xs):\n    return -1\ndef abs(x):\n    return 0\nclass Words:\n    def __contains__(self, w):\n        return True\n"
    two += "def words(s):\n    return Words()\n"
    assert (
        _score(two, ["assert abs(max([1, 3]) - 3) < 1e-9", "assert 'hello' in words('bye')"], isolation)
        == 0.0
    )
    reward = make_code_execution_reward(timeout_s=20, isolation=isolation)
    check = "def check(candidate):\n    assert abs(candidate(1, 2) - 3) < 0.5\n"
    scores = asyncio.run(
        reward(prompts=["q"], completions=[f"```python\n{program}\n```"], tests=[check], entry_point=["add"])
    )
    assert scores == [0.0]
    mbpp = "def sum(a, b):\n    return sum_of_divisors(a, b)\ndef sum_of_divisors(a, b):\n    return 6 if a == 10 else 3\n"
    assert _score(mbpp, ["assert sum(10, 15) == 6", "assert sum(4, 6) == 3"], isolation) == 1.0


@pytest.mark.parametrize("isolation", MODES)
def test_correct_code_of_every_test_shape_still_passes(isolation):
    """Plain values of every kind cross, program objects work as opaque handles (MBPP's ``Pair``), globals and
    modules the program imported are visible to the tests, and a HumanEval check script passes."""
    program = """
import math
from collections import Counter
LIMIT = 10
class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b
def max_chain_length(pairs, n):
    pairs = sorted(pairs, key=lambda p: p.a)
    return sum(1 for p in pairs if p.b > p.a)
def shapes():
    from fractions import Fraction
    from decimal import Decimal
    return [1, 2.5, "s", b"b", (1, (2,)), {"k": [None, True]}, {1, 2}, frozenset({3}), 2 ** 100, complex(1, 2),
            float("inf"), Fraction(1, 3), Decimal("0.1"), range(3)]
def counts(text):
    return dict(Counter(text))
def numbers(n):
    return (i * i for i in range(n))
def fails():
    raise ValueError("nope")
class Stack:
    def __init__(self):
        self.items = []
    def push(self, x):
        self.items.append(x)
        return len(self.items)
"""
    tests = [
        "assert max_chain_length([Pair(5, 24), Pair(15, 25), Pair(27, 40), Pair(50, 60)], 4) == 4",
        "assert shapes() == [1, 2.5, 's', b'b', (1, (2,)), {'k': [None, True]}, {1, 2}, frozenset({3}), 2 ** 100, "
        "1 + 2j, float('inf'), __import__('fractions').Fraction(1, 3), __import__('decimal').Decimal('0.1'), range(3)]",
        "assert counts('aab') == {'a': 2, 'b': 1}",
        "assert list(numbers(4)) == [0, 1, 4, 9] and sum(numbers(3)) == 5",
        "assert LIMIT == 10 and math.isclose(math.sqrt(2) ** 2, 2)",
        "try:\n    fails()\nexcept ValueError as exc:\n    assert 'nope' in str(exc)\nelse:\n    raise AssertionError",
        "s = Stack()\nassert s.push(1) == 1 and s.push(2) == 2 and s.items == [1, 2]",
        "p = Pair(1, 2)\nassert p == p and p != Pair(1, 2)",
    ]
    assert _score(program, tests, isolation) == 1.0
    assert (
        _score("def sum(a, b):\n    return a + b + 0\n", ["assert set([sum(1, 2)]) == {3}"], isolation) == 1.0
    )
    humaneval = "def check(candidate):\n    assert candidate([1, 2]) == 3\n    assert abs(candidate([0.5]) - 0.5) < 1e-9\n"
    reward = make_code_execution_reward(timeout_s=20, isolation=isolation)
    completion = "```python\ndef total(xs):\n    return sum(xs)\n```"
    scores = asyncio.run(
        reward(prompts=["q"], completions=[completion], tests=[humaneval], entry_point=["total"])
    )
    assert scores == [1.0]


@pytest.mark.parametrize("isolation", MODES)
def test_a_value_that_cannot_cross_fails_its_test_only(isolation):
    """A program object compared with a plain value is not equal to it; the other tests still count."""
    program = "def f():\n    return object()\ndef g():\n    return 2\n"
    assert _score(program, ["assert f() == 1", "assert g() == 2"], isolation) == 0.5


def test_program_exit_or_crash_mid_tests_fails_the_rest():
    program = "import os\ndef add(a, b):\n    if a == 2:\n        os._exit(0)\n    return a + b\n"
    result = run_python(program, tests=TESTS, timeout_s=20)
    assert result.tests_passed == (True, False, False)
    assert result.status == "error"


@pytest.mark.parametrize("isolation", ["process", *MODES[1:]])
def test_a_program_still_running_after_the_tests_is_stopped_not_waited_for(isolation):
    """The tests' side stops the program's process once the verdict is in (a thread that keeps it alive is
    not waited for), and that is not the program's failure."""
    program = "import threading, time\ndef add(a, b):\n    return a + b\nthreading.Thread(target=time.sleep, args=(60,)).start()\n"
    result = run_python(program, tests=TESTS, timeout_s=20, isolation=isolation)
    assert result.tests_passed == (True, True, True), result.stderr
    assert result.status == "ok", result


@pytest.mark.parametrize("isolation", ["process", *MODES[1:]])
def test_a_flood_of_diagnostics_during_the_tests_does_not_stall_them(isolation):
    """The program's diagnostics (an exception type per failed call) are read once the tests are done: 400
    calls, each raising an exception of its own ~900-character type name, still finish, and the run reports at
    most 256 of them."""
    program = (
        "n = 0\ndef add(a, b):\n    global n\n    n += 1\n"
        "    raise type('E' + 'x' * 900 + str(n), (Exception,), {})()\n"
    )
    test = "for i in range(400):\n    try:\n        add(1, 2)\n    except Exception:\n        pass\n"
    result = run_python(program, tests=[test], timeout_s=30, isolation=isolation)
    assert result.tests_passed == (True,), result
    assert result.status == "ok"
    assert 100 <= len(result.exceptions) <= 256


@pytest.mark.parametrize("isolation", ["process", *MODES[1:]])
def test_what_the_program_reports_during_the_tests_survives_a_timeout(isolation):
    """A limit the program's process ran into while answering a test is passed on as it happens: a run then
    killed by its wall-clock timeout still reads ``memory`` (once lost: the diagnostics were read after the
    tests only)."""
    program = "import time\ndef f(x):\n    if x == 1:\n        raise MemoryError()\n    time.sleep(60)\n"
    test = "try:\n    f(1)\nexcept MemoryError:\n    pass\nf(2)\n"
    result = run_python(program, tests=[test], timeout_s=3, isolation=isolation)
    assert result.status == "timeout"
    assert "memory" in result.limits_hit and "MemoryError" in result.exceptions, result


@pytest.mark.parametrize("isolation", ["process", *MODES[1:]])
def test_tests_that_run_out_of_cpu_fail_the_run_and_are_reported(isolation):
    """The tests' side runs under the run's CPU limit; out of it, the run fails with the tests' exit status and
    the program's report (once, as a PID namespace's init, it ignored SIGXCPU and died unreported by the hard
    limit a second later)."""
    result = run_python(
        "def add(a, b):\n    return a + b\n", tests=["while True:\n    pass\n"], limits=Limits(cpu_s=1),
        timeout_s=20, isolation=isolation,
    )  # fmt: skip
    assert result.status == "error" and result.exit_code == 1 and result.signal is None, result
    assert result.cpu_s is not None and result.tests_passed == (False,)


def test_a_program_that_ends_after_the_verdict_is_not_failed_by_it():
    """Once the tests are done, what the program's process does as it ends (here: exit status 3 from an
    ``atexit`` handler) is not its failure: every run reads ``ok`` (once 1 in 8 read ``error``, a race)."""
    program = "import atexit, os\natexit.register(lambda: os._exit(3))\ndef add(a, b):\n    return a + b\n"
    results = [run_python(program, tests=TESTS, timeout_s=20) for _ in range(12)]
    assert {(r.status, r.exit_code, r.tests_passed) for r in results} == {("ok", 0, (True, True, True))}


@pytest.mark.parametrize("isolation", ["process", *MODES[1:]])
def test_a_lone_surrogate_in_the_program_is_its_error_not_the_callers(isolation):
    result = run_python("print('\\ud800' + '\ud800')", timeout_s=20, isolation=isolation)
    assert result.status == "error" and result.sandbox_error is None


# --------------------------------------------------------------------------- #36: third-party modules and set-up

NUMPY_TESTS = ["assert np.allclose(double([1, 2]), [2, 4])", "assert np.allclose(double([0.5]), [1.0])"]


@pytest.mark.parametrize("isolation", MODES)
def test_tests_use_their_own_copy_of_a_third_party_module_the_program_imported(isolation):
    """Once the tests never got numpy (correct code 0.0) and a program's own ``np`` crossed as a proxy (1.0)."""
    pytest.importorskip("numpy")
    if run_python("import numpy", timeout_s=20, isolation=isolation.removeprefix("unsafe_")).status != "ok":
        # A venv under /tmp (a clone there) is hidden by each run's own /tmp: no third-party module imports.
        pytest.skip("the sandbox cannot import numpy here (the virtualenv lies under /tmp)")
    correct = "import numpy as np\ndef double(xs):\n    return [float(x) for x in np.array(xs) * 2]\n"
    assert _score(correct, NUMPY_TESTS, isolation) == 1.0
    fake_object = (
        "class Anything:\n    def allclose(self, *args, **kwargs):\n        return True\n"
        "np = Anything()\ndef double(xs):\n    return [0.0]\n"
    )
    assert _score(fake_object, NUMPY_TESTS, isolation) == 0.0
    fake_module = (
        "import types\nnp = types.ModuleType('numpy')\nnp.allclose = lambda *args, **kwargs: True\n"
        "def double(xs):\n    return [0.0]\n"
    )
    assert _score(fake_module, NUMPY_TESTS, isolation) == 0.0
    written = "open('numpy.py', 'w').write('allclose = lambda *a, **k: True')\nimport sys\nsys.path.insert(0, '.')\n"
    written += "import importlib; np = importlib.import_module('numpy')\ndef double(xs):\n    return [0.0]\n"
    assert _score(written, NUMPY_TESTS, isolation) == 0.0


SETUP = "def check(value):\n    return value == 3\n"


def _score_with_setup(program: str, isolation: str) -> float | None:
    reward = make_code_execution_reward(timeout_s=20, isolation=isolation, setup_column="test_setup_code")
    completion = f"```python\n{program}\n```"
    tests = [["assert check(add(1, 2))", "assert check(add(2, 1))"]]
    return asyncio.run(reward(prompts=["q"], completions=[completion], tests=tests, test_setup_code=[SETUP]))[
        0
    ]


@pytest.mark.parametrize("isolation", MODES)
def test_set_up_code_runs_where_the_program_cannot_rewrite_it(isolation):
    """MBPP's test_setup_code once ran after the program, on its side: the helper the tests call could be
    rewritten by the code under test (wrong code scored 1.0)."""
    assert _score_with_setup("def add(a, b):\n    return a + b\n", isolation) == 1.0
    rewrites = (
        "def add(a, b):\n    check.__code__ = (lambda value: value == 0).__code__\n    return 0\n",
        "import builtins\ndef add(a, b):\n    builtins.check = lambda value: True\n    return 0\n",
        "def check(value):\n    return True\ndef add(a, b):\n    return 0\n",
    )
    for program in rewrites:
        assert _score_with_setup(program, isolation) == 0.0, program


def test_a_failing_set_up_fails_every_test():
    result = run_python(
        "def add(a, b):\n    return a + b\n", tests=["assert add(1, 2) == 3"], setup="raise ValueError('set-up')",
        timeout_s=20,
    )  # fmt: skip
    assert result.tests_passed == (False,) and "the test set-up failed" in result.stderr
    with pytest.raises(ValueError, match="give tests too"):
        run_python("pass", setup="x = 1")
