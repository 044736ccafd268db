"""LLM-as-judge reward: an async reward that asks an OpenAI-compatible server (S-JUDGE).

Each completion is rendered into a rubric, sent to ``POST {JUDGE_BASE_URL}/chat/completions``,
and the judge's 0-10 score is binarised: ``score >= THRESHOLD`` gives 1.0, else 0.0. Any
failure (timeout, connection error, HTTP error after the retries, a reply without a score)
gives None for that sample, never 0.0, and no sample is ever dropped from the returned list.

Only the connection is configurable, through environment variables read each time the reward
runs (never at import):

================== ============================ ===========================================
variable           default                      meaning
================== ============================ ===========================================
``JUDGE_BASE_URL`` ``http://localhost:8001/v1`` the server's OpenAI-compatible base URL
``JUDGE_MODEL``    first model of ``GET /models`` the model name sent with each request
``JUDGE_API_KEY``  ``EMPTY``                    sent as ``Authorization: Bearer <key>``;
                                                never logged nor put in an error message
================== ============================ ===========================================

Everything else is a fixed module constant: :data:`CONCURRENCY`, :data:`TIMEOUT_S`,
:data:`MAX_RETRIES` with :data:`BACKOFF_S`, :data:`MAX_TOKENS`, :data:`THRESHOLD`,
:data:`DEFAULT_REFERENCE_COLUMN`.

A rubric is a file (e.g. ``rewards/prompts/default.md``) or the rubric text itself, with the
placeholders ``{prompt}``, ``{completion}`` and, for a reference-guided rubric, ``{reference}``
(read from ``kwargs[reference_column]``, falling back to ``kwargs["solution"]``). The judge must
end its reply with a line ``Score: N``; see :func:`parse_score`.

Example (needs a judge server, e.g. ``vllm serve <model> --port 8001``):
    >>> import asyncio
    >>> judge = make_judge_reward("rewards/prompts/default.md")
    >>> asyncio.run(judge(prompts=["What is 2+2?"], completions=["4"]))  # doctest: +SKIP
    [1.0]
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from rewards.interface import Reward, column, completion_text, prompt_text
from rewards.json_http import RequestFailed, request_json, waits

logger = logging.getLogger(__name__)

CONCURRENCY = 16
"""Judge requests in flight at once, per reward call."""
TIMEOUT_S = 120.0
"""Total time allowed for one HTTP request, in seconds."""
MAX_RETRIES = 2
"""Retries after the first attempt of a request that failed in a way worth retrying."""
BACKOFF_S = (1.0, 2.0)
"""Seconds to wait before retry 1 and retry 2 (exponential: 1 s, then 2 s)."""
MAX_TOKENS = 2048
"""At most this many generated tokens per judgement, the judge's own thinking included."""
THRESHOLD = 7
"""A raw score at or above this (on 0-10) gives reward 1.0, below it 0.0."""
DEFAULT_REFERENCE_COLUMN = "solution"
"""The column a reference-guided rubric reads when no other is named."""

DEFAULT_BASE_URL = "http://localhost:8001/v1"
DEFAULT_API_KEY = "EMPTY"
PROMPTS_DIR = Path(__file__).parent / "prompts"

# Statuses where the same request may succeed later: timeouts, rate limits, server errors.
_PLACEHOLDER = re.compile(r"\{(prompt|completion|reference)\}")
_SCORE_LINE = re.compile(r"score\s*[:=]\s*\**\s*(-?\d+(?:\.\d+)?)\s*\**\s*(?:/\s*10)?", re.IGNORECASE)
_BARE_SCORE = re.compile(r"^\**\s*(-?\d+(?:\.\d+)?)\s*\**\s*(?:/\s*10)?\s*\.?$")


@dataclass(frozen=True)
class JudgeConnection:
    """Where the judge is and how to reach it, read from the environment (S-JUDGE-1)."""

    base_url: str
    model: str | None
    api_key: str = field(repr=False)

    @classmethod
    def from_env(cls) -> JudgeConnection:
        """The connection as the environment says now.

        Example:
            >>> JudgeConnection.from_env().base_url  # with JUDGE_BASE_URL unset
            'http://localhost:8001/v1'
        """
        return cls(
            base_url=(os.environ.get("JUDGE_BASE_URL") or DEFAULT_BASE_URL).rstrip("/"),
            model=os.environ.get("JUDGE_MODEL") or None,
            api_key=os.environ.get("JUDGE_API_KEY") or DEFAULT_API_KEY,
        )

    def redact(self, text: str) -> str:
        """``text`` with every occurrence of the API key replaced by ``***``."""
        if self.api_key and self.api_key != DEFAULT_API_KEY:
            return text.replace(self.api_key, "***")
        return text


