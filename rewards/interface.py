"""The reward-function interface shared by every reward in this package (S-RW-1, S-RW-2).

TRL 1.16 (``GRPOTrainer._calculate_rewards`` and the async rollout worker's ``_score_group``)
calls a reward function as::

    reward(prompts=[...], completions=[...], completion_ids=[...], **columns,
           trainer_state=..., log_extra=..., log_metric=...)

- ``prompts`` / ``completions`` are plain strings (standard format) or lists of message dicts
  (conversational format, e.g. ``[{"role": "assistant", "content": "..."}]``; with tools the
  completion also holds ``tool`` messages and assistant turns whose content may be None).
- every other dataset column arrives as a keyword argument holding one value per sample;
- ``trainer_state``, ``log_extra`` and ``log_metric`` are passed by the sync trainer only (the
  async rollout worker passes the columns alone), so rewards must treat them as optional.

The function returns one ``float`` or ``None`` per completion. ``None`` means "this reward does
not apply to this sample": TRL turns it into NaN and leaves it out through nansum/nanmean, so it
is never counted as 0.0.

This module holds the small helpers that turn those inputs into text and decide which rows a
reward applies to, and :class:`Reward`, the base every reward class here is built on.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

LABEL_COLUMN = "label"


def _content_text(content: Any) -> str:
    """Text of a message ``content``: a string, None, or a list of typed parts (multimodal)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict):
                if part.get("type", "text") == "text" and isinstance(part.get("text"), str):
                    parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


def completion_text(completion: Any) -> str:
    """The text a reward should judge in one completion.

    A plain string is returned unchanged. A conversational completion (a list of message dicts)
    gives the contents of its assistant messages joined by newlines; tool messages (tool
    results) and any other role are ignored, so an answer is read only from what the model said.

    Args:
        completion: A string, a list of ``{"role": ..., "content": ...}`` dicts, or None.

    Returns:
        The text, ``""`` when there is none.

    Example:
        >>> completion_text([{"role": "assistant", "content": "x"}, {"role": "tool", "content": "42"},
        ...                  {"role": "assistant", "content": "so 7"}])
        'x\\nso 7'
    """
    if completion is None:
        return ""
    if isinstance(completion, str):
        return completion
    if type(completion) is list and len(completion) == 1:  # one assistant message (GRPO's usual): no joining
        message = completion[0]
        if (
            type(message) is dict
            and type(content := message.get("content")) is str
            and message.get("role", "assistant") == "assistant"
        ):
            return content
    if isinstance(completion, dict):
        completion = [completion]
    texts = [
        _content_text(message.get("content"))
        for message in completion
        if isinstance(message, dict) and message.get("role", "assistant") == "assistant"
    ]
    return "\n".join(text for text in texts if text)


def prompt_text(prompt: Any) -> str:
    """The text of a prompt, for showing it to a judge.

    A plain string is returned unchanged; a conversation becomes one ``role: content`` line
    block per message, every role kept (the system prompt can define the task).

    Args:
        prompt: A string or a list of message dicts.

    Returns:
        The text.

    Example:
        >>> prompt_text([{"role": "user", "content": "2+2?"}])
        'user: 2+2?'
    """
    if prompt is None:
        return ""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        prompt = [prompt]
    return "\n\n".join(
        f"{message.get('role', 'user')}: {_content_text(message.get('content'))}"
        for message in prompt
        if isinstance(message, dict)
    )


def label_mask(
    only_label: str | None, kwargs: dict[str, Any], n: int, reward_name: str, warned: set[str]
) -> list[bool]:
    """Which of ``n`` rows a reward restricted to ``only_label`` applies to (S-RW-6).

    With ``only_label`` unset every row applies. With it set, a row applies when its ``label``
    column equals ``only_label``; when the batch has no ``label`` column at all no row applies
    and a warning is logged once per reward (the key is recorded in ``warned``).

    Args:
        only_label: The label to keep, or None for all rows.
        kwargs: The keyword arguments the trainer passed (dataset columns and extras).
        n: The number of completions in the batch.
        reward_name: The reward's ``__name__``, for the warning.
        warned: A per-reward set of warning keys already logged.

    Returns:
        One bool per row.

    Example:
        >>> label_mask("gsm8k", {"label": ["gsm8k", "math"]}, 2, "r", set())
        [True, False]
    """
    if only_label is None:
        return [True] * n
    labels = kwargs.get(LABEL_COLUMN)
    if labels is None:
        if "no_label" not in warned:
            warned.add("no_label")
            logger.warning(
                "Reward %s has only_label=%r but the batch has no %r column, so it scores no sample "
                "(every value is None). Give each dataset a `label:` in the recipe, or drop only_label.",
                reward_name,
                only_label,
                LABEL_COLUMN,
            )
        return [False] * n
    return [label == only_label for label in _as_list(labels, n)]


def _as_list(values: Sequence[Any] | Any, n: int) -> list[Any]:
    """A column as a list of length ``n`` (a scalar is broadcast; used for hand-made calls)."""
    if isinstance(values, (list, tuple)):
        return list(values)
    return [values] * n


def column(kwargs: dict[str, Any], name: str, n: int) -> list[Any] | None:
    """Column ``name`` from the trainer's keyword arguments as a list of ``n`` values, or None.

    Example:
        >>> column({"solution": ["1", "2"]}, "solution", 2)
        ['1', '2']
    """
    if name not in kwargs or kwargs[name] is None:
        return None
    return _as_list(kwargs[name], n)


@dataclass(eq=False, kw_only=True)
class Reward:
    """What every reward class of this package shares; each is a keyword-only dataclass built on it.

    TRL names a reward by its ``__name__`` (set from ``name``). ``only_label`` restricts it to the
    rows of one dataset (:func:`label_mask`). A column the batch lacks makes it abstain, None for
    every sample, after one warning per reward (:meth:`column_or_abstain`). Rewards compare by
    identity (``eq=False``) and pickle by their fields, as TRL's rollout worker needs.
    """

    name: str
    only_label: str | None = None
    _warned: set[str] = field(default_factory=set, init=False, repr=False)

    def __post_init__(self) -> None:
        self.__name__ = self.name

    def applies(self, kwargs: dict[str, Any], n: int) -> list[bool]:
        """Which of the ``n`` rows this reward scores (its ``only_label``)."""
        return label_mask(self.only_label, kwargs, n, self.__name__, self._warned)

    def column_or_abstain(self, kwargs: dict[str, Any], name: str, n: int, *, holds: str, option: str):
        """Column ``name`` as a list, or None (the caller returns ``[None] * n``) after one warning.

        Args:
            holds: What the column holds, for the warning ("gold answers", "tests").
            option: The reward option that names the column, which the warning tells the user to set.
        """
        values = column(kwargs, name, n)
        if values is None:
            self.warn_once(
                f"no_column_{name}",
                "Reward %s reads %s from column %r, which this batch does not have, so it scores no sample. "
                "Set %s to the column holding them.",
                holds,
                name,
                option,
            )
        return values

    def warn_once(self, key: str, message: str, *args: Any) -> None:
        """Log ``message % (name, *args)`` once per reward and ``key``."""
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(message, self.__name__, *args)
