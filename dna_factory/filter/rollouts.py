"""K sampled completions per prompt, for the learnability filter: from a server or a local model.

Two backends with one coroutine, ``generate(prompt, index) -> Rollouts``:

- :class:`ServerRollouts` asks an OpenAI-compatible server (vLLM, or any other): a conversation
  goes to ``POST /chat/completions``, a plain-string prompt (``prompt_format: text``) to ``POST
  /completions`` (no chat template, as TRL treats string prompts), each with ``n=K``; a server that returns fewer
  choices than asked is asked again for the rest. Requests run concurrently through one
  aiohttp session, at most ``concurrency`` in flight.
- :class:`LocalRollouts` runs ``transformers`` ``generate(num_return_sequences=K)`` on a local
  model, one prompt at a time in a worker thread (so the event loop keeps scoring).

Completions have TRL's shape: ``[{"role": "assistant", "content": text}]`` for a conversational
prompt, the text for a string prompt. With ``seed`` set, prompt ``index`` samples with seed
``seed + index``, so a resumed run draws what a single run would have drawn (where the server
honours per-request seeds).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from rewards.json_http import RequestFailed, request_json, waits

logger = logging.getLogger(__name__)

MAX_RETRIES = 3
"""Retries of a request after a timeout, a connection error, HTTP 408/409/425/429 or 5xx."""
BACKOFF_S = (1.0, 2.0, 4.0)
"""Seconds to wait before retry 1, 2 and 3."""


class RolloutError(RuntimeError):
    """Generation failed for good (after the retries); the message says where and why."""


@dataclass(frozen=True)
class SamplingParams:
    """How the K rollouts of a prompt are drawn.

    Attributes:
        n: Completions per prompt (K, the recipe's ``num_generations``).
        temperature: Sampling temperature (> 0: greedy decoding makes the K samples identical).
        top_p: Nucleus sampling mass in (0, 1].
        max_tokens: Most generated tokens per completion.
        seed: Base seed; prompt ``index`` uses ``seed + index``. None leaves sampling unseeded.
        chat_template_kwargs: Extra chat-template variables, e.g. ``{"enable_thinking": False}``.
    """

    n: int
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 512
    seed: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def seed_for(self, index: int) -> int | None:
        return None if self.seed is None else self.seed + index


@dataclass
class Rollouts:
    """The K completions of one prompt, and their token ids when the backend has them."""

    completions: list[Any]
    completion_ids: list[list[int]] | None = None


def _is_conversation(prompt: Any) -> bool:
    return isinstance(prompt, list)


def _as_completion(prompt: Any, text: str) -> Any:
    return [{"role": "assistant", "content": text}] if _is_conversation(prompt) else text


class ServerRollouts:
    """Rollouts from an OpenAI-compatible server.

    Args:
        base_url: ``http://HOST:PORT/v1``.
        model: The served model name; None asks ``GET /models`` and takes the first.
        sampling: How to sample.
        api_key: Sent as ``Authorization: Bearer``; never logged.
        concurrency: Requests in flight at once.
        timeout_s: Total seconds for one request (K completions of one prompt).
    """

    def __init__(
        self,
        base_url: str,
        model: str | None,
        sampling: SamplingParams,
        api_key: str = "EMPTY",
        concurrency: int = 16,
        timeout_s: float = 600.0,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.sampling = sampling
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self._api_key = api_key
        self._session: aiohttp.ClientSession | None = None
        self._semaphore: asyncio.Semaphore | None = None

    async def __aenter__(self) -> ServerRollouts:
        headers = {"Authorization": f"Bearer {self._api_key}"}
        connector = aiohttp.TCPConnector(limit=self.concurrency)
        self._session = aiohttp.ClientSession(headers=headers, connector=connector)
        self._semaphore = asyncio.Semaphore(self.concurrency)
        try:
            await self._check_server()
        except BaseException:  # __aexit__ does not run when __aenter__ raises
            await self._session.close()
            raise
        return self

    async def _check_server(self) -> None:
        """The served model (or the first listed) and a server that is not paused."""
        listing = await self._request("GET", "/models", None)
        served = [str(entry.get("id")) for entry in listing.get("data", []) if isinstance(entry, dict)]
        if self.model is None:
            if not served:
                raise RolloutError(f"GET {self.base_url}/models lists no model. Set `model:` in the recipe.")
            self.model = served[0]
            logger.info("Generating with %r, the first model %s lists.", self.model, self.base_url)
        elif served and self.model not in served:
            raise RolloutError(
                f"The server at {self.base_url} does not serve {self.model!r} (it serves: {', '.join(served)}). "
                "Set `model:` to one of those names."
            )
        await self._refuse_a_paused_server()

    async def _refuse_a_paused_server(self) -> None:
        """A paused vLLM server (dev mode's ``/pause``, left so by a trainer stopped mid weight sync) holds every
        request without an answer: one error now, not ``timeout_s`` per try. Servers without ``/is_paused``
        (no dev mode, other vendors) are not asked twice."""
        assert self._session is not None
        root = self.base_url.removesuffix("/v1")
        try:
            timeout = aiohttp.ClientTimeout(total=min(self.timeout_s, 30.0))
            async with self._session.get(f"{root}/is_paused", timeout=timeout) as response:
                answer = await response.json(content_type=None) if response.status == 200 else None
        except (TimeoutError, aiohttp.ClientError, ValueError):
            return
        if isinstance(answer, dict) and answer.get("is_paused") is True:
            raise RolloutError(
                f"The server at {root} is paused (a trainer stopped during a weight sync leaves it so), and every "
                f"request would wait without an answer. Resume it (POST {root}/resume, e.g. "
                f"`curl -X POST {root}/resume`) and rerun."
            )

    async def __aexit__(self, *exc: Any) -> None:
        if self._session is not None:
            await self._session.close()

    async def generate(self, prompt: Any, index: int) -> Rollouts:
        """K completions of ``prompt`` (row ``index`` of the mixture, for its seed)."""
        sampling = self.sampling
        texts: list[str] = []
        for _ in range(sampling.n):  # a server ignoring `n` is asked again, at most K times in all
            payload: dict[str, Any] = {
                "model": self.model,
                "n": sampling.n - len(texts),
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "max_tokens": sampling.max_tokens,
            }
            seed = sampling.seed_for(index)
            if seed is not None:
                payload["seed"] = seed + len(texts)
            if _is_conversation(prompt):
                payload["messages"] = prompt
                if sampling.chat_template_kwargs:
                    payload["chat_template_kwargs"] = sampling.chat_template_kwargs
                body = await self._request("POST", "/chat/completions", payload)
                texts += [_choice_text(choice, chat=True) for choice in body.get("choices", [])]
            else:
                payload["prompt"] = prompt
                body = await self._request("POST", "/completions", payload)
                texts += [_choice_text(choice, chat=False) for choice in body.get("choices", [])]
            if len(texts) >= sampling.n:
                break
        if len(texts) < sampling.n:
            raise RolloutError(
                f"{self.base_url} returned {len(texts)} of {sampling.n} completions for row {index}. "
                "Check that the server supports sampling several completions."
            )
        return Rollouts([_as_completion(prompt, text) for text in texts[: sampling.n]])

    async def _request(self, method: str, path: str, payload: dict[str, Any] | None) -> dict[str, Any]:
        """One JSON request with retries (:func:`rewards.json_http.request_json`); raises RolloutError (API key
        redacted) when it fails for good."""
        assert self._session is not None and self._semaphore is not None, "use `async with`"
        url = f"{self.base_url}{path}"
        async with self._semaphore:
            try:
                body = await request_json(
                    self._session,
                    method,
                    url,
                    payload,
                    timeout_s=self.timeout_s,
                    retry_waits_s=waits(MAX_RETRIES, BACKOFF_S),
                    secret=self._api_key if self._api_key != "EMPTY" else None,
                )
            except RequestFailed as exc:
                raise RolloutError(str(exc)) from None
        if not isinstance(body, dict):
            raise RolloutError(
                f"{method} {url} answered JSON that is not an object: {json.dumps(body)[:200]}"
            )
        return body


def _choice_text(choice: Any, chat: bool) -> str:
    if not isinstance(choice, dict):
        return ""
    if chat:
        content = (choice.get("message") or {}).get("content")
        return content if isinstance(content, str) else ""
    text = choice.get("text")
    return text if isinstance(text, str) else ""


class LocalRollouts:
    """Rollouts from a local Hugging Face model with ``generate(num_return_sequences=K)``.

    The model loads in :meth:`__aenter__` (``float32`` on CPU, the checkpoint's dtype on GPU).
    ``completion_ids`` are the generated ids up to and including the first EOS, as TRL passes
    them to rewards.

    Args:
        model_path: A model directory or hub id.
        sampling: How to sample.
    """

    def __init__(self, model_path: str, sampling: SamplingParams) -> None:
        self.model_path = model_path
        self.sampling = sampling
        self._model: Any = None
        self._tokenizer: Any = None
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> LocalRollouts:
        await asyncio.to_thread(self._load)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self._model = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        device = "cuda" if torch.cuda.is_available() else "cpu"
        dtype = "auto" if device == "cuda" else torch.float32
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self._model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=dtype).to(device).eval()
        logger.info("Loaded %s on %s for local rollouts.", self.model_path, device)

    async def generate(self, prompt: Any, index: int) -> Rollouts:
        """K completions of ``prompt``; one prompt at a time, off the event loop."""
        async with self._lock:
            return await asyncio.to_thread(self._generate, prompt, index)

    def _generate(self, prompt: Any, index: int) -> Rollouts:
        import torch

        tokenizer, model, sampling = self._tokenizer, self._model, self.sampling
        if _is_conversation(prompt):
            text = tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True, **(sampling.chat_template_kwargs or {})
            )
            inputs = tokenizer(text, return_tensors="pt", add_special_tokens=False)
        else:
            inputs = tokenizer(prompt, return_tensors="pt")
        inputs = inputs.to(model.device)
        seed = sampling.seed_for(index)
        if seed is not None:
            torch.manual_seed(seed)
        eos = tokenizer.eos_token_id
        with torch.no_grad():
            output = model.generate(
                **inputs,
                do_sample=True,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_new_tokens=sampling.max_tokens,
                num_return_sequences=sampling.n,
                pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos,
            )
        generated = output[:, inputs["input_ids"].shape[1] :].tolist()
        eos_ids = set(eos) if isinstance(eos, list) else {eos}
        completion_ids = []
        for ids in generated:
            end = next((j + 1 for j, token in enumerate(ids) if token in eos_ids), len(ids))
            completion_ids.append(ids[:end])
        texts = tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return Rollouts([_as_completion(prompt, text) for text in texts], completion_ids)
