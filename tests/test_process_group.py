"""Process groups and the cleanup that stops them with their owner (dna_factory/process_group.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

from dna_factory.vllm_server import group_alive
from tests.conftest import REPO, cli_env

OWNER = """
import sys
from pathlib import Path
from dna_factory.eval.harness import HarnessRun
from dna_factory.vllm_server import install_cleanup_hooks
install_cleanup_hooks()
run = HarnessRun([sys.executable, "-c", "import time; time.sleep(120)"], Path(sys.argv[1])).start()
print(run.pid, flush=True)
sys.stdin.read()
"""


def test_sigterm_to_the_owner_stops_its_harness_run_at_once(tmp_path):
    """#16 item 3: a checkpoint-eval harness run joins the cleanup the vLLM servers have: SIGTERM to the trainer
    (a preemption) stops its process group before the trainer dies. Before, only the harness's own parent watch
    ended it, a second or more after the trainer, and a command without that watch not at all."""
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path / "harness.log")], cwd=REPO, env=cli_env(),
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pgid = int(owner.stdout.readline())
    try:
        assert group_alive(pgid)
        owner.send_signal(signal.SIGTERM)
        owner.wait(timeout=60)
        assert owner.returncode == -signal.SIGTERM
        assert not group_alive(pgid), "the harness run outlived its owner's SIGTERM"
    finally:
        owner.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
