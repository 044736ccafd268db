"""Instruction-following reward: the share of a row's verifiable IFEval instructions a completion follows.

Row columns (IFEval's own format, so IFEval, Tulu-3-style RLVR-IF and ``google/IFEval`` rows
work as they are):

- ``instructions_column`` (default ``instruction_id_list``): a list of instruction ids, e.g.
  ``["punctuation:no_comma", "length_constraints:number_words"]``;
- ``kwargs_column`` (default ``kwargs``): one dict per instruction,
  ``[{}, {"num_words": 300, "relation": "at least"}]``.

Either cell may be JSON text. An instructions cell that is a dict (or JSON of one) holding
``instruction_id_list`` (or ``instruction_id``) and ``kwargs`` is read whole; set
``kwargs_column: null`` for datasets in that form. :data:`rewards.ifeval.CHECKERS` lists the 25
supported ids.

Per completion: the fraction of instructions followed, or 1.0 only when all are
(``all_or_nothing``); None when the row has no instructions. With ``loose``, IFEval's loose
evaluation is used. The text after the last ``</think>`` is checked (a ``<think>`` never closed
means no answer: nothing is followed). An unknown instruction id or malformed kwargs raises
``ValueError``.

Metrics through ``log_metric``: ``<name>/instruction_accuracy`` (followed / instructions over the
batch) and ``<name>/prompt_accuracy`` (share of scored completions that follow all).

Example:
    >>> reward = make_instruction_following_reward()
    >>> reward(prompts=["q", "q"], completions=["hello world", "hello, world"],
    ...        instruction_id_list=[["punctuation:no_comma", "change_case:english_lowercase"]] * 2,
    ...        kwargs=[[{}, {}]] * 2)
    [1.0, 0.5]
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from rewards.ifeval import follows
from rewards.interface import Reward, column, completion_text

logger = logging.getLogger(__name__)


def _decoded(value: Any) -> Any:
    """JSON text decoded; anything else unchanged."""
    if isinstance(value, str) and value.strip()[:1] in ("[", "{"):
        return json.loads(value)
    return value


def parse_instructions(instructions: Any, kwargs: Any = None) -> tuple[list[str], list[Any]] | None:
    """A row's ``(instruction ids, kwargs dicts)``, or None when it has no instructions.

    Raises:
        ValueError: When a cell has another shape (or is invalid JSON).

    Example:
        >>> parse_instructions('{"instruction_id": ["punctuation:no_comma"], "kwargs": [{}]}')
        (['punctuation:no_comma'], [{}])
        >>> parse_instructions([], []) is None
        True
    """
    instructions = _decoded(instructions)
    if isinstance(instructions, dict):
        kwargs = instructions.get("kwargs", kwargs)
        instructions = instructions.get("instruction_id_list", instructions.get("instruction_id"))
    if instructions is None or (isinstance(instructions, str) and not instructions.strip()):
        return None
    if isinstance(instructions, str):
        instructions = [instructions]
    if not isinstance(instructions, (list, tuple)) or not all(isinstance(i, str) for i in instructions):
        raise ValueError(
            f"An instructions cell is {str(instructions)[:80]!r}. Give a list of IFEval instruction ids "
            'such as ["punctuation:no_comma"].'
        )
    if not instructions:
        return None
    kwargs = _decoded(kwargs)
    if kwargs is None:
        kwargs = []
    if isinstance(kwargs, dict):
        kwargs = [kwargs]
    if not isinstance(kwargs, (list, tuple)) or not all(k is None or isinstance(k, dict) for k in kwargs):
        raise ValueError(
            f"A kwargs cell is {str(kwargs)[:80]!r}. Give one dict per instruction, e.g. "
            '[{}, {"num_words": 300, "relation": "at least"}].'
        )
    return list(instructions), list(kwargs)


def _answer(text: str) -> str:
    """The text after the last ``</think>``; empty when a ``<think>`` is never closed."""
    head, sep, tail = text.rpartition("</think>")
    if sep:
        return tail.strip()
    return "" if "<think>" in text else text


@dataclass(eq=False, kw_only=True)
class InstructionFollowingReward(Reward):
    """A picklable instruction-following reward; build it with :func:`make_instruction_following_reward`."""

    instructions_column: str
    kwargs_column: str | None
    all_or_nothing: bool
    loose: bool

    def required_columns(self) -> set[str]:
        """Dataset columns this reward reads (for the recipe dry-run)."""
        return {self.instructions_column} | ({self.kwargs_column} if self.kwargs_column else set())

    def __call__(
        self, prompts: list[Any], completions: list[Any], completion_ids: Any = None, **kwargs: Any
    ) -> list[float | None]:
        """Score a batch: the share of each row's instructions followed (see the module docstring)."""
        n = len(completions)
        applies = self.applies(kwargs, n)
        cells = self.column_or_abstain(
            kwargs, self.instructions_column, n, holds="instruction ids", option="instructions_column"
        )
        if cells is None:
            return [None] * n
        kwargs_cells = column(kwargs, self.kwargs_column, n) if self.kwargs_column else None
        scores: list[float | None] = []
        followed_total = instructions_total = all_followed = 0
        for i, completion in enumerate(completions):
            row = parse_instructions(cells[i], kwargs_cells[i] if kwargs_cells is not None else None)
            if not applies[i] or row is None:
                scores.append(None)
                continue
            results = follows(_answer(completion_text(completion)), row[0], row[1], loose=self.loose)
            followed = sum(results)
            followed_total += followed
            instructions_total += len(results)
            all_followed += followed == len(results)
            if self.all_or_nothing:
                scores.append(float(followed == len(results)))
            else:
                scores.append(followed / len(results))
        log_metric = kwargs.get("log_metric")
        if callable(log_metric) and instructions_total:
            log_metric(f"{self.__name__}/instruction_accuracy", followed_total / instructions_total)
            log_metric(f"{self.__name__}/prompt_accuracy", all_followed / sum(s is not None for s in scores))
        return scores


def make_instruction_following_reward(
    instructions_column: str = "instruction_id_list",
    kwargs_column: str | None = "kwargs",
    all_or_nothing: bool = False,
    loose: bool = False,
    only_label: str | None = None,
    name: str | None = None,
) -> InstructionFollowingReward:
    """Build the instruction-following reward (YAML: ``{factory: instruction_following, ...}``).

    Args:
        instructions_column: The column of IFEval instruction-id lists.
        kwargs_column: The column of per-instruction kwargs dicts; None when the instructions
            cell holds both (``{"instruction_id": [...], "kwargs": [...]}``).
        all_or_nothing: 1.0 only when every instruction is followed, else 0.0 (default: the
            fraction followed).
        loose: IFEval's loose evaluation (first/last line and ``*`` markup forgiven).
        only_label: Score only rows whose ``label`` equals this; others get None.
        name: The reward's ``__name__``; default ``instruction_following``.

    Returns:
        A picklable callable with TRL's reward signature.

    Example:
        >>> reward = make_instruction_following_reward(kwargs_column=None, all_or_nothing=True)
        >>> reward(prompts=["q"], completions=["<think>hmm, ok</think>Fine"],
        ...        instruction_id_list=['{"instruction_id": ["punctuation:no_comma"], "kwargs": [{}]}'])
        [1.0]
    """
    return InstructionFollowingReward(
        instructions_column=instructions_column,
        kwargs_column=kwargs_column,
        all_or_nothing=all_or_nothing,
        loose=loose,
        only_label=only_label,
        name=name or "instruction_following",
    )
