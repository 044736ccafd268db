"""The sandbox against a hostile program (#17): what the program leaves behind must not break the reward or
the host, and a correct program passes however many tests it has.

Each probe is bounded (a timeout, a tree of a few entries) and cleans up after itself. Probes that need an
unprivileged caller fork the test process and drop to ``nobody`` in the child: the venv's interpreter may
live under a root-only home, so an unprivileged *new* interpreter is not always possible, but a fork is.
"""

from __future__ import annotations

import asyncio
import json
import logging
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
from rewards.sandbox import Limits, bwrap, run_python, sandbox_isolation, sweep_stale_workdirs
from rewards.sandbox import isolation as isolation_module
from rewards.sandbox import workdir as sandbox_workdir
from tests.conftest import REPO, run_cli

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
    sandbox_workdir._remove_tree(top)


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
    yield
    bwrap.bwrap_version.cache_clear()  # it may have cached "not installed" from the empty PATH


@pytest.mark.parametrize("isolation", ["auto", "namespaces"])
def test_the_code_reward_refuses_to_start_without_a_boundary(no_boundary, isolation):
    with pytest.raises(RewardConfigError, match="isolation: unsafe_process") as caught:
        make_code_execution_reward(isolation=isolation)
    # the missing tool, as found (bwrap, or as root util-linux's unshare), with the command that installs it
    assert "is not installed" in str(caught.value) and isolation_module._isolation.reason in str(caught.value)


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


# --------------------------------------------------------------------------- #36: set-ups that once broke the boundary

SYMLINK_PROBE = (
    "import sys\nfrom rewards.sandbox import run_python, sandbox_isolation\n"
    "found = sandbox_isolation()\nresult = run_python('print(6 * 7)', timeout_s=20)\n"
    "print(sys.executable, found.namespaces, found.reason, result.isolation, result.stdout.strip(), sep='|')\n"
)


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the suite runs outside a virtualenv")
@pytest.mark.skipif("namespaces" not in MODES, reason="this machine cannot create namespaces")
def test_a_venv_reached_through_a_symlink_builds_the_boundary(tmp_path):
    """A .venv link to a shared environment: the slot once bound the real path and ran the linked one."""
    link = tmp_path / "shared-env"
    link.symlink_to(os.path.realpath(sys.prefix))
    python = link / "bin" / Path(sys.executable).name
    proc = subprocess.run(
        [str(python), "-c", SYMLINK_PROBE], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    executable, namespaces, reason, isolation, stdout = proc.stdout.strip().splitlines()[-1].split("|")
    assert executable == str(python)  # the interpreter really was reached through the link
    assert (namespaces, reason, isolation, stdout) == ("True", "", "namespaces", "42")


@pytest.fixture
def failing_bwrap(monkeypatch, tmp_path):
    """bubblewrap 0.9 installed but unable to start anything (as where user namespaces are forbidden)."""
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo 'bubblewrap 0.9.0' && exit 0\n"
                    "echo 'bwrap: setting up uid map: Permission denied' >&2\nexit 1\n")  # fmt: skip
    fake.chmod(0o755)
    for tool in ("unshare", "mount", "setpriv", "sh"):
        (tmp_path / tool).symlink_to(shutil.which(tool))
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(isolation_module, "_isolation", None)
    bwrap.bwrap_version.cache_clear()
    sandbox.pool.close_pool()  # slots already started with the real bwrap would answer the probe
    yield
    bwrap.bwrap_version.cache_clear()
    sandbox.pool.close_pool()


def test_a_failing_boundary_is_named_without_blaming_a_missing_bubblewrap(failing_bwrap, caplog):
    with caplog.at_level("INFO"), pytest.raises(RewardConfigError) as caught:
        make_code_execution_reward(isolation="auto")
    message = str(caught.value)
    assert "Permission denied" in message and "user namespaces" in message
    assert "apt-get install bubblewrap" not in message and "not installed" not in message
    # No warning that library calls fall back to plain processes comes before the refusal.
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


