"""What runs inside TRL's spawned async rollout child: TRL's loop, with three missing guards added.

TRL 1.16's ``parse_response`` (``trl/chat_template_utils.py``) falls back to the plain decoded text
when the tokenizer's parser raises ``ValueError``/``TypeError``, but on an *empty* turn — what a
request aborted by vLLM (a weight-sync pause, issue 15) comes back with — transformers 5.x's
``tokenizer.parse_response(ids, prefix=...)`` returns ``[]``, and TRL then raises ``AttributeError:
'list' object has no attribute 'get'`` inside the rollout child, which kills it (and the trainer
then waits on the dead child: issue 19). :func:`parse_response` applies TRL's own fallback to any
parse that gives no message dict. :class:`RolloutLoop` resubmits a completion vLLM aborted instead of
scoring its cut-off text.

The child is *spawned*, so a patch made in the trainer process does not reach it. TRL pickles
``AsyncRolloutWorker._loop_cls`` by reference into the child; pointing it at :class:`RolloutLoop`,
defined here, makes the child import this module, which installs the same patch there. Pinned by
``tests/test_rollout_child.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing
import os
import signal
import sys

from trl.experimental.async_grpo import async_rollout_worker as _trl_worker

from dna_factory.run.process_group import follow_owner

logger = logging.getLogger(__name__)

_trl_parse_response = _trl_worker.parse_response
_warned = False


def parse_response(tokenizer, ids, prefix=None, tools=None) -> dict:
    """TRL's ``parse_response``, plus its plain-text fallback for a parser that returns no dict."""
    global _warned
    try:
        parsed = _trl_parse_response(tokenizer, ids, prefix=prefix, tools=tools)
    except AttributeError:
        parsed = None
    if isinstance(parsed, dict):
        return parsed
    if not _warned:
        _warned = True
        logger.warning(
            "The tokenizer's response parser gave no message for a rollout turn; it is used as plain text "
            "(TRL's own fallback). Turn: %r",
            tokenizer.decode(ids)[:300],
        )
    return {"role": "assistant", "content": tokenizer.decode(ids, skip_special_tokens=True)}


def die_with_parent() -> None:
    """End this (spawned) child when its trainer dies, however it dies (#35: a trainer killed with SIGKILL, by
    the OOM killer or a native crash left the child generating against the server for ever, re-parented to PID 1).

    Linux's ``PR_SET_PDEATHSIG`` kills the child with its parent at once; a thread that watches the parent
    pid (:func:`~dna_factory.run.process_group.follow_owner`) covers what that misses (a parent gone before the
    call, a platform without ``prctl``)."""
    parent = multiprocessing.parent_process()
    if parent is None:  # not a multiprocessing child: nothing to follow
        return
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):  # PR_SET_PDEATHSIG = 1
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)

    def leave() -> None:
        logger.error("The trainer (pid %d) is gone; its rollout child stops.", parent.pid)
        os._exit(1)

    follow_owner(parent.pid, leave, name="rollout-parent-watch")


ABORTED_RETRIES = 5  # resubmissions of one aborted completion before the rollout child gives up


class RolloutLoop(_trl_worker._AsyncRolloutLoop):
    """TRL's rollout loop, defined here so that the spawned child imports this module; two changes.

    TRL 1.16's worker never reads ``finish_reason``: a completion that vLLM aborted (HTTP 200,
    ``finish_reason="abort"``, the tokens generated so far) would be scored and trained as if the
    model had stopped there. Such a request is resubmitted whole, and counted in the
    ``rollout/aborted_total`` metric; after ``ABORTED_RETRIES`` aborts in a row the child fails
    with a message instead of training on cut-off text.

    At the end of every run the child has scored samples the trainer will never read. A
    ``multiprocessing.Queue`` joins its feeder thread at process exit, and that thread is blocked
    writing them into a full pipe: TRL's ``stop()`` waited 15 s, warned "Child did not exit within
    15s" and terminated the child, every run. :meth:`run` lets the child exit without flushing the
    sample and metric queues (the exception queue, which the trainer reads, still flushes).

    The child ignores SIGINT: a terminal's Ctrl-C is the trainer's to handle (it saves, then stops the child).
    """

    def run(self) -> None:
        die_with_parent()
        # A terminal's Ctrl-C reaches the whole foreground group, this child too: the trainer handles it (it
        # saves, then stops this child through TRL's stop()); here it was a KeyboardInterrupt traceback and a
        # "rollout child failed" error line in the middle of a clean stop.
        with contextlib.suppress(ValueError):  # not the main thread: nothing to ignore
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            super().run()
        finally:
            self.rollout_buffer.cancel_join_thread()
            self._metrics_queue.cancel_join_thread()

    async def _post(self, path: str, payload: dict, timeout: float, max_retries: int = 3) -> dict:
        for attempt in range(ABORTED_RETRIES + 1):
            content = await super()._post(path, payload, timeout, max_retries)
            choices = content.get("choices") if path == "/v1/completions" else None
            if not choices or choices[0].get("finish_reason") != "abort":
                return content
            self._counters["rollout/aborted_total"] += 1
            logger.warning(
                "vLLM aborted a completion after %d tokens (a pause without mode=keep, or a server-side abort); "
                "it is resubmitted, not scored (%d/%d).",
                len(choices[0].get("token_ids") or []),
                attempt + 1,
                ABORTED_RETRIES,
            )
        raise RuntimeError(
            f"vLLM at {self.vllm_server_url} aborted the same completion {ABORTED_RETRIES + 1} times; "
            "is something pausing the server with mode=abort?"
        )


_trl_worker.parse_response = parse_response
_trl_worker.AsyncRolloutWorker._loop_cls = RolloutLoop
