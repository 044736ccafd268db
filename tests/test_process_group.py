"""Process groups and the cleanup that stops them with their owner (dna_factory/run/process_group.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from dna_factory.serving.vllm_server import group_alive
from tests.conftest import REPO, cli_env

OWNER = """
import sys
import time
from pathlib import Path
from dna_factory.eval.harness import HarnessRun
from dna_factory.serving.vllm_server import install_cleanup_hooks
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


GUARDED = """
import subprocess, sys
from dna_factory.run.process_group import with_owner
log = open(sys.argv[1], "w")
child = subprocess.Popen(
    [*with_owner("http.server", 2.0), "0", "--bind", "127.0.0.1"], stdout=log, stderr=log, start_new_session=True
)
print(child.pid, flush=True)
sys.stdin.read()
"""


def test_a_server_module_stops_its_group_when_its_owner_is_killed_outright(tmp_path):
    """An owner killed with SIGKILL (the OOM killer, a native crash) runs no atexit or SIGTERM hook: a vLLM server it
    started (own session) lived on, re-parented to PID 1, holding its memory and port. Under
    ``python -m dna_factory.run.process_group`` the module runs in the same process and stops its group when the owner
    is gone (a vLLM server: tests/test_vllm_server.py)."""
    log = tmp_path / "server.log"
    owner = subprocess.Popen(
        [sys.executable, "-c", GUARDED, str(log)], cwd=REPO, env=cli_env(), stdin=subprocess.PIPE,
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    pgid = int(owner.stdout.readline())
    try:
        deadline = time.monotonic() + 30
        while "Serving HTTP" not in log.read_text() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "Serving HTTP" in log.read_text(), log.read_text()  # http.server runs as `python -m` runs it
        owner.kill()
        owner.wait(timeout=30)
        deadline = time.monotonic() + 20
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not group_alive(pgid), "the server outlived its owner's SIGKILL"
        assert f"http.server: owner {owner.pid} is gone; stopping" in log.read_text(), log.read_text()
    finally:
        owner.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
