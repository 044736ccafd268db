"""Test-only parts for the agent tests: a scripted policy, a recording reward, a faulty environment.

A random tiny model rarely writes a valid tool call, so :class:`ScriptedPolicy` stands in for
``model.generate`` and writes each row's next assistant turn from a script. Everything around it
is real: TRL's tool loop, the response parser, the tools, the rendered tool messages, the
``tool_mask``, the rewards and the loss.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from dna_factory.agents.environment import Environment, tool
from tests.lazy import lazy

torch = lazy("torch")


RECORDED: list[dict] = []
"""What :func:`record_completions` was called with, one dict per call."""


def record_completions(prompts, completions, **kwargs):
    """A reward that abstains (None) and records what TRL passed to rewards."""
    RECORDED.append({"prompts": prompts, "completions": completions, **kwargs})
    return [None] * len(completions)


def tool_responses(context: str) -> list[str]:
    """The tool results rendered into a Qwen3 context, in order."""
    return re.findall(r"<tool_response>\n(.*?)\n</tool_response>", context, re.DOTALL)


class ScriptedPolicy:
    """Replaces ``model.generate``: ``script(context, row)`` gives the text of the row's next turn.

    Args:
        tokenizer: The tiny model's tokenizer.
        script: Maps the decoded context (prompt, earlier turns, tool results) and the row's
            index in this generation call to the next turn, ending with ``<|im_end|>``.
    """

    def __init__(self, tokenizer, script: Callable[[str, int], str]) -> None:
        self.tokenizer = tokenizer
        self.script = script
        self.contexts: list[str] = []

    def __call__(self, input_ids, attention_mask, generation_config=None, **_):
        replies = []
        for row, (ids, mask) in enumerate(zip(input_ids, attention_mask, strict=True)):
            context = self.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=False)
            self.contexts.append(context)
            replies.append(self.tokenizer.encode(self.script(context, row), add_special_tokens=False))
        width = max(len(reply) for reply in replies)
        out = torch.full((len(replies), width), self.tokenizer.pad_token_id, dtype=input_ids.dtype)
        for i, reply in enumerate(replies):
            out[i, : len(reply)] = torch.tensor(reply, dtype=input_ids.dtype)
        return torch.cat([input_ids, out.to(input_ids.device)], dim=1)


class FaultyEnvironment(Environment):
    """Two tools: ``echo`` (counts its calls) and ``explode`` (always raises)."""

    calls = 0

    @tool
    def echo(self, text: str) -> str:
        """Repeat a text.

        Args:
            text: The text to repeat.
        """
        FaultyEnvironment.calls += 1
        return f"echo: {text}"

    @tool
    def explode(self) -> str:
        """A tool that always fails."""
        raise RuntimeError("boom")
