"""The symbolic fallback of :mod:`rewards.math_equivalence`: math_verify's verdict on a pair the evaluator cannot
read, within a time limit; a timeout or a failure gives None (the reward abstains), never a silent 0.0 or 1.0.

Where it runs depends on the caller's thread and process: math_verify's own SIGALRM timeouts on the main
thread, a one-process pool elsewhere (a stuck worker is killed), a waited-for thread in a daemonic process
(async GRPO's rollout child, which cannot start a pool's process).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from functools import lru_cache

logger = logging.getLogger("rewards.math_equivalence")

FALLBACK_TIMEOUT_S = 5.0
"""Seconds one symbolic comparison may take before the pair gets None."""

_POOL: ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _verify(answer: str, gold: str) -> bool:
    """math_verify's parse and verify, bounded from outside (signal timeouts work on a main thread only)."""
    from math_verify import parse, verify

    parsed_gold = parse(f"${gold}$", parsing_timeout=None, raise_on_error=True)
    parsed = parse(f"${answer}$", parsing_timeout=None, raise_on_error=True)
    return bool(verify(parsed_gold, parsed, timeout_seconds=None, raise_on_error=True))


def _pool() -> ProcessPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        return _POOL


def _reset_pool() -> None:
    """A worker stuck past its limit is killed; the next fallback starts a new one."""
    global _POOL
    with _POOL_LOCK:
        pool, _POOL = _POOL, None
    if pool is not None:
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)


def _verify_here(answer: str, gold: str, timeout_s: float) -> bool:
    """math_verify in this process, bounded by its own SIGALRM timeouts (main thread only)."""
    from math_verify import parse, verify

    seconds = max(1, math.ceil(timeout_s))
    parsed_gold = parse(f"${gold}$", parsing_timeout=seconds, raise_on_error=True)
    parsed = parse(f"${answer}$", parsing_timeout=seconds, raise_on_error=True)
    return bool(verify(parsed_gold, parsed, timeout_seconds=seconds, raise_on_error=True))


def _verify_in_thread(answer: str, gold: str, timeout_s: float) -> bool | None:
    """math_verify in a daemon thread, waited for ``timeout_s`` seconds (a daemonic process, such as async GRPO's
    rollout child, cannot start the pool's process). A thread past its limit is left to finish; the pair gets
    None."""
    box: dict = {}

    def work() -> None:
        try:
            box["verdict"] = _verify(answer, gold)
        except Exception as exc:  # noqa: BLE001 - reported below as None
            box["error"] = exc

    thread = threading.Thread(target=work, daemon=True, name="math-equivalence-fallback")
    thread.start()
    thread.join(timeout_s)
    if "verdict" in box:
        return box["verdict"]
    why = box.get("error") or f"no verdict within {timeout_s:g} s"
    logger.warning("Math equivalence: %r vs %r: %s; the sample gets None.", answer, gold, why)
    return None


@lru_cache(maxsize=16384)
def symbolic_equal(answer: str, gold: str, timeout_s: float = FALLBACK_TIMEOUT_S) -> bool | None:
    """math_verify's verdict on a pair, within ``timeout_s`` seconds; None on a timeout or a failure.

    On the main thread it runs here, bounded by math_verify's SIGALRM timeouts; elsewhere (an event
    loop's thread, where signals cannot be set) in a one-process pool, bounded by the wait for its result
    (a stuck worker is killed); in a daemonic process, which cannot start one, in a thread waited for.
    """
    if threading.current_thread() is threading.main_thread():
        from math_verify.errors import TimeoutException  # a BaseException: `except Exception` lets it through

        try:
            return _verify_here(answer, gold, timeout_s)
        except (Exception, TimeoutException) as exc:  # a timeout or a parse error: never a silent verdict
            logger.warning(
                "Math equivalence: %r vs %r: %s; the sample gets None.", answer, gold, exc or type(exc)
            )
            return None

    if multiprocessing.current_process().daemon:  # async GRPO's rollout child: no child processes allowed
        return _verify_in_thread(answer, gold, timeout_s)
    try:
        future = _pool().submit(_verify, answer, gold)
        return future.result(timeout=timeout_s)
    except FutureTimeout:
        logger.warning(
            "Math equivalence: %r vs %r took over %g s; the sample gets None.", answer, gold, timeout_s
        )
        _reset_pool()
        return None
    except Exception as exc:  # a crashed worker or a math_verify error: never a silent verdict
        logger.warning("Math equivalence: %r vs %r failed (%s); the sample gets None.", answer, gold, exc)
        _reset_pool()
        return None