class JudgeRequestError(Exception):
    """One judge request failed for good; its message never contains the API key."""


def load_rubric(rubric: str) -> str:
    """The rubric text for ``rubric``: a file path, a file in ``rewards/prompts/``, or the text.

    A value with a line break or a ``{completion}`` placeholder is the rubric text itself.
    Otherwise it names a file, looked up as given (relative to the working directory), then
    inside the packaged ``rewards/prompts/`` folder (so ``default.md`` and
    ``rewards/prompts/default.md`` work from anywhere).

    Args:
        rubric: A path or the rubric text.

    Returns:
        The rubric text, which contains ``{completion}``.

    Raises:
        ValueError: When the named file does not exist or the rubric has no ``{completion}``.

    Example:
        >>> "{completion}" in load_rubric("rewards/prompts/default.md")
        True
    """
    if "\n" in rubric or "{completion}" in rubric:
        text = rubric
    else:
        candidates = [Path(rubric).expanduser(), PROMPTS_DIR / rubric]
        if rubric.startswith("rewards/prompts/"):
            candidates.append(PROMPTS_DIR / rubric.removeprefix("rewards/prompts/"))
        path = next((p for p in candidates if p.is_file()), None)
        if path is None:
            raise ValueError(
                f"Judge rubric file {rubric!r} does not exist (looked in the working directory and in "
                f"{PROMPTS_DIR}). Give the path of a rubric file, or the rubric text itself with a "
                "{completion} placeholder."
            )
        text = path.read_text(encoding="utf-8")
    if "{completion}" not in text:
        raise ValueError(
            f"Judge rubric {rubric[:80]!r} has no {{completion}} placeholder, so the judge would never see "
            "the answer. Add {completion} (and {prompt}, optionally {reference}) to the rubric."
        )
    return text


def render_rubric(rubric: str, prompt: str, completion: str, reference: str | None = None) -> str:
    """The rubric with its placeholders filled in one pass (text inside answers is not re-scanned).

    Example:
        >>> render_rubric("Q: {prompt} A: {completion} {json: 1}", "2+2?", "{reference}")
        'Q: 2+2? A: {reference} {json: 1}'
    """
    values = {"prompt": prompt, "completion": completion, "reference": reference or ""}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], rubric)


def parse_score(reply: str | None) -> float | None:
    """The judge's raw 0-10 score in ``reply``, or None when there is none.

    Only the text after the last ``</think>`` counts (a reply that opens ``<think>`` and never
    closes it was cut off while thinking and has no score). The last ``Score: N`` in that text
    wins (``Score: **8**``, ``score = 7.5`` and ``Score: 8/10`` are accepted); failing that, a
    last line that is only a number. A value outside 0-10 is no score.

    Example:
        >>> parse_score("<think>Score: 2? no.</think>Fine answer.\\nScore: 8")
        8.0
        >>> parse_score("looks fine") is None
        True
    """
    if not reply:
        return None
    head, sep, visible = reply.rpartition("</think>")
    if not sep and "<think>" in reply:
        return None
    matches = _SCORE_LINE.findall(visible)
    if matches:
        value = float(matches[-1])
    else:
        lines = [line.strip() for line in visible.strip().splitlines() if line.strip()]
        bare = _BARE_SCORE.match(lines[-1]) if lines else None
        if bare is None:
            return None
        value = float(bare.group(1))
    return value if 0.0 <= value <= 10.0 else None


def _describe(exc: BaseException) -> str:
    text = str(exc) or "no detail"
    return f"{type(exc).__name__}: {text[:200]}"


@dataclass
class _Verdict:
    reward: float | None = None
    raw: float | None = None
    request_error: str | None = None
    unparseable_reply: str | None = None


