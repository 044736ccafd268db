"""The sandbox against a hostile program (#17): what the program leaves behind must not break the reward or
the host, and a correct program passes however many tests it has.

Each probe is bounded (a timeout, a tree of a few entries) and cleans up after itself. Probes that need an
unprivileged caller fork the test process and drop to ``nobody`` in the child: the venv's interpreter may
live under a root-only home, so an unprivileged *new* interpreter is not always possible, but a fork is.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from dna_factory.agents.coding import CodingEnvironment
from dna_factory.errors import DnaConfigError
from rewards import sandbox
from rewards.code import make_code_execution_reward
from rewards.registry import RewardConfigError
from rewards.sandbox import Limits, run_python, sandbox_isolation, sweep_stale_workdirs
from rewards.sandbox import isolation as isolation_module
from tests.conftest import run_cli

MODES = ["process", *(["namespaces"] if sandbox_isolation().namespaces else [])]
NOBODY = 65534


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _as_nobody(function, *args) -> tuple[int, str]:
    """Run ``function(*args)`` in a fork of this process as uid/gid ``nobody`` (as it is when not root).

    Returns the child's exit status (0: returned, 1: raised) and what it raised, ``type: message``.
    """
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(reader)
        code = 0
        try:
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(NOBODY)
                os.setuid(NOBODY)
            function(*args)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, which asserts on it
            os.write(writer, f"{type(exc).__name__}: {exc}".encode()[:4000])
            code = 1
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        raised = pipe.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), raised


def _make_locked_tree(top: str) -> None:
    """What a program can leave in its working directory: a directory it made unreadable and unwritable."""
    os.makedirs(os.path.join(top, "d", "e"))
    Path(top, "d", "e", "f.txt").write_text("x")
    os.chmod(os.path.join(top, "d"), 0)


def _lock_and_remove(top: str) -> None:
    os.mkdir(top)
    _make_locked_tree(top)
    sandbox._remove_tree(top)


@pytest.fixture
def shared_dir():
    """A sticky world-writable folder in the system temp dir (pytest's own is not reachable by ``nobody``)."""
    folder = Path(tempfile.mkdtemp(prefix="hostile-", dir="/tmp"))
    folder.chmod(0o1777)
    yield folder
    subprocess.run(["chmod", "-R", "u+rwx", str(folder)], check=False)
    shutil.rmtree(folder, ignore_errors=True)


def test_cleanup_by_an_unprivileged_caller_of_a_locked_tree_never_raises(shared_dir):
    top = shared_dir / "dna-sandbox-1-locked"
    status, raised = _as_nobody(_lock_and_remove, str(top))
    assert status == 0, raised
    assert not top.exists()


def test_the_stale_workdir_sweep_never_follows_a_link(tmp_path, monkeypatch):
    """A program (or anyone) plants ``dna-sandbox-<dead pid>-x`` as a link: the sweep leaves the temp dir and
    the link's target exactly as they were."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    temp.chmod(0o1777)
    target = tmp_path / "target"
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    target.chmod(0o750)
    (temp / f"dna-sandbox-{_dead_pid()}-planted").symlink_to(target)
    monkeypatch.setattr(tempfile, "tempdir", str(temp))

    sweep_stale_workdirs()

    assert stat.S_IMODE(temp.stat().st_mode) == 0o1777
    assert stat.S_IMODE(target.stat().st_mode) == 0o750
    assert (target / "keep.txt").read_text() == "precious"


def test_a_locked_tree_inside_a_real_run_is_removed(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    program = "import os\nos.makedirs('d/e')\nopen('d/e/f', 'w').write('x')\nos.chmod('d', 0)\nprint('done')"
    result = run_python(program, timeout_s=10, isolation="process")
    assert result.status == "ok" and result.stdout == "done\n", result
    assert not list(tmp_path.glob("dna-sandbox-*"))


# --- a correct program passes any number of tests ---------------------------------------------------------

MANY = 3000  # the report pipe (64 KiB) used to fill at about 1,500 passes, blocking the program


@pytest.mark.parametrize("mode", MODES)
def test_thousands_of_tests_all_pass(mode):
    tests = [f"assert echo({i}) == {i}" for i in range(MANY)]
    result = run_python(
        "def echo(x):\n    return x", tests=tests, timeout_s=30, isolation=mode, limits=Limits(cpu_s=20)
    )
    assert result.status == "ok", (result.status, result.limits_hit, result.stderr[-500:])
    assert result.tests_passed == (True,) * MANY


def test_the_reward_scores_a_correct_program_with_thousands_of_tests_one():
    reward = make_code_execution_reward(timeout_s=30)
    completion = "```python\ndef echo(x):\n    return x\n```"
    tests = [f"assert echo({i}) == {i}" for i in range(MANY)]
    assert asyncio.run(reward(prompts=["q"], completions=[completion], tests=[tests])) == [1.0]


# --- fail closed: no boundary, no model-written code (unless the recipe opts out by name) ------------------

ADD = "```python\ndef add(a, b):\n    return a + b\n```"


@pytest.fixture
def no_boundary(monkeypatch, tmp_path):
    """This process as on a machine where no boundary can be built: no ``unshare`` on the PATH, the probe
    forgotten (monkeypatch puts this process's own probe back afterwards)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(isolation_module, "_isolation", None)


@pytest.mark.parametrize("isolation", ["auto", "namespaces"])
def test_the_code_reward_refuses_to_start_without_a_boundary(no_boundary, isolation):
    with pytest.raises(RewardConfigError, match="isolation: unsafe_process") as caught:
        make_code_execution_reward(isolation=isolation)
    assert "unshare" in str(caught.value)


def test_unsafe_process_is_an_explicit_opt_in_that_warns_once_per_run(no_boundary, caplog):
    with caplog.at_level("WARNING"):
        reward = make_code_execution_reward(isolation="unsafe_process", name="unsafe_probe")
        make_code_execution_reward(isolation="unsafe_process", name="unsafe_probe")  # no second warning
    warnings = [r.getMessage() for r in caplog.records if "unsafe_process" in r.getMessage()]
    assert len(warnings) == 1 and "no sandbox boundary" in warnings[0], warnings
    scores = asyncio.run(reward(prompts=["q"], completions=[ADD], tests=[["assert add(1, 2) == 3"]]))
    assert scores == [1.0]


def test_every_start_of_an_unsafe_recipe_warns():
    unsafe = "[{factory: code_execution, isolation: unsafe_process}]"
    for _ in range(2):
        proc = run_cli(
            "grpo.py", "--config", "configs/grpo/tiny-cpu-code.yaml", "--reward_funcs", unsafe, "--dry_run"
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "isolation: unsafe_process: model-written code runs with no sandbox boundary" in proc.stderr


def test_the_old_process_spelling_names_the_new_one():
    with pytest.raises(RewardConfigError, match="unsafe_process"):
        make_code_execution_reward(isolation="process")


def test_the_coding_agent_fails_closed_too(no_boundary):
    with pytest.raises(DnaConfigError, match="isolation: unsafe_process"):
        CodingEnvironment.check_options({})
    with pytest.raises(DnaConfigError, match="isolation: unsafe_process"):
        CodingEnvironment()
    environment = CodingEnvironment(isolation="unsafe_process")
    assert "status: ok" in asyncio.run(environment.run_python("print(6 * 7)"))


def test_a_recipe_without_a_boundary_is_one_error_line_under_dry_run(tmp_path):
    proc = run_cli("grpo.py", "--config", "configs/grpo/tiny-cpu-code.yaml", "--dry_run", PATH=str(tmp_path))
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "isolation: unsafe_process" in errors[0], errors[0]