def test_auto_never_falls_back_to_running_model_code_as_root(no_boundary, caplog):
    if os.geteuid() != 0:
        pytest.skip("the caller is not root")
    with caplog.at_level("WARNING"):
        result = run_python("print('ran')", timeout_s=5)
    assert result.stdout == "" and result.isolation == "auto"
    assert "does not run model-written code as root" in result.sandbox_error
    assert sandbox_isolation().reason in result.sandbox_error  # the real cause
    assert "plain processes" not in caplog.text
    explicit = run_python("print('ran')", timeout_s=5, isolation="process")  # asked for by name: allowed
    assert explicit.stdout == "ran\n"


def test_an_unprivileged_caller_falls_back_to_plain_processes():
    """The fallback's decision, taken in a fork that dropped to nobody (no new interpreter: see _as_nobody)."""

    found = isolation_module.Isolation(False, "bubblewrap (bwrap) is not installed", missing_tool=True)

    def decide():
        assert isolation_module.auto_fallback(found) is None and isolation_module.auto_fallback(found) is None
        assert isolation_module._warned_fallback

    assert _as_nobody(decide) == (0, "")
    assert isolation_module.auto_fallback(found) is not None  # this (root) process: refused


SLOT_UIDS = (
    "import sys\nfrom rewards.sandbox import pool, run_python\n"
    "assert run_python('print(1)', timeout_s=20, isolation='namespaces').stdout == '1\\n'\n"
    "def uid(pid):\n"
    "    return next(int(l.split()[1]) for l in open(f'/proc/{pid}/status') if l.startswith('Uid:'))\n"
    "import time\nend = time.monotonic() + 30\n"
    "while not pool.pool()._free and time.monotonic() < end:  # the used slot is being made ready again\n"
    "    time.sleep(0.05)\n"
    "print(sorted(uid(s.process.pid) for s in pool.pool()._free))\n"  # a JSON list
)
"""Run once in the namespaces, then print the host uids the process's idle slots run as."""


@pytest.mark.skipif("namespaces" not in MODES, reason="this machine cannot create namespaces")
def test_slot_uids_are_unique_across_trainer_processes():
    """Two trainers on one host: per-uid kernel counters (inotify instances, ...) must not be shared."""
    if os.geteuid() != 0:
        pytest.skip("an unprivileged caller's slots all run as its own uid")
    first = subprocess.Popen(
        [sys.executable, "-c", SLOT_UIDS + "sys.stdout.flush()\nsys.stdin.read()\n"],
        cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        held = json.loads(first.stdout.readline())
        second = subprocess.run(
            [sys.executable, "-c", SLOT_UIDS], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert second.returncode == 0, second.stderr[-3000:]
        other = json.loads(second.stdout.strip().splitlines()[-1])
    finally:
        first.stdin.close()
        first.wait(timeout=60)
    assert held and other and not set(held) & set(other), (held, other)


def test_slot_leases_fall_back_to_the_temp_dir_where_run_is_not_writable(monkeypatch):
    """A container without a writable /run: the lease still holds host-wide (the temp dir every trainer uses)."""
    if os.geteuid() != 0:
        pytest.skip("an unprivileged caller's slots lease nothing")
    import fcntl

    monkeypatch.setattr(sandbox.pool, "LEASE_DIR", "/proc/dna-sandbox-slots")  # cannot be created
    free, fd = sandbox.pool._lease(4000)
    try:
        path = Path(tempfile.gettempdir(), "dna-sandbox-slots", "4000")
        assert free and fd is not None and path.is_file()
        other = os.open(path, os.O_RDWR)  # another open file description, as another trainer's
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(other)
    finally:
        os.close(fd)
    free, fd = sandbox.pool._lease(4000)  # released with its descriptor
    os.close(fd)
    assert free