@dataclass(eq=False, kw_only=True)
class JudgeReward(Reward):
    """A picklable async LLM-judge reward; build it with :func:`make_judge_reward`."""

    rubric_text: str = field(repr=False)
    reference_column: str | None = None
    _models: dict[str, str] = field(default_factory=dict, init=False, repr=False)  # base URL -> first model

    @property
    def reference_guided(self) -> bool:
        """Whether the rubric has a ``{reference}`` placeholder."""
        return "{reference}" in self.rubric_text

    def required_columns(self) -> set[str]:
        """Dataset columns this reward reads (for the recipe dry-run): the reference column, if any."""
        return {self.reference_column or DEFAULT_REFERENCE_COLUMN} if self.reference_guided else set()

    async def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        """Score a batch: one of 1.0, 0.0 or None per completion, in order."""
        n = len(completions)
        applies = self.applies(kwargs, n)
        references = self._references(kwargs, n) if self.reference_guided else [None] * n
        jobs: dict[int, str] = {}
        for i, (prompt, completion, reference) in enumerate(
            zip(prompts, completions, references, strict=True)
        ):
            if not applies[i] or (self.reference_guided and reference is None):
                continue
            jobs[i] = render_rubric(
                self.rubric_text, prompt_text(prompt), completion_text(completion), reference
            )
        if not jobs:
            return [None] * n

        connection = JudgeConnection.from_env()
        start = time.perf_counter()
        verdicts = await self._judge_all(connection, jobs)
        latency = time.perf_counter() - start

        rewards: list[float | None] = [None] * n
        for i, verdict in verdicts.items():
            rewards[i] = verdict.reward
        self._report(connection, verdicts, latency, kwargs, n)
        return rewards

    def _references(self, kwargs: dict[str, Any], n: int) -> list[str | None]:
        """Reference text per row: ``reference_column``, else ``solution``; None when empty."""
        name = self.reference_column or DEFAULT_REFERENCE_COLUMN
        primary = column(kwargs, name, n)
        fallback = column(kwargs, DEFAULT_REFERENCE_COLUMN, n) if name != DEFAULT_REFERENCE_COLUMN else None
        if primary is None and fallback is None:
            self.warn_once(
                "no_reference",
                "Judge %s uses a reference-guided rubric but the batch has neither a %r nor a %r column, so "
                "it scores no sample. Set reference_column to the column holding the reference answer.",
                name,
                DEFAULT_REFERENCE_COLUMN,
            )
            return [None] * n
        references: list[str | None] = []
        for i in range(n):
            value = primary[i] if primary is not None else None
            if (value is None or not str(value).strip()) and fallback is not None:
                value = fallback[i]
            text = completion_text(value) if isinstance(value, list) else value
            references.append(str(text) if text is not None and str(text).strip() else None)
        return references

    async def _judge_all(self, connection: JudgeConnection, jobs: dict[int, str]) -> dict[int, _Verdict]:
        headers = {"Authorization": f"Bearer {connection.api_key}"}
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(headers=headers, connector=connector) as session:
            try:
                model = await self._model(session, connection)
            except Exception as exc:  # noqa: BLE001 - no model means no judgement: None, never a crash
                reason = str(exc) if isinstance(exc, JudgeRequestError) else _describe(exc)
                return {i: _Verdict(request_error=connection.redact(reason)) for i in jobs}
            semaphore = asyncio.Semaphore(CONCURRENCY)
            indices = list(jobs)
            results = await asyncio.gather(
                *(self._judge_one(session, semaphore, connection, model, jobs[i]) for i in indices)
            )
        return dict(zip(indices, results, strict=True))

    async def _model(self, session: aiohttp.ClientSession, connection: JudgeConnection) -> str:
        """JUDGE_MODEL, else the first model the server lists (asked once per base URL)."""
        if connection.model:
            return connection.model
        if connection.base_url not in self._models:
            listing = await _request_with_retries(session, connection, "GET", "/models", None)
            try:
                model = listing["data"][0]["id"]
            except (KeyError, IndexError, TypeError):
                raise JudgeRequestError(
                    f"GET {connection.base_url}/models listed no model. Set JUDGE_MODEL to the judge's name."
                ) from None
            self._models[connection.base_url] = str(model)
            logger.info("Judge %s uses model %r, the first one the server lists.", self.__name__, model)
        return self._models[connection.base_url]

    async def _judge_one(
        self,
        session: aiohttp.ClientSession,
        semaphore: asyncio.Semaphore,
        connection: JudgeConnection,
        model: str,
        text: str,
    ) -> _Verdict:
        payload = {
            "model": model,
            "messages": [{"role": "user", "content": text}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
        }
        async with semaphore:
            try:
                body = await _request_with_retries(session, connection, "POST", "/chat/completions", payload)
            except JudgeRequestError as exc:
                return _Verdict(request_error=connection.redact(str(exc)))
            except Exception as exc:  # noqa: BLE001 - any failure of one judgement gives None, never a crash
                return _Verdict(request_error=connection.redact(_describe(exc)))
        try:
            reply = body["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            reply = None
        raw = parse_score(reply if isinstance(reply, str) else None)
        if raw is None:
            tail = reply[-300:] if isinstance(reply, str) else repr(body)[:300]
            return _Verdict(unparseable_reply=connection.redact(tail))
        return _Verdict(reward=1.0 if raw >= THRESHOLD else 0.0, raw=raw)

    def _report(
        self,
        connection: JudgeConnection,
        verdicts: dict[int, _Verdict],
        latency: float,
        kwargs: dict[str, Any],
        n: int,
    ) -> None:
        """Log failures once per batch and send the judge's health metrics to the trainer."""
        sent = len(verdicts)
        failed = [v.request_error for v in verdicts.values() if v.request_error is not None]
        unparseable = [v.unparseable_reply for v in verdicts.values() if v.unparseable_reply is not None]
        raws = [v.raw for v in verdicts.values() if v.raw is not None]
        replies = sent - len(failed)
        if failed:
            logger.warning(
                "Judge %s: %d of %d requests to %s failed after retries; those samples get None. First error: %s",
                self.__name__,
                len(failed),
                sent,
                connection.base_url,
                failed[0],
            )
        if unparseable:
            logger.warning(
                "Judge %s: %d of %d replies had no 'Score: N' line; those samples get None. "
                "Check the rubric asks for one and MAX_TOKENS leaves room after any thinking. Reply tail: %r",
                self.__name__,
                len(unparseable),
                replies,
                unparseable[0],
            )
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            log_metric(f"{self.__name__}/request_failure_rate", len(failed) / sent)
            if replies:
                log_metric(f"{self.__name__}/parse_failure_rate", len(unparseable) / replies)
            if raws:
                log_metric(f"{self.__name__}/score_mean", sum(raws) / len(raws))
            log_metric(f"{self.__name__}/batch_latency_s", latency)
        log_extra = kwargs.get("log_extra")
        if callable(log_extra):
            column_values = [None] * n
            for i, verdict in verdicts.items():
                column_values[i] = verdict.raw
            log_extra(f"{self.__name__}_score", column_values)


async def _request_with_retries(
    session: aiohttp.ClientSession,
    connection: JudgeConnection,
    method: str,
    path: str,
    payload: dict[str, Any] | None,
) -> Any:
    """One JSON request with up to MAX_RETRIES retries after BACKOFF_S waits (:func:`rewards.json_http.request_json`).

    Raises:
        JudgeRequestError: After the last attempt fails, with a message free of the API key.
    """
    try:
        return await request_json(
            session,
            method,
            f"{connection.base_url}{path}",
            payload,
            timeout_s=TIMEOUT_S,
            retry_waits_s=waits(MAX_RETRIES, BACKOFF_S),
            secret=connection.api_key if connection.api_key != DEFAULT_API_KEY else None,
        )
    except RequestFailed as exc:
        raise JudgeRequestError(connection.redact(str(exc))) from None


def make_judge_reward(
    rubric: str = "rewards/prompts/default.md",
    only_label: str | None = None,
    reference_column: str | None = None,
    name: str | None = None,
) -> JudgeReward:
    """Build an async LLM-as-judge reward (S-JUDGE).

    Args:
        rubric: A rubric file (``rewards/prompts/default.md``, ``reference.md``, your own) or the
            rubric text, with ``{prompt}``, ``{completion}`` and optionally ``{reference}``. It is
            read now, so the reward pickles without the file.
        only_label: Score only rows whose ``label`` column equals this; others get None.
        reference_column: For a ``{reference}`` rubric, the column with the reference answer
            (default ``solution``; rows where it is empty fall back to ``solution``).
        name: The reward's ``__name__``, the prefix of its TRL metrics; judges used together need
            distinct names. Defaults to ``judge_reward`` (``judge_<only_label>`` with only_label).

    Returns:
        A picklable object with ``async __call__(prompts, completions, completion_ids=None,
        **kwargs) -> list[float | None]``. It logs ``<name>/parse_failure_rate``,
        ``<name>/request_failure_rate``, ``<name>/score_mean`` (raw 0-10) and
        ``<name>/batch_latency_s`` through ``log_metric`` when the trainer passes it.

    Raises:
        ValueError: When the rubric file is missing or has no ``{completion}`` placeholder.

    Example:
        >>> judge = make_judge_reward("rewards/prompts/reference.md", reference_column="answer")
        >>> judge.reference_guided, judge.__name__
        (True, 'judge_reward')
    """
    text = load_rubric(rubric)
    default_name = f"judge_{only_label}" if only_label else "judge_reward"
    return JudgeReward(
        rubric_text=text, only_label=only_label, reference_column=reference_column, name=name or default_name
    )
