"""A fault-injecting teacher server for the distillation tests: real HTTP (aiohttp), vLLM's API.

Logprob of token ``t`` at any position: ``−0.1·(t mod 13 + 1)``, so the known-sequence probe is
self-consistent; ``/tokenize`` uses the student's own tokenizer. ``mode`` injects one fault:

* ``next_token``: position ``i`` holds the logprob of token ``i + 1`` (the other convention);
* ``short``: one logprob too few; ``none_inside``: a None inside the completion;
* ``stall``: scoring requests never answer in time (``delay_s``), counted in ``scoring_requests``;
* ``flaky``: the first ``failures`` scoring requests answer HTTP 503, then honest answers;
* ``no_tokenize``: ``/tokenize`` answers 404, as a server that is not vLLM's;
* ``unnormalised``: every reported value is a logit (logprob + 4, positive), consistently in the
  sample and the prompt logprobs, as ``--logprobs-mode raw_logits`` gives.

Sequences of ``max_model_len`` tokens or more (listed in ``/v1/models`` as vLLM does, unless
``advertise_max_model_len`` is false) get vLLM's HTTP 400 (no room for the one generated token).
Mode ``unauthorised`` answers ``/v1/models`` with 401, as a server started with ``--api-key``.
"""

from __future__ import annotations

import asyncio
import threading

from dna_factory.serving.vllm_server import free_port


class FaultyTeacher:
    """A real aiohttp server speaking vLLM's API with one injected fault (see the module docstring)."""

    def __init__(
        self,
        tokenizer,
        mode: str = "honest",
        delay_s: float = 0.0,
        failures: int = 0,
        max_model_len: int = 512,
        advertise_max_model_len: bool = True,
    ) -> None:
        self.tokenizer, self.mode, self.delay_s = tokenizer, mode, delay_s
        self.failures, self.max_model_len = failures, max_model_len
        self.advertise_max_model_len = advertise_max_model_len
        self.in_flight = self.max_in_flight = self.scoring_requests = 0
        self.probe_bodies: list[dict] = []
        self.loop = asyncio.new_event_loop()
        self.port = 0

    @staticmethod
    def logprob(token: int) -> float:
        return -0.1 * (token % 13 + 1)

    def value(self, token: int) -> float:
        """What the server reports for ``token``: its logprob, or a logit (logprob + 4) when unnormalised."""
        return self.logprob(token) + (4.0 if self.mode == "unnormalised" else 0.0)

    def _positions(self, ids: list[int]) -> list[dict | None]:
        entries = [{str(t): {"logprob": self.value(t), "rank": 1}} for t in ids]
        if self.mode == "next_token":
            return entries[1:] + [None]
        positions = [None] + entries[1:]
        if self.mode == "short":
            return positions[:-1]
        if self.mode == "none_inside":
            positions[-2] = None
        return positions

    async def _completions(self, request):
        from aiohttp import web

        body = await request.json()
        if body.get("logprobs") is not None:  # the position-convention probe samples token 7
            self.probe_bodies.append(body)
            choice = {"logprobs": {"tokens": ["token_id:7"], "token_logprobs": [self.value(7)]}}
            return web.json_response({"choices": [choice]})
        prompts = body["prompt"] if isinstance(body["prompt"][0], list) else [body["prompt"]]
        if body.get("prompt_logprobs") not in (None, 0) and len(prompts) == 1 and len(prompts[0]) == 3:
            self.probe_bodies.append(body)
        self.scoring_requests += 1
        longest = max(len(p) for p in prompts)
        if (
            longest >= self.max_model_len
        ):  # vLLM 0.32's two answers: over the limit, or no room for max_tokens 1
            message = (
                f"This model's maximum context length is {self.max_model_len} tokens. However, your prompt "
                f"contains {longest} input tokens, which exceeds this limit even without any output tokens. "
                "Please reduce the length of the input prompt."
                if longest > self.max_model_len
                else "max_tokens must be at least 1, got 0."
            )
            return web.json_response({"error": {"message": message, "code": 400}}, status=400)
        if self.mode == "flaky" and self.scoring_requests <= self.failures:
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            return web.json_response({"choices": [{"prompt_logprobs": self._positions(p)} for p in prompts]})
        finally:
            self.in_flight -= 1

    async def _tokenize(self, request):
        from aiohttp import web

        if self.mode == "no_tokenize":
            return web.json_response({"detail": "Not Found"}, status=404)
        body = await request.json()
        return web.json_response({"tokens": self.tokenizer.encode(body["prompt"], add_special_tokens=False)})

    def __enter__(self):
        from aiohttp import web

        app = web.Application()

        async def health(request):
            return web.Response(text="ok")

        async def models(request):
            if self.mode == "unauthorised":
                return web.json_response({"error": "Unauthorized"}, status=401)
            entry = {"id": "faulty-teacher"}
            if self.advertise_max_model_len:
                entry["max_model_len"] = self.max_model_len
            return web.json_response({"data": [entry]})

        app.router.add_get("/health", health)
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/tokenize", self._tokenize)
        self.runner = web.AppRunner(app)
        started = threading.Event()
        self.port = free_port()

        async def serve():
            await self.runner.setup()
            await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
            started.set()

        self.thread = threading.Thread(
            target=lambda: (self.loop.run_until_complete(serve()), self.loop.run_forever()), daemon=True
        )
        self.thread.start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"
