"""Waiting for an external HTTP service (a vLLM server, the teacher, a judge) with a visible, bounded wait.

``requests`` and ``urllib3`` do the HTTP work: :func:`wait_for_health` polls ``/health`` with a
short per-request timeout until the service answers or the wait is over, logging how long it
has waited, and :class:`BoundedAdapter` gives every request of a ``requests.Session`` a default
timeout and ``urllib3``'s ``Retry`` (back-off, ``Retry-After``, transient statuses only).

The services a recipe talks to are found in one place, :func:`recipe_services` (the vLLM server of
sync GRPO's ``vllm_mode: server`` and of async GRPO, the judge of the judge reward, the distillation
teacher, the checkpoint-eval server of ``eval_server_url``). :func:`wait_for_services` (every stage's ``wait_for_services`` hook, before data, tokenizer
and model load) waits up to ``server_wait_s`` for each; :func:`probe_services` (a validator) probes
them once, fast, under ``--dry_run`` and says which it skipped.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from urllib.parse import urlparse

import requests
from requests.adapters import HTTPAdapter
from urllib3.util.retry import Retry

from dna_factory.errors import DnaConfigError, DnaServiceError

logger = logging.getLogger(__name__)

START_LINES = {
    "generation": "VLLM_SERVER_DEV_MODE=1 vllm serve {model} --port {port} "
    '--weight-transfer-config \'{{"backend": "nccl"}}\' --logprobs-mode processed_logprobs --max-logprobs -1',
    "eval": "VLLM_SERVER_DEV_MODE=1 vllm serve {model} --port {port}",
    "teacher": "vllm serve {model} --port {port}",
    "judge": "vllm serve {model} --port {port}",
}
"""The one start line of each kind of GPU server, the same in the hints below, the recipe headers and the docs
(tests/test_services.py checks them): ``generation`` for GRPO's server mode, sync or async (dev mode for
``/pause``, ``/resume`` and the weight-update endpoints; NCCL weight transfer; the sampled tokens' processed
logprobs), ``eval`` for checkpoint eval's shared server (dev mode: weights reload in place), ``teacher`` and
``judge`` plain OpenAI-compatible servers. Sizing flags (``--max-model-len``, ``--dtype``, parallelism) follow."""


def start_line(kind: str, model: str, port: int | str) -> str:
    """The start line of :data:`START_LINES` for ``kind``, with the model and port filled in."""
    return START_LINES[kind].format(model=model, port=port)


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


def wait_for_health(
    root: str, what: str, wait_s: float, start_hint: str, setting: str, any_answer: bool = False
) -> None:
    """Poll ``{root}/health`` until it answers 200, logging the wait; raise one clear error when ``wait_s`` passes.

    Args:
        root: the service's address, ``http://host:port``.
        what: how messages name it ("teacher server").
        wait_s: the longest wait, seconds.
        start_hint: how to start the service, for the error message.
        setting: the recipe key that sets ``wait_s``, for the error message.
        any_answer: any answer below 500 counts as up (a hosted OpenAI-compatible API may have no ``/health``).

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
            if response.status_code == 200 or (any_answer and response.status_code < 500):
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


WAIT_SETTING = "server_wait_s"
PROBE_TIMEOUT_S = 2.0
"""``--dry_run`` tries each service once, this long at most: the check is best effort and fast."""


@dataclass(frozen=True)
class ExternalService:
    """A server the run talks to: how messages name it, its ``http://host:port``, and how to start it."""

    what: str
    root: str
    start_hint: str
    any_answer: bool = False


def _port(root: str, default: str) -> str:
    return str(urlparse(root).port or default)


def recipe_services(cfg) -> list[ExternalService]:
    """Every external server the resolved config ``cfg`` will talk to, from its keys (one place for all stages)."""
    services = []
    model = cfg.get("model_name_or_path")
    if cfg.get("grpo_execution") == "async":
        root = server_root(cfg.get("vllm_server_base_url") or "http://localhost:8000", "vllm_server_base_url")
        hint = f"{start_line('generation', model, _port(root, '8000'))} --max-model-len N; docs/async-grpo.md"
        services.append(ExternalService("vLLM server", root, hint))
    elif (
        cfg.get("use_vllm") and cfg.get("vllm_mode") == "server"
    ):  # TRL's VLLMClient: base_url, else host:port
        url = cfg.get("vllm_server_base_url")
        url = (
            url or f"http://{cfg.get('vllm_server_host') or '0.0.0.0'}:{cfg.get('vllm_server_port') or 8000}"
        )
        root = server_root(url, "vllm_server_base_url")
        hint = f"{start_line('generation', model, _port(root, '8000'))} on its own GPUs; docs/grpo.md"
        services.append(ExternalService("vLLM server", root, hint))
    if any(
        entry == "judge" or (isinstance(entry, dict) and entry.get("factory") == "judge")
        for entry in cfg.get("reward_funcs") or []
    ):
        from rewards.generative import DEFAULT_BASE_URL  # the judge reward imports aiohttp: only for a judge

        root = server_root(os.environ.get("JUDGE_BASE_URL") or DEFAULT_BASE_URL, "JUDGE_BASE_URL")
        hint = f"{start_line('judge', 'JUDGE', _port(root, '8001'))}, or point JUDGE_BASE_URL at it; docs/rewards.md"
        services.append(ExternalService("judge server", root, hint, any_answer=True))
    if cfg.get("distill_mode") == "server_teacher" and cfg.get("teacher_server_url"):
        root = server_root(cfg.get("teacher_server_url"), "teacher_server_url")
        teacher = cfg.get("teacher_model_name_or_path")
        hint = f"{start_line('teacher', teacher, _port(root, '8000'))}; docs/distillation.md"
        services.append(ExternalService("teacher server", root, hint))
    if cfg.get("eval_on_checkpoint") and cfg.get("eval_server_url"):
        root = server_root(cfg.get("eval_server_url"), "eval_server_url")
        hint = f"{start_line('eval', model, _port(root, '8000'))}; docs/checkpoint-eval.md"
        services.append(ExternalService("eval server", root, hint))
    return services


def wait_for_services(cfg) -> None:
    """Wait up to ``server_wait_s`` for each service of :func:`recipe_services` (logged); one error if one stays down.

    Raises:
        DnaServiceError: naming the service's URL, the wait and how to start it.
    """
    wait_s = float(cfg.get(WAIT_SETTING) or 0)
    for service in recipe_services(cfg):
        wait_for_health(
            service.root,
            service.what,
            wait_s,
            service.start_hint,
            WAIT_SETTING,
            any_answer=service.any_answer,
        )


def probe_services(cfg) -> None:
    """Under ``--dry_run`` only: try each service once (best effort, fast); log which answered and which is skipped."""
    if not cfg.get("dry_run"):
        return  # a real run waits for them (wait_for_services) before anything loads
    for service in recipe_services(cfg):
        try:
            response = requests.get(f"{service.root}/health", timeout=PROBE_TIMEOUT_S)
            status = response.status_code
            if status == 200 or (service.any_answer and status < 500):
                logger.info("The %s at %s answers /health.", service.what, service.root)
                continue
            reason = f"/health: HTTP {status}"
        except requests.RequestException as exc:
            reason = type(exc).__name__
        logger.warning(
            "skipped: %s not reachable (%s); the %s is not checked. A run waits up to %s for it (start it with %s).",
            service.root,
            reason,
            service.what,
            WAIT_SETTING,
            service.start_hint,
        )
