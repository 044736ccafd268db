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
  encoder (:mod:`dna_factory.distill.tokenizer_alignment`).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence

import requests

from dna_factory.distill.tokenizer_alignment import check_tokenizers
from dna_factory.errors import DnaConfigError, DnaServiceError
from dna_factory.serving.services import (
    RETRY_STATUSES,
    bound_session,
    server_root,
    start_line,
    wait_for_health,
)

logger = logging.getLogger(__name__)

POSITION_TOLERANCE = 2e-2
"""Nats. Prefill and decode logprobs of the same token agree to ~1e-6 in fp32 and ~1e-2 in bf16."""

PINNED_SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
"""The probe's sampling settings: the unprocessed distribution, whatever the model's generation_config defaults are."""

NORMALISATION_TOP = 10
"""Top logprobs requested per probe position (vLLM's default ``--max-logprobs`` is 20)."""
NORMALISATION_TOLERANCE = 1e-3
"""Nats. Log-probabilities are <= 0 and the log-sum-exp of any subset of them is <= 0."""


class TeacherScoringError(RuntimeError):
    """The teacher's logprobs do not line up with the student's completion tokens."""


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


def trl_status(exc: Exception) -> tuple[int, str] | None:
    """``(status, text)`` of TRL's client error ``Exception("Request failed: STATUS, TEXT")``, else None."""
    failed = re.fullmatch(r"Request failed: (\d+), (.*)", str(exc), flags=re.S)
    return None if failed is None else (int(failed[1]), failed[2])


