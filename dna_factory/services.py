"""Waiting for an external HTTP service (a vLLM server, the teacher, a judge) with a visible, bounded wait.

``requests`` and ``urllib3`` do the HTTP work: :func:`wait_for_health` polls ``/health`` with a
short per-request timeout until the service answers or the wait is over, logging how long it
has waited, and :class:`BoundedAdapter` gives every request of a ``requests.Session`` a default
timeout and ``urllib3``'s ``Retry`` (back-off, ``Retry-After``, transient statuses only).
"""

from __future__ import annotations

import logging
import time
from urllib.parse import urlparse

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from dna_factory.errors import DnaConfigError, DnaServiceError

logger = logging.getLogger(__name__)

RETRY_STATUSES = (429, 500, 502, 503, 504)
"""Answers worth retrying: overload and transient server errors. A 4xx is the request's fault and is not retried."""


class _Retry(Retry):
    """``urllib3.Retry`` that honours ``Retry-After`` only on 429 and 503 (a 413 is the request's fault)."""

    RETRY_AFTER_STATUS_CODES = frozenset({429, 503})


class BoundedAdapter(HTTPAdapter):
    """An ``HTTPAdapter`` whose requests time out after ``timeout_s`` unless the caller set a timeout.

    Args:
        timeout_s: seconds for connecting and for each read of the answer.
        retries: retries after the first try, for connection errors, read timeouts and :data:`RETRY_STATUSES`.
        backoff_s: ``urllib3`` back-off factor (sleeps ``backoff_s · 2^(n−1)`` before retry ``n > 1``, at most 30 s).
        pool_maxsize: connections kept per host (the number of requests in flight).
    """

    def __init__(self, timeout_s: float, retries: int, backoff_s: float, pool_maxsize: int = 10) -> None:
        self.timeout_s = timeout_s
        retry = _Retry(
            total=retries,
            connect=retries,
            read=retries,
            status=retries,
            other=0,
            status_forcelist=RETRY_STATUSES,
            allowed_methods=frozenset({"GET", "POST"}),
            backoff_factor=backoff_s,
            backoff_max=30,
            raise_on_status=False,  # the last answer comes back, so the caller can name its status and text
            respect_retry_after_header=True,
            retry_after_max=30,  # a server asking to wait hours would look like a hang
        )
        super().__init__(max_retries=retry, pool_maxsize=pool_maxsize)

    def send(self, request, **kwargs):
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self.timeout_s
        return super().send(request, **kwargs)


def server_root(url: str, setting: str) -> str:
    """``http://host:port`` from a URL given with or without the OpenAI ``/v1`` suffix; ``setting`` names the key."""
    parsed = urlparse(url.rstrip("/"))
    if not parsed.scheme or not parsed.netloc:
        raise DnaConfigError(
            f"{setting} {url!r} is not an http(s) URL. Use the server's address, e.g. "
            "http://127.0.0.1:8000 (with or without /v1)."
        )
    path = parsed.path[: -len("/v1")] if parsed.path.endswith("/v1") else parsed.path
    return f"{parsed.scheme}://{parsed.netloc}{path}"


def bound_session(
    session: requests.Session, timeout_s: float, retries: int, backoff_s: float, pool: int
) -> None:
    """Mount :class:`BoundedAdapter` on ``session`` for http and https (replacing what was mounted)."""
    adapter = BoundedAdapter(timeout_s, retries, backoff_s, pool_maxsize=pool)
    session.mount("http://", adapter)
    session.mount("https://", adapter)


def wait_for_health(root: str, what: str, wait_s: float, start_hint: str, setting: str) -> None:
    """Poll ``{root}/health`` until it answers 200, logging the wait; raise one clear error when ``wait_s`` passes.

    Args:
        root: the service's address, ``http://host:port``.
        what: how messages name it ("teacher server").
        wait_s: the longest wait, seconds.
        start_hint: how to start the service, for the error message.
        setting: the recipe key that sets ``wait_s``, for the error message.

    Raises:
        DnaServiceError: naming the URL, the wait and how to start the service.
    """
    started = time.monotonic()
    logged = -1.0
    last = "no answer"
    while True:
        waited = time.monotonic() - started
        try:
            response = requests.get(f"{root}/health", timeout=max(0.5, min(5.0, wait_s - waited)))
            if response.status_code == 200:
                if logged >= 0:
                    logger.info("The %s at %s answered after %.0f s.", what, root, waited)
                return
            last = f"HTTP {response.status_code}"
        except requests.RequestException as exc:
            last = type(exc).__name__
        waited = time.monotonic() - started
        if waited >= wait_s:
            raise DnaServiceError(
                f"The {what} at {root} did not answer /health within {wait_s:g} s (last: {last}). Start it first "
                f"({start_hint}), fix the URL, or wait longer with {setting}."
            )
        if logged < 0 or waited - logged >= 10:
            logger.info(
                "Waiting for the %s at %s (/health: %s), %.0f of %g s.", what, root, last, waited, wait_s
            )
            logged = waited
        time.sleep(min(1.0, max(0.0, wait_s - waited)))
