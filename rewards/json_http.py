"""One JSON request over HTTP with retries, for the judge (:mod:`rewards.generative`) and the learnability
filter's rollouts (:mod:`dna_factory.filter.rollouts`), both on an ``aiohttp`` session the caller owns.

Timeouts, connection errors, HTTP 408/409/425/429, 5xx and bodies that are not JSON are retried after
the given waits; another 4xx is final at once (the same request would fail again). The error names the
method, the URL, the number of attempts and the last failure; callers redact their API key from it.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from typing import Any

import aiohttp

RETRY_STATUSES = frozenset({408, 409, 425, 429})
"""4xx answers that are worth another try (timeout, conflict, too early, rate limit)."""


class RequestFailed(RuntimeError):
    """The request failed for good (after every retry); the message says how, API key included if it was in it."""


def waits(retries: int, backoff_s: Sequence[float]) -> tuple[float, ...]:
    """The wait before each of ``retries`` retries: ``backoff_s`` in turn, its last value repeated."""
    return (
        tuple(backoff_s[min(i, len(backoff_s) - 1)] for i in range(retries))
        if backoff_s
        else (0.0,) * retries
    )


async def request_json(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    payload: dict[str, Any] | None,
    *,
    timeout_s: float,
    retry_waits_s: Sequence[float],
    secret: str | None = None,
) -> Any:
    """Send ``payload`` as JSON and return the parsed JSON reply; one try, then one more after each wait.

    ``secret`` (an API key) is replaced by ``***`` in the error before anything is cut or quoted, so a server
    that echoes it never puts it, or a part of it, in a message.

    Raises:
        RequestFailed: After the last attempt failed.
    """

    def hide(text: str) -> str:
        return text.replace(secret, "***") if secret else text

    last, attempt = "no attempt made", 0
    for attempt, wait_s in enumerate((0.0, *retry_waits_s)):
        if attempt:
            await asyncio.sleep(wait_s)
        text = ""
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with session.request(method, url, json=payload, timeout=timeout) as response:
                text = await response.text()
            if response.status >= 400:
                last = f"HTTP {response.status}: {hide(text)[:300]!r}"
                if response.status < 500 and response.status not in RETRY_STATUSES:
                    break
                continue
            return json.loads(text)
        except TimeoutError:
            last = f"no reply within {timeout_s:g} s"
        except aiohttp.ClientError as exc:
            last = f"{type(exc).__name__}: {hide(str(exc))[:200] or 'no detail'}"
        except json.JSONDecodeError:
            last = f"the reply is not JSON: {hide(text)[:200]!r}"
    raise RequestFailed(hide(f"{method} {url} failed after {attempt + 1} attempt(s): {last}"))
