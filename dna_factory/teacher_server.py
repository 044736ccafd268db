"""The teacher behind a vLLM OpenAI-compatible server: it scores the student's token ids (S-OPD-3, S-OPD-4).

The teacher never generates and never sees text. For each student rollout the request is
``prompt_ids + completion_ids`` (the prompt rendered once by the *student's* tokenizer)
sent to ``/v1/completions`` with ``prompt_logprobs``; the answer holds, for every position
``i``, ``log π_teacher(x_i | x_<i)`` in nats (position 0 has no context and is None). The
completion part ``[len(prompt_ids), len(prompt_ids) + len(completion_ids))`` is cut out and
checked: a length mismatch or a None/NaN/−inf inside it is an error, never a silent zero.

Requests go through TRL's :class:`~trl.generation.vllm_client.VLLMClient`
(``get_sequence_logprobs``): ``sequences_per_request`` rollouts per HTTP request, at most
``max_concurrent_requests`` requests in flight, so a batch is scored concurrently and the
server can batch the prefills. Setting both to 1 scores one completion at a time
(``bench/distill.py`` measures the difference).

Start-up checks (:meth:`TeacherServer.check_alignment`):

* the position convention, on a known short sequence ``[a, b, c]``: the server samples ``c``
  after ``[a, b]`` and reports ``log p(c | a, b)``; scoring ``[a, b, c]`` must put that value
  at position 2 and None at position 0 ("logprob of the current token"). A server that
  reports the next token's logprob at each position would shift every d_t by one token;
* tokenizer compatibility, with the teacher's ``/tokenize`` endpoint as the teacher's
  encoder (:mod:`dna_factory.tokenizer_alignment`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from urllib.parse import urlparse

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

POSITION_TOLERANCE = 2e-2
"""Nats. Prefill and decode logprobs of the same token agree to ~1e-6 in fp32 and ~1e-2 in bf16."""


class TeacherScoringError(RuntimeError):
    """The teacher's logprobs do not line up with the student's completion tokens."""


def server_root(url: str) -> str:
    """``http://host:port`` from a URL given with or without the OpenAI ``/v1`` suffix."""
    parsed = urlparse(url.rstrip("/"))
    if not parsed.scheme or not parsed.netloc:
        raise DnaConfigError(
            f"teacher_server_url {url!r} is not an http(s) URL. Use the server's address, e.g. "
            "http://127.0.0.1:8000 (with or without /v1)."
        )
    path = parsed.path[: -len("/v1")] if parsed.path.endswith("/v1") else parsed.path
    return f"{parsed.scheme}://{parsed.netloc}{path}"


def completion_logprobs(
    teacher_logprobs: Sequence[float | None], completion_ids: Sequence[int], index: int
) -> list[float]:
    """Check the teacher's logprobs of one completion and return them as floats (nats).

    Args:
        teacher_logprobs: ``log π_teacher(y_t | x, y_<t)`` for each completion token, as the server returned them.
        completion_ids: the student's completion tokens ``y_1..y_T``.
        index: the rollout's index in the batch (for the error message).

    Raises:
        TeacherScoringError: on a length mismatch or a None/NaN/±inf value inside the completion part.
    """
    if len(teacher_logprobs) != len(completion_ids):
        raise TeacherScoringError(
            f"The teacher returned {len(teacher_logprobs)} logprobs for completion {index} of "
            f"{len(completion_ids)} tokens. Teacher and student must score the same tokens: check that the server "
            "serves the teacher with the student's vocabulary and that max-model-len fits prompt + completion."
        )
    values = []
    for t, (value, token) in enumerate(zip(teacher_logprobs, completion_ids, strict=True)):
        if value is None or not math.isfinite(value):
            raise TeacherScoringError(
                f"The teacher's logprob of completion {index}, token {t} (id {token}) is {value!r} (None, NaN or "
                "infinite). Every completion token needs a finite teacher logprob; check the server's logs and "
                "that the token id exists in the teacher's vocabulary."
            )
        values.append(float(value))
    return values


