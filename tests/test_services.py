"""Issue #19 item 2: every external service a recipe names is waited for (bounded, logged) before anything loads.

Each kind of service — the sync GRPO vLLM server (``vllm_mode: server``), the judge of the judge reward
(``JUDGE_BASE_URL``), the distillation teacher (``teacher_server_url``) — that does not answer is one
``error:`` line naming its URL and how to start it, exit 2, no traceback, before the data loads;
``--dry_run`` probes them best effort and says which it skipped. Real subprocesses and a real local
HTTP server (``http.server`` in a thread) for the judge that answers with an error.
"""

from __future__ import annotations

import http.server
import threading

import pytest

from dna_factory.serving.services import start_line
from tests.conftest import run_cli

DOWN = "http://127.0.0.1:9"  # nothing listens on the discard port
GRPO = "configs/grpo/tiny-cpu.yaml"
DISTILL = "configs/distill/tiny-cpu.yaml"
JUDGE = "[{factory: string_match, extractor: last_number, answer_column: solution}, {factory: judge}]"

# (entry script, flags, environment, the URL the error must name, a word of the start command it must name)
KINDS = {
    "sync vLLM server (base_url)": (
        "grpo.py",
        ["--config", GRPO, "--use_vllm", "true", "--vllm_mode", "server", "--vllm_server_base_url", DOWN],
        {},
        DOWN,
        start_line("generation", "artifacts/tiny/student", 9),
    ),
    "sync vLLM server (host, port)": (
        "grpo.py",
        [
            "--config",
            GRPO,
            "--use_vllm",
            "true",
            "--vllm_mode",
            "server",
            "--vllm_server_host",
            "127.0.0.1",
            "--vllm_server_port",
            "9",
        ],  # fmt: skip
        {},
        DOWN,
        start_line("generation", "artifacts/tiny/student", 9),
    ),
    "judge": (
        "grpo.py",
        ["--config", GRPO, "--reward_funcs", JUDGE],
        {"JUDGE_BASE_URL": f"{DOWN}/v1"},
        DOWN,
        start_line("judge", "JUDGE", 9),
    ),  # fmt: skip
    "distillation teacher": (
        "distill.py",
        ["--config", DISTILL, "--distill_mode", "server_teacher", "--teacher_server_url", DOWN],
        {},
        DOWN,
        start_line("teacher", "artifacts/tiny/teacher", 9),
    ),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_an_unreachable_service_is_one_error_line_before_anything_loads(
    kind, tiny_model, tiny_teacher, tmp_path
):
    script, flags, env, url, start = KINDS[kind]
    proc = run_cli(
        script, *flags, "--server_wait_s", "2", "--output_dir", str(tmp_path / "run"), timeout=120, **env
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "Waiting for the" in proc.stderr and url in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and url in last and "server_wait_s" in last, last
    assert start in last, last
    assert "Training mixture" not in proc.stderr, "the wait must come before the data loads"


@pytest.mark.parametrize("kind", list(KINDS))
def test_dry_run_probes_each_service_and_skips_an_unreachable_one(kind, tiny_model, tiny_teacher):
    script, flags, env, url, _ = KINDS[kind]
    proc = run_cli(script, *flags, "--dry_run", timeout=120, **env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"skipped: {url} not reachable" in proc.stderr, proc.stderr[-3000:]


class _Failing(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(500)
        self.end_headers()
        self.wfile.write(b"engine dead")

    def log_message(self, *args):
        pass


@pytest.fixture
def failing_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Failing)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_judge_answering_500_at_start_up_is_one_error_line_naming_the_status(
    failing_server, tiny_model, tmp_path
):
    proc = run_cli("grpo.py", "--config", GRPO, "--reward_funcs", JUDGE, "--server_wait_s", "2",
                   "--output_dir", str(tmp_path / "run"), timeout=120, JUDGE_BASE_URL=f"{failing_server}/v1")  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: The judge server at {failing_server}") and "HTTP 500" in last, last
    assert "Traceback" not in proc.stderr


# --------------------------------------------------------------------------- #37 item 4: one start line per kind


def _start_commands(path) -> list[str]:
    """Every GPU vLLM server start command in a doc or a recipe's header: continuation lines joined, a recipe's
    comment marks and the ``CUDA_VISIBLE_DEVICES=...`` prefix and a trailing ``&`` removed (CPU lines, with
    ``VLLM_CPU_KVCACHE_SPACE``, are the CPU recipes' own)."""
    import re

    lines = [re.sub(r"^#\s?", "", line).strip() for line in path.read_text().splitlines()]
    joined, current = [], ""
    for line in lines:
        current = f"{current} {line}".strip() if current else line
        if current.endswith("\\"):
            current = current[:-1].strip()
            continue
        joined.append(current)
        current = ""
    found = []
    for line in joined:
        command = re.sub(r"\s+&$", "", re.sub(r"^CUDA_VISIBLE_DEVICES=\S+\s+", "", line))
        starts = re.match(r"(\w+=\S+\s+)*(vllm serve |python -m vllm\.entrypoints)", command)
        if starts and "VLLM_CPU_KVCACHE_SPACE" not in command:
            found.append(command)
    return found


def _pattern(kind: str):
    import re

    from dna_factory.serving.services import START_LINES

    text = re.escape(START_LINES[kind].replace("{{", "{").replace("}}", "}"))
    text = text.replace(re.escape("{model}"), r"\S+").replace(re.escape("{port}"), r"(\d+|PORT)")
    return re.compile(text + r"(\s|$)")


def test_every_server_start_line_in_the_docs_and_recipes_is_the_one_of_its_kind():
    """The hints (dna_factory.serving.services.START_LINES), the recipe headers and the docs give one start line per kind
    of server; GRPO's server mode (sync or async) always with NCCL weight transfer. Sizing flags may follow."""
    from tests.conftest import REPO

    files = sorted((REPO / "docs").glob("*.md")) + sorted((REPO / "configs").rglob("*.yaml"))
    checked = 0
    for path in files:
        for command in _start_commands(path):
            checked += 1
            grpo = path.parent.name == "grpo" or path.name in ("grpo.md", "async-grpo.md")
            kinds = ["generation"] if grpo else ["generation", "eval", "teacher", "judge"]
            assert any(_pattern(kind).match(command) for kind in kinds), (path.name, command)
    assert checked >= 10, checked
