"""launch.py: accelerate's launcher, with the workers' own one line at the end instead of the launcher's traceback.

The Ctrl-C tests (a real SFT run, both launcher paths) are in tests/test_distributed.py (slow tier)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "launch.py", *args], cwd=REPO, env=cli_env(OMP_NUM_THREADS="1"), capture_output=True,
        text=True, timeout=timeout,
    )  # fmt: skip


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "launcher", [[], ["--config_file", "configs/accelerate/ddp-cpu.yaml"]], ids=["simple", "torchrun"]
)
def test_a_failing_worker_ends_in_its_own_line_and_status(launcher):
    """accelerate alone adds a CalledProcessError traceback (simple launcher) or torch elastic's ChildFailedError
    table (torchrun) under the worker's one-line error, and exits 1."""
    proc = _launch(*launcher, "sft.py", "--config", "missing.yaml")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Config file 'missing.yaml' does not exist" in proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr[-3000:]
    assert "launch:" not in proc.stderr, proc.stderr[-3000:]  # the worker said why: nothing to add


@pytest.mark.timeout(180)
def test_a_worker_killed_by_a_signal_is_named_in_one_line(tmp_path):
    """A worker killed outright (the OOM killer's SIGKILL) prints nothing itself: the launcher says so, once."""
    script = tmp_path / "dies.py"
    script.write_text(
        "import os, signal\nprint('working', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    proc = _launch(str(script))
    assert proc.returncode == 128 + 9, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("launch:")]
    assert len(lines) == 1 and "SIGKILL" in lines[0] and "dies.py" in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.timeout(60)
def test_launch_takes_accelerate_launchs_options():
    proc = _launch("--help", timeout=60)
    assert proc.returncode == 0 and "--config_file" in proc.stdout and "training_script" in proc.stdout