class TeacherServer:
    """A vLLM OpenAI-compatible server hosting the teacher.

    Args:
        url: the server's address, ``http://host:port`` (``/v1`` optional).
        max_concurrent_requests: most HTTP requests in flight while a batch is scored.
        sequences_per_request: rollouts per HTTP request.
        timeout_s: how long to wait for the server's ``/health`` at start-up.
    """

    def __init__(
        self,
        url: str,
        *,
        max_concurrent_requests: int = 8,
        sequences_per_request: int = 1,
        timeout_s: float = 60.0,
    ) -> None:
        from trl.generation.vllm_client import VLLMClient

        self.url = server_root(url)
        self.max_concurrent_requests = max_concurrent_requests
        self.sequences_per_request = sequences_per_request
        try:
            self.client = VLLMClient(base_url=self.url, connection_timeout=timeout_s)
        except ConnectionError as exc:
            raise DnaConfigError(
                f"The teacher server at {self.url} did not answer /health within {timeout_s:g} s ({exc}). Start it "
                "first (python -m vllm.entrypoints.openai.api_server --model TEACHER --port PORT) or fix "
                "teacher_server_url."
            ) from None
        self.model = self.client.model
        logger.info("Teacher server %s serves %r.", self.url, self.model)

    def _post(self, path: str, payload: dict) -> dict:
        response = self.client.session.post(
            f"{self.url}{path}", json={"model": self.model, **payload}, timeout=120
        )
        if response.status_code != 200:
            raise TeacherScoringError(
                f"The teacher server answered {path} with HTTP {response.status_code}: {response.text[:500]}"
            )
        return response.json()

    # ------------------------------------------------------------------ scoring

    def score(
        self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]
    ) -> list[list[float]]:
        """``log π_teacher(y_t | x, y_<t)`` in nats for every completion token of every rollout.

        Args:
            prompt_ids: per rollout, the prompt as rendered by the student's tokenizer (no padding).
            completion_ids: per rollout, the student's sampled tokens (no padding; may be empty).

        Returns:
            Per rollout, one float per completion token.
        """
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts for {len(completion_ids)} completions")
        scored = [i for i, c in enumerate(completion_ids) if len(c) > 0]
        result: list[list[float]] = [[] for _ in completion_ids]
        if not scored:
            return result
        sequences = [list(prompt_ids[i]) + list(completion_ids[i]) for i in scored]
        lengths = [len(prompt_ids[i]) for i in scored]
        answer = self.client.get_sequence_logprobs(
            sequences=sequences,
            prompt_lengths=lengths,
            top_logprobs=0,  # only the scored token itself: the sampled-token estimator needs nothing else
            temperature=1.0,
            chunk_size=self.sequences_per_request,
            max_concurrent_requests=self.max_concurrent_requests,
        )
        for i, actual in zip(scored, answer["actual_logprobs"], strict=True):
            values = [row[0] if row else None for row in actual]
            result[i] = completion_logprobs(values, completion_ids[i], i)
        return result

    # ------------------------------------------------------------------ start-up checks

    def encode(self, text: str) -> list[int]:
        """The teacher's token ids for ``text`` (``/tokenize``, no special tokens added)."""
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[dict | None]:
        """The server's raw ``prompt_logprobs`` for ``token_ids`` (one entry per position)."""
        answer = self._post(
            "/v1/completions", {"prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": 0}
        )
        return answer["choices"][0]["prompt_logprobs"]

    def check_position_convention(self, prefix: Sequence[int]) -> None:
        """Verify "position i holds log p(x_i | x_<i)" on ``[a, b, c]`` built from the first two ids of ``prefix``.

        Raises:
            DnaConfigError: naming the convention the server uses instead.
        """
        a, b = int(prefix[0]), int(prefix[1])
        sampled = self._post(
            "/v1/completions",
            {"prompt": [a, b], "max_tokens": 1, "temperature": 1.0, "seed": 0, "logprobs": 0,
             "return_tokens_as_token_ids": True},
        )["choices"][0]["logprobs"]  # fmt: skip
        c = int(sampled["tokens"][0].removeprefix("token_id:"))
        expected = float(sampled["token_logprobs"][0])
        positions = self.prompt_logprobs([a, b, c])

        def at(position: int, token: int) -> float | None:
            entry = positions[position] if position < len(positions) else None
            item = (entry or {}).get(str(token))
            return None if item is None else float(item["logprob"])

        problem = None
        if len(positions) != 3:
            problem = f"returned {len(positions)} prompt logprobs for 3 tokens"
        elif positions[0] is not None:
            problem = "returned a logprob at position 0, which has no context (the next-token convention)"
        elif at(2, c) is None or at(1, b) is None:
            problem = "does not list each position's own token (the next-token convention)"
        elif abs(at(2, c) - expected) > POSITION_TOLERANCE:
            problem = f"puts {at(2, c):.6f} at position 2, but sampling gave log p(c | a, b) = {expected:.6f}"
        if problem is not None:
            raise DnaConfigError(
                f"The teacher server {self.url}, scoring the known sequence [{a}, {b}, {c}], {problem}. dna-factory "
                "needs position i to hold log p(x_i | x_<i) (None at position 0), as vLLM's prompt_logprobs do. "
                "Serve the teacher with vLLM's OpenAI-compatible server."
            )
        logger.info(
            "Teacher position convention verified on [%d, %d, %d]: log p(c | a, b) = %.6f at position 2.",
            a,
            b,
            c,
            expected,
        )

    def check_alignment(self, student_tokenizer) -> None:
        """Position convention and tokenizer compatibility, before the student model is loaded."""
        from dna_factory.tokenizer_alignment import check_tokenizers

        check_tokenizers(student_tokenizer, self.encode, f"server {self.url}")
        probe = student_tokenizer.encode("The answer is 4.", add_special_tokens=False)
        self.check_position_convention(probe)
