"""TRL's async rollout child survives an empty turn (issue 19, item 3, in part).

A request that vLLM aborts (a weight-sync pause, a server restart) comes back with no tokens; on
that empty turn transformers' ``tokenizer.parse_response(ids, prefix=...)`` returns ``[]``, and
TRL 1.16's ``parse_response`` then raises ``AttributeError`` (it falls back to plain text only on
ValueError/TypeError) inside the spawned rollout child, which dies — seen on ``--rehearse`` of
configs/grpo/qwen3-0.6B-async.yaml and, per issue 19, on real GSM8K runs. These tests run the
parse the way TRL's child does: in a *spawned* interpreter that received ``AsyncRolloutWorker``'s
loop class by pickle, with the tiny Qwen3 tokenizer (TRL's real qwen3.jinja).
"""

from __future__ import annotations

import multiprocessing as mp
import pickle

from tests.conftest import REPO

TINY = str(REPO / "artifacts" / "tiny" / "student")


def _child_parse(loop_cls_pickle: bytes, model: str, queue) -> None:
    """What TRL's spawned child has: the loop class (unpickled), TRL's module, and an empty turn to parse."""
    try:
        pickle.loads(loop_cls_pickle)
        from transformers import AutoTokenizer
        from trl.chat_template_utils import add_response_schema
        from trl.experimental.async_grpo import async_rollout_worker

        tok = add_response_schema(AutoTokenizer.from_pretrained(model))
        prefix = tok.apply_chat_template(
            [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, return_dict=False
        )
        queue.put(("ok", async_rollout_worker.parse_response(tok, [], prefix=prefix)))
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        queue.put(("error", f"{type(exc).__name__}: {exc}"))


def test_the_spawned_rollout_child_parses_an_empty_turn_as_empty_text(tiny_model):
    from trl.experimental.async_grpo.async_rollout_worker import AsyncRolloutWorker

    import dna_factory.async_grpo.trainer  # noqa: F401  (what grpo.py imports for async GRPO)

    ctx = mp.get_context("spawn")  # as TRL's AsyncRolloutWorker.start
    queue = ctx.Queue()
    child = ctx.Process(target=_child_parse, args=(pickle.dumps(AsyncRolloutWorker._loop_cls), TINY, queue))
    child.start()
    status, value = queue.get(timeout=240)
    child.join(timeout=30)
    assert status == "ok", value
    assert value == {"role": "assistant", "content": ""}


def test_trl_canary_parse_response_and_the_loop_class_hook():
    """What the fallback relies on, in TRL 1.16: the child builds ``_loop_cls`` from the worker's class
    attribute, the loop looks ``parse_response`` up as a module global, and TRL itself still raises on
    an empty turn (when it stops raising, dna_factory/async_grpo/rollout_child.py can go)."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import add_response_schema
    from trl.chat_template_utils import parse_response as trl_parse_response
    from trl.experimental.async_grpo import async_rollout_worker as worker

    import dna_factory.async_grpo.rollout_child as ours

    assert worker.AsyncRolloutWorker._loop_cls is ours.RolloutLoop
    assert "parse_response" in worker._AsyncRolloutLoop._generate_one.__code__.co_names
    assert worker.parse_response is ours.parse_response
    tok = add_response_schema(AutoTokenizer.from_pretrained(TINY))
    prefix = tok.apply_chat_template(
        [{"role": "user", "content": "2+2?"}], add_generation_prompt=True, return_dict=False
    )
    try:
        trl_parse_response(tok, [], prefix=prefix)
        raised = False
    except AttributeError:
        raised = True
    assert raised, "TRL now handles an empty turn: drop dna_factory/async_grpo/rollout_child.py"
    full = tok.encode("The answer is 4.<|im_end|>")
    assert ours.parse_response(tok, full, prefix=prefix) == trl_parse_response(tok, full, prefix=prefix)
