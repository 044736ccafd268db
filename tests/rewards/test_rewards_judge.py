"""The LLM-judge reward against a real aiohttp server on 127.0.0.1 with injected faults (S-JUDGE).

The server runs in its own thread and event loop, as a judge runs in its own process. Each
completion carries a marker (``SCORE:6``, ``SLOW``, ``FAIL500ONCE``...) that tells the server how
to answer requests for that sample, so one batch can mix faults and the test can check that
every sample keeps its place. The timeout and backoff constants are lowered for speed; the spec
values are asserted separately.
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import re
import socket
import threading
import time
from collections import defaultdict

import pytest
from aiohttp import web

from rewards import generative
from rewards.generative import make_judge_reward, parse_score
from tests.lazy import lazy

trl_utils = lazy("trl.trainer.utils")


API_KEY = "sk-judge-TESTKEY-7f3a9c"
FAST_TIMEOUT_S = 0.3
FAST_BACKOFF_S = (0.1, 0.2)
RUBRIC = "Grade it.\nQUESTION: {prompt}\nRESPONSE: {completion}\nEnd with Score: N"
REF_RUBRIC = "Grade it.\nQUESTION: {prompt}\nREFERENCE: {reference}\nRESPONSE: {completion}"
MARKER = re.compile(
    r"\b(SCORE:\d+|THINKCUT|THINK|BARE|GARBAGE|OUTOFRANGE|NOTJSON|FAIL500ONCE|ALWAYS500|ECHOKEY|E400|SLOW|PAUSE)\b"
)


class JudgeServer:
    """An OpenAI-compatible judge whose answer depends on a marker in the graded response."""

    def __init__(self) -> None:
        self.requests: dict[str, list[float]] = defaultdict(list)  # marker -> request times
        self.bodies: list[dict] = []
        self.auth_headers: list[str | None] = []
        self.model_listings = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.slow_s = 1.0
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def models(self, request: web.Request) -> web.Response:
        self.model_listings += 1
        return web.json_response({"object": "list", "data": [{"id": "judge-model"}, {"id": "other"}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        self.auth_headers.append(request.headers.get("Authorization"))
        text = body["messages"][0]["content"]
        match = MARKER.search(text.rpartition("RESPONSE:")[2])
        marker = match.group(1) if match else "NONE"
        self.requests[marker].append(time.monotonic())
        count = len(self.requests[marker])
        if marker.startswith("SCORE:"):
            return self._reply(f"The response is fine.\nScore: {marker.split(':')[1]}")
        if marker == "THINK":
            return self._reply("<think>Score: 2 would be harsh.</think>\nIt is right.\nScore: 9")
        if marker == "THINKCUT":
            return self._reply("<think>Still thinking. Score: 9 maybe")
        if marker == "BARE":
            return self._reply("Reasoning.\n8")
        if marker == "GARBAGE":
            return self._reply("I like turtles.")
        if marker == "OUTOFRANGE":
            return self._reply("Score: 11")
        if marker == "NOTJSON":
            return web.Response(text="<html>proxy error</html>", content_type="text/html")
        if marker == "FAIL500ONCE":
            if count == 1:
                return web.Response(status=500, text="overloaded")
            return self._reply("Score: 8")
        if marker == "ALWAYS500":
            return web.Response(status=500, text="broken")
        if marker == "ECHOKEY":
            return web.Response(status=503, text=f"denied for {request.headers.get('Authorization')}")
        if marker == "E400":
            return web.Response(status=400, text="prompt too long")
        if marker == "SLOW":
            await asyncio.sleep(self.slow_s)
            return self._reply("Score: 10")
        if marker == "PAUSE":
            await asyncio.sleep(0.1)
            return self._reply("Score: 7")
        return self._reply("Score: 0")

    @staticmethod
    def _reply(content: str) -> web.Response:
        return web.json_response(
            {
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ]
            }
        )

    def start(self) -> None:
        ready = threading.Event()

        async def boot() -> None:
            app = web.Application()
            app.router.add_get("/v1/models", self.models)
            app.router.add_post("/v1/chat/completions", self.chat)
            self.runner = web.AppRunner(app, access_log=None)
            await self.runner.setup()
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            await site.start()
            self.port = self.runner.addresses[0][1]

        def run() -> None:
            asyncio.set_event_loop(self.loop)
            self.loop.run_until_complete(boot())
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        assert ready.wait(10), "the test judge server did not start"

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest.fixture
def server(monkeypatch):
    judge = JudgeServer()
    judge.start()
    monkeypatch.setenv("JUDGE_BASE_URL", judge.base_url)
    monkeypatch.setenv("JUDGE_API_KEY", API_KEY)
    monkeypatch.delenv("JUDGE_MODEL", raising=False)
    monkeypatch.setattr(generative, "TIMEOUT_S", FAST_TIMEOUT_S)
    monkeypatch.setattr(generative, "BACKOFF_S", FAST_BACKOFF_S)
    yield judge
    judge.stop()


def call(reward, completions, **columns):
    """Run the async reward the way TRL does: awaited on an event loop, keyword arguments only."""
    return asyncio.run(reward(prompts=["What is it?"] * len(completions), completions=completions, **columns))


def test_spec_constants():
    assert generative.CONCURRENCY == 16
    assert generative.TIMEOUT_S == 120
    assert generative.MAX_RETRIES == 2
    assert generative.BACKOFF_S == (1.0, 2.0)
    assert generative.MAX_TOKENS == 2048
    assert generative.THRESHOLD == 7
    assert generative.DEFAULT_REFERENCE_COLUMN == "solution"


def test_trl_sees_an_async_reward_with_its_name():
    judge = make_judge_reward(RUBRIC, name="my_judge")
    assert trl_utils.is_async_callable(judge)
    assert trl_utils.get_callable_name(judge) == "my_judge"
    assert trl_utils.get_callable_name(make_judge_reward(RUBRIC)) == "judge_reward"


def test_threshold_six_vs_seven_and_request_shape(server):
    judge = make_judge_reward(RUBRIC)
    scores = call(judge, ["SCORE:6", "SCORE:7", "SCORE:10", "SCORE:0"])
    assert scores == [0.0, 1.0, 1.0, 0.0]
    body = server.bodies[0]
    assert body["model"] == "judge-model"  # first model the server lists
    assert body["max_tokens"] == 2048
    assert body["temperature"] == 0.0
    assert set(server.auth_headers) == {f"Bearer {API_KEY}"}
    assert "QUESTION: What is it?" in body["messages"][0]["content"]


def test_judge_model_from_env_skips_listing(server, monkeypatch):
    monkeypatch.setenv("JUDGE_MODEL", "pinned")
    assert call(make_judge_reward(RUBRIC), ["SCORE:9"]) == [1.0]
    assert server.model_listings == 0
    assert server.bodies[0]["model"] == "pinned"


def test_model_listing_happens_once_per_reward(server):
    judge = make_judge_reward(RUBRIC)
    call(judge, ["SCORE:9"])
    call(judge, ["SCORE:9"])
    assert server.model_listings == 1


def test_think_block_is_skipped_when_parsing(server):
    scores = call(make_judge_reward(RUBRIC), ["THINK", "THINKCUT", "BARE"])
    assert scores == [1.0, None, 1.0]


def test_unparseable_replies_give_none_without_retry(server):
    scores = call(make_judge_reward(RUBRIC), ["GARBAGE", "OUTOFRANGE", "SCORE:8"])
    assert scores == [None, None, 1.0]
    assert len(server.requests["GARBAGE"]) == 1
    assert len(server.requests["OUTOFRANGE"]) == 1


def test_500_then_success_is_retried_after_backoff(server):
    assert call(make_judge_reward(RUBRIC), ["FAIL500ONCE"]) == [1.0]
    times = server.requests["FAIL500ONCE"]
    assert len(times) == 2
    assert times[1] - times[0] >= FAST_BACKOFF_S[0] * 0.9


def test_persistent_500_retries_twice_with_growing_backoff_then_none(server):
    assert call(make_judge_reward(RUBRIC), ["ALWAYS500"]) == [None]
    times = server.requests["ALWAYS500"]
    assert len(times) == 1 + generative.MAX_RETRIES
    assert times[1] - times[0] >= FAST_BACKOFF_S[0] * 0.9
    assert times[2] - times[1] >= FAST_BACKOFF_S[1] * 0.9


def test_timeout_gives_none_after_retries(server):
    server.slow_s = FAST_TIMEOUT_S * 2
    assert call(make_judge_reward(RUBRIC), ["SLOW"]) == [None]
    assert len(server.requests["SLOW"]) == 3


def test_non_json_body_is_retried_then_none(server):
    assert call(make_judge_reward(RUBRIC), ["NOTJSON"]) == [None]
    assert len(server.requests["NOTJSON"]) == 3


def test_client_error_is_not_retried(server):
    assert call(make_judge_reward(RUBRIC), ["E400"]) == [None]
    assert len(server.requests["E400"]) == 1


def test_mixed_faults_keep_every_sample_in_place(server):
    server.slow_s = FAST_TIMEOUT_S * 2
    completions = ["SCORE:8", "SLOW", "GARBAGE", "FAIL500ONCE", "E400", "SCORE:6", "ALWAYS500", "THINK"]
    scores = call(make_judge_reward(RUBRIC), completions)
    assert scores == [1.0, None, None, 1.0, None, 0.0, None, 1.0]
    assert len(scores) == len(completions)


def test_connection_refused_gives_none_for_every_sample(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("JUDGE_BASE_URL", f"http://127.0.0.1:{port}/v1")
    monkeypatch.setenv("JUDGE_MODEL", "m")
    monkeypatch.setattr(generative, "BACKOFF_S", (0.01, 0.02))
    scores = call(make_judge_reward(RUBRIC), ["SCORE:9", "SCORE:1", "SCORE:7"])
    assert scores == [None, None, None]


def test_model_listing_failure_gives_none(monkeypatch):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("JUDGE_BASE_URL", f"http://127.0.0.1:{port}/v1")
    monkeypatch.delenv("JUDGE_MODEL", raising=False)
    monkeypatch.setattr(generative, "BACKOFF_S", (0.01, 0.02))
    assert call(make_judge_reward(RUBRIC), ["SCORE:9", "SCORE:9"]) == [None, None]


def test_concurrency_is_bounded(server, monkeypatch):
    monkeypatch.setattr(generative, "CONCURRENCY", 3)
    scores = call(make_judge_reward(RUBRIC), ["PAUSE"] * 10)
    assert scores == [1.0] * 10
    assert server.max_in_flight == 3


def test_metrics_through_log_metric_and_log_extra(server):
    metrics: dict[str, float] = {}
    extra: dict[str, list] = {}
    judge = make_judge_reward(RUBRIC, name="j")
    scores = asyncio.run(
        judge(
            prompts=["q"] * 5,
            completions=["SCORE:8", "SCORE:6", "GARBAGE", "E400", "SCORE:10"],
            completion_ids=None,
            trainer_state=None,
            log_metric=lambda name, value: metrics.__setitem__(name, value),
            log_extra=lambda name, values: extra.__setitem__(name, values),
        )
    )
    assert scores == [1.0, 0.0, None, None, 1.0]
    assert metrics["j/request_failure_rate"] == pytest.approx(1 / 5)
    assert metrics["j/parse_failure_rate"] == pytest.approx(1 / 4)
    assert metrics["j/score_mean"] == pytest.approx(8.0)
    assert metrics["j/batch_latency_s"] > 0
    assert extra["j_score"] == [8.0, 6.0, None, None, 10.0]


def test_only_label_rows_and_missing_label_column(server, caplog):
    judge = make_judge_reward(RUBRIC, only_label="chat")
    assert call(judge, ["SCORE:9", "SCORE:9"], label=["chat", "math"]) == [1.0, None]
    with caplog.at_level(logging.WARNING):
        assert call(judge, ["SCORE:9"]) == [None]
        assert call(judge, ["SCORE:9"]) == [None]
    assert sum("only_label" in r.getMessage() for r in caplog.records) == 1
    assert len(server.requests["SCORE:9"]) == 1  # skipped rows never reach the judge


def test_reference_guided_rubric_and_column_fallback(server):
    judge = make_judge_reward(REF_RUBRIC, reference_column="answer")
    assert judge.required_columns() == {"answer"}
    scores = call(
        judge,
        ["SCORE:9", "SCORE:8", "SCORE:7"],
        answer=["ref-A", None, ""],
        solution=["sol-1", "sol-2", ""],
    )
    assert scores == [1.0, 1.0, None]  # the third has no reference anywhere: not scored
    sent = [b["messages"][0]["content"] for b in server.bodies]
    assert any("REFERENCE: ref-A" in s for s in sent)
    assert any("REFERENCE: sol-2" in s for s in sent)
    assert len(server.bodies) == 2


def test_reference_guided_without_reference_columns_is_none(server):
    judge = make_judge_reward("rewards/prompts/reference.md")
    assert call(judge, ["SCORE:9"]) == [None]
    assert server.bodies == []


def test_conversational_prompt_and_completion_are_rendered(server):
    judge = make_judge_reward(RUBRIC)
    prompt = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    completion = [
        {"role": "assistant", "content": "Let me look."},
        {"role": "tool", "content": "lookup result"},
        {"role": "assistant", "content": "Paris SCORE:9"},
    ]
    scores = asyncio.run(judge(prompts=[prompt], completions=[completion]))
    assert scores == [1.0]
    sent = server.bodies[0]["messages"][0]["content"]
    assert "user: Capital of France?" in sent and "system: Be brief." in sent
    assert "lookup result" not in sent


def test_placeholders_are_filled_once_and_braces_survive(server):
    judge = make_judge_reward('Reply as JSON {"score": N}.\nRESPONSE: {completion}')
    assert call(judge, ["SCORE:9 {prompt}"]) == [1.0]
    assert "RESPONSE: SCORE:9 {prompt}" in server.bodies[0]["messages"][0]["content"]
    assert '{"score": N}' in server.bodies[0]["messages"][0]["content"]


def test_pickled_judge_still_works(server):
    judge = make_judge_reward("rewards/prompts/default.md", name="pickled")
    clone = pickle.loads(pickle.dumps(judge))
    assert clone.__name__ == "pickled"
    assert call(clone, ["SCORE:7", "SCORE:3"]) == [1.0, 0.0]


def test_env_is_read_at_call_time(server, monkeypatch):
    monkeypatch.setenv("JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
    judge = make_judge_reward(RUBRIC)  # built while the URL is wrong
    monkeypatch.setenv("JUDGE_BASE_URL", server.base_url)
    assert call(judge, ["SCORE:9"]) == [1.0]


def test_api_key_never_in_logs_or_errors(server, caplog, monkeypatch):
    server.slow_s = FAST_TIMEOUT_S * 2
    judge = make_judge_reward(RUBRIC)
    with caplog.at_level(logging.DEBUG):
        scores = call(judge, ["ECHOKEY", "GARBAGE", "ALWAYS500", "SLOW", "E400", "NOTJSON", "SCORE:9"])
        monkeypatch.setenv("JUDGE_BASE_URL", "http://127.0.0.1:9/v1")
        monkeypatch.setenv("JUDGE_MODEL", "m")
        call(judge, ["SCORE:9"])
    assert scores == [None, None, None, None, None, None, 1.0]
    assert len(server.requests["ECHOKEY"]) == 3
    assert caplog.records, "the failures should have been logged"
    assert API_KEY not in caplog.text
    assert all(API_KEY not in str(r.args) for r in caplog.records)
    assert API_KEY not in repr(judge) and API_KEY not in repr(generative.JudgeConnection.from_env())
    with pytest.raises(generative.JudgeRequestError) as error:
        asyncio.run(_failing_request(server))
    assert API_KEY not in str(error.value)
    assert "***" in str(error.value)


async def _failing_request(server):
    import aiohttp

    connection = generative.JudgeConnection.from_env()
    connection = generative.JudgeConnection(server.base_url, "m", connection.api_key)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as session:
        payload = {"model": "m", "messages": [{"role": "user", "content": "RESPONSE: ECHOKEY"}]}
        await generative._request_with_retries(session, connection, "POST", "/chat/completions", payload)


PARSE_CASES = [
    ("Score: 8", 8.0),
    ("blah\nScore: **7**", 7.0),
    ("score = 6.5", 6.5),
    ("Score: 9/10", 9.0),
    ("Score: 3\nOn reflection, Score: 8", 8.0),
    ("<think>Score: 1</think>Score: 10", 10.0),
    ("<think>Score: 9", None),
    ("All good.\n7", 7.0),
    ("I would give it 7 out of 10 honestly", None),
    ("Score: 12", None),
    ("", None),
    (None, None),
]


@pytest.mark.parametrize(("reply", "expected"), PARSE_CASES)
def test_parse_score(reply, expected):
    assert parse_score(reply) == expected


def test_rubric_errors():
    with pytest.raises(ValueError, match="does not exist"):
        make_judge_reward("rewards/prompts/nope.md")
    with pytest.raises(ValueError, match="no {completion} placeholder"):
        make_judge_reward("Grade this.\nQUESTION: {prompt}")


def test_shipped_rubrics_load_from_anywhere(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not make_judge_reward("rewards/prompts/default.md").reference_guided
    assert make_judge_reward("reference.md").reference_guided
    for rubric in ("default.md", "reference.md"):
        assert "Score: N" in generative.load_rubric(rubric)
