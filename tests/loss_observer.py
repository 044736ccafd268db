"""Run an entry script with TRL's ``AsyncGRPOTrainer.compute_loss`` observed: which prompts reach the loss, per step.

    python tests/loss_observer.py OBS.jsonl grpo.py --config ... [more arguments]

Every ``compute_loss`` call appends ``{"step": S, "questions": [...]}`` to ``OBS.jsonl``: ``S`` is the
optimizer step the micro-batch belongs to (``global_step + 1`` while it is being computed) and the
questions are the user turns decoded from the ``input_ids`` the model is given. TRL packs a micro-batch
into a prefix trie (prompts sharing a prefix share its tokens), so each sequence is read back along
its root-to-segment path, the keys the model attends over (``tree_kv_index``). Nothing here reads
dna-factory's own bookkeeping, so a test can hold that bookkeeping against what was really trained.
Only the Qwen3 chat markers are understood (the tiny student's template).
"""

from __future__ import annotations

import json
import re
import runpy
import sys
from pathlib import Path

USER_TURN = re.compile(r"<\|im_start\|>user\n(.*?)<\|im_end\|>", re.S)


def main() -> None:
    from trl.experimental.async_grpo import AsyncGRPOTrainer

    observations, script, *args = sys.argv[1:]
    compute_loss = AsyncGRPOTrainer.compute_loss

    def observed_compute_loss(self, model, inputs, *rest, **kwargs):
        ids = inputs["input_ids"][inputs["attention_mask"].bool()]
        kv_index = inputs["tree_kv_index"][inputs["tree_kv_index"] >= 0]
        bounds = inputs["tree_cu_seqlens_k"][inputs["tree_cu_seqlens_k"] >= 0].tolist()
        questions = set()
        for start, end in zip(bounds, bounds[1:], strict=False):  # each segment's root-to-segment path
            text = self.processing_class.decode(ids[kv_index[start:end]].tolist())
            questions.update(USER_TURN.findall(text))
        record = {"step": self.state.global_step + 1, "questions": sorted(questions)}
        with open(observations, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        return compute_loss(self, model, inputs, *rest, **kwargs)

    AsyncGRPOTrainer.compute_loss = observed_compute_loss
    sys.argv = [script, *args]
    sys.path[0] = str(
        Path(script).resolve().parent
    )  # as `python grpo.py` has it: this checkout's dna_factory
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