class TeacherServer:
    """A vLLM OpenAI-compatible server hosting the teacher.

    Every request is bounded: ``request_timeout_s`` per try (connect and each read), ``retries``
    more tries with ``urllib3`` back-off for connection errors, read timeouts and transient
    statuses (:data:`~dna_factory.serving.services.RETRY_STATUSES`), then one clear error
    (:class:`~dna_factory.errors.DnaServiceError`). A sequence longer than the teacher's
    ``max_model_len`` is a :class:`~dna_factory.errors.DnaConfigError` naming both lengths.

    Args:
        url: the server's address, ``http://host:port`` (``/v1`` optional).
        max_concurrent_requests: most HTTP requests in flight while a batch is scored.
        sequences_per_request: rollouts per HTTP request.
        timeout_s: how long to wait for the server's ``/health`` at start-up.
        request_timeout_s: seconds one try of a request may take.
        retries: tries after the first one.
        backoff_s: back-off factor between tries.
    """

    def __init__(
        self,
        url: str,
        *,
        max_concurrent_requests: int = 8,
        sequences_per_request: int = 1,
        timeout_s: float = 60.0,
        request_timeout_s: float = 300.0,
        retries: int = 3,
        backoff_s: float = 2.0,
    ) -> None:
        from trl.generation.vllm_client import VLLMClient

        self.url = server_root(url, "teacher_server_url")
        self.max_concurrent_requests = max_concurrent_requests
        self.sequences_per_request = sequences_per_request
        self.request_timeout_s = request_timeout_s
        self.tries = retries + 1
        self.max_model_len: int | None = None
        wait_for_health(
            self.url,
            "teacher server",
            timeout_s,
            start_line("teacher", "TEACHER", "PORT"),
            "teacher_server_timeout",
        )
        bounds = (request_timeout_s, retries, backoff_s, max(10, max_concurrent_requests))

        class BoundedClient(VLLMClient):
            """TRL's client whose session is bounded before its first request (``/v1/models`` in ``__init__``).

            ``check_server`` is TRL's /health loop (unbounded ``requests.get``, endless on a non-200 answer);
            :func:`wait_for_health` has done that job with a bound, so here it only mounts the bounded adapter.
            """

            def check_server(self, total_timeout: float = 0.0, retry_interval: float = 2.0) -> None:
                bound_session(self.session, *bounds)

        try:
            self.client = BoundedClient(base_url=self.url, connection_timeout=0.0)
        except requests.RequestException as exc:
            raise self._failed("/v1/models", exc) from None
        except Exception as exc:  # e.g. 401 on /v1/models from a server started with --api-key
            if (failed := trl_status(exc)) is None:
                raise
            raise self._status_error("/v1/models", *failed) from None
        listed = self._get("/v1/models")["data"][0]
        self.model = self.client.model
        self.max_model_len = listed.get("max_model_len")
        logger.info(
            "Teacher server %s serves %r (max_model_len %s); requests time out after %g s, %d tries.",
            self.url,
            self.model,
            self.max_model_len,
            request_timeout_s,
            self.tries,
        )

    def _failed(self, path: str, exc: requests.RequestException) -> DnaServiceError:
        """The error for a request that got no answer on any try."""
        reason = getattr(exc.args[0], "reason", None) if exc.args else None
        timed_out = isinstance(exc, requests.Timeout) or "timed out" in str(reason or exc).lower()
        if timed_out:
            what = f"did not answer {path} within {self.request_timeout_s:g} s on any of {self.tries} tries"
            fix = "Check the server's log and load, or raise teacher_request_timeout"
        else:
            what = f"could not be reached for {path} on any of {self.tries} tries ({type(reason or exc).__name__})"
            fix = "Check that the server is still running (its log) and that teacher_server_url is right"
        return DnaServiceError(f"The teacher server {self.url} {what}. {fix}.")

    def _status_error(self, path: str, status: int, text: str) -> DnaServiceError:
        tries = f" (after {self.tries} tries)" if status in RETRY_STATUSES else ""
        return DnaServiceError(
            f"The teacher server {self.url} answered {path} with HTTP {status}{tries}: {text[:500].strip()}. "
            "Check the server's log."
        )

    def _get(self, path: str) -> dict:
        try:
            response = self.client.session.get(f"{self.url}{path}")
        except requests.RequestException as exc:
            raise self._failed(path, exc) from None
        if response.status_code != 200:
            raise self._status_error(path, response.status_code, response.text)
        return response.json()

    def _post(self, path: str, payload: dict) -> dict:
        try:
            response = self.client.session.post(f"{self.url}{path}", json={"model": self.model, **payload})
        except requests.RequestException as exc:
            raise self._failed(path, exc) from None
        if response.status_code == 404 and path == "/tokenize":
            raise DnaConfigError(
                f"The teacher server {self.url} has no /tokenize endpoint (HTTP 404), which the tokenizer alignment "
                "check needs. Serve the teacher with vLLM's OpenAI-compatible server "
                "(python -m vllm.entrypoints.openai.api_server), which has it."
            )
        if response.status_code != 200:
            raise self._status_error(path, response.status_code, response.text)
        return response.json()

    def _too_long(
        self, prompt_ids, completion_ids, limit: int | None, said: str = ""
    ) -> DnaConfigError | None:
        """The error for the longest sequence when it leaves no room under ``limit``, else None.

        A scoring request asks for one generated token (``max_tokens: 1``), so a sequence fits only
        below ``max_model_len``: at exactly ``max_model_len`` vLLM answers 400 (max_tokens 0). With
        ``limit`` None (not listed by the server) the server's own words ``said`` stand in for it.
        """
        p, c = max(zip(prompt_ids, completion_ids, strict=True), key=lambda pc: len(pc[0]) + len(pc[1]))
        if limit is not None and len(p) + len(c) < limit:
            return None
        stated = (
            f"max_model_len {limit}"
            if limit is not None
            else f"max_model_len (the server said: {said[:200]})"
        )
        return DnaConfigError(
            f"A scoring sequence of {len(p) + len(c)} tokens (prompt {len(p)} + completion {len(c)}) does not fit the "
            f"teacher's {stated} ({self.url}; scoring needs one more position). Restart the teacher with "
            "--max-model-len above the student's longest prompt + max_completion_length, or shorten the prompts or "
            "max_completion_length."
        )

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
        if self.max_model_len and (error := self._too_long(prompt_ids, completion_ids, self.max_model_len)):
            raise error
        sequences = [list(prompt_ids[i]) + list(completion_ids[i]) for i in scored]
        lengths = [len(prompt_ids[i]) for i in scored]
        try:
            answer = self.client.get_sequence_logprobs(
                sequences=sequences,
                prompt_lengths=lengths,
                top_logprobs=0,  # only the scored token itself: the sampled-token estimator needs nothing else
                temperature=1.0,
                chunk_size=self.sequences_per_request,
                max_concurrent_requests=self.max_concurrent_requests,
            )
        except requests.RequestException as exc:
            raise self._failed("/v1/completions", exc) from None
        except Exception as exc:
            if (failed := trl_status(exc)) is None:
                raise
            status, text = failed
            stated = re.search(r"maximum context length is (\d+)", text)
            limit = int(stated[1]) if stated else self.max_model_len
            over = stated or "max_tokens must be at least 1" in text
            if status == 400 and over and (error := self._too_long(prompt_ids, completion_ids, limit, text)):
                raise error from None
            raise self._status_error("/v1/completions", status, text) from None
        for i, actual in zip(scored, answer["actual_logprobs"], strict=True):
            values = [row[0] if row else None for row in actual]
            result[i] = completion_logprobs(values, completion_ids[i], i)
        return result

    # ------------------------------------------------------------------ start-up checks

    def encode(self, text: str) -> list[int]:
        """The teacher's token ids for ``text`` (``/tokenize``, no special tokens added)."""
        return list(self._post("/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"])

    def prompt_logprobs(self, token_ids: Sequence[int], top: int = 0) -> list[dict | None]:
        """The server's raw ``prompt_logprobs`` for ``token_ids`` (one entry per position, ``top`` alternatives)."""
        answer = self._post(
            "/v1/completions", {"prompt": list(token_ids), "max_tokens": 1, "prompt_logprobs": top}
        )
        return answer["choices"][0]["prompt_logprobs"]

    @staticmethod
    def _not_normalised(positions: list[dict | None]) -> str | None:
        """Why the listed values cannot be log-probabilities (a value > 0, or a log-sum-exp > 0), else None."""
        for index, entry in enumerate(positions):
            values = [float(item["logprob"]) for item in (entry or {}).values()]
            values = [v for v in values if math.isfinite(v)]
            if not values:
                continue
            peak = max(values)
            total = peak + math.log(sum(math.exp(v - peak) for v in values))
            if peak > NORMALISATION_TOLERANCE or total > NORMALISATION_TOLERANCE:
                return (
                    f"returned values that are not log-probabilities at position {index} (largest {peak:.4f}, "
                    f"log-sum-exp of the {len(values)} listed {total:.4f}; log-probabilities are <= 0 and sum to at "
                    "most 1): logits, as vLLM's --logprobs-mode raw_logits or processed_logits return"
                )
        return None

    def check_position_convention(self, prefix: Sequence[int]) -> None:
        """Verify "position i holds log p(x_i | x_<i)" on ``[a, b, c]`` built from the first two ids of ``prefix``.

        Raises:
            DnaConfigError: naming the convention the server uses instead.
        """
        a, b = int(prefix[0]), int(prefix[1])
        # Sampling pinned to the unprocessed distribution: with --logprobs-mode processed_logprobs the sampled
        # token's logprob is taken after top-k/top-p, and a model's generation_config defaults would apply.
        sampled = self._post(
            "/v1/completions",
            {"prompt": [a, b], "max_tokens": 1, "seed": 0, "logprobs": 0, "return_tokens_as_token_ids": True,
             **PINNED_SAMPLING},
        )["choices"][0]["logprobs"]  # fmt: skip
        c = int(sampled["tokens"][0].removeprefix("token_id:"))
        expected = float(sampled["token_logprobs"][0])
        positions = self.prompt_logprobs([a, b, c], top=NORMALISATION_TOP)

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
        elif (unnormalised := self._not_normalised(positions)) is not None:
            raise DnaConfigError(
                f"The teacher server {self.url}, scoring the known sequence [{a}, {b}, {c}], {unnormalised}. "
                "Sampled-token distillation needs log-probabilities: restart the teacher with the default "
                "--logprobs-mode raw_logprobs (or processed_logprobs)."
            )
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
        check_tokenizers(student_tokenizer, self.encode, f"server {self.url}")
        probe = student_tokenizer.encode("The answer is 4.", add_special_tokens=False)
        self.check_position_convention(probe)
