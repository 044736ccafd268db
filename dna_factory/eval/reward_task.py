"""Eval tasks scored by a training reward: the held-out split of an RL stage, graded by the same reward code.

An RL stage's own reward is the natural held-out metric of its family: the coding stage's sandboxed tests, the
instruction-following stage's IFEval checkers, the RLHF stage's judge. :func:`reward_task` turns a JSONL file of
``prompt`` rows, with the reward's columns (``tests``, ``instruction_id_list``/``kwargs``, ``solution``, ...),
into an Inspect task: the served model answers each prompt once (the harness's ``eval_temperature``, greedy in
the families recipe), and the reward, built from the same recipe entry as the stage's ``reward_funcs``
(:func:`rewards.registry.resolve_reward`), scores the answer. The metric ``reward`` is the mean over the samples
the reward scored: a sample the reward abstains on (None, e.g. a judge that did not answer) is left out and
counted in ``abstained``, never scored 0.

The answer reaches the reward as one assistant message, as in a GRPO stage with chat prompts (the completion
is the list of messages after the prompt).
"""

from __future__ import annotations

import inspect
import json
import math
from pathlib import Path
from typing import Any

from inspect_ai import Task
from inspect_ai.dataset import MemoryDataset, Sample
from inspect_ai.model import ChatMessageAssistant, ChatMessageSystem, ChatMessageUser
from inspect_ai.scorer import Metric, SampleScore, Score, Target, metric, scorer
from inspect_ai.solver import TaskState, generate

from rewards.registry import resolve_reward

CHAT_MESSAGES = {"system": ChatMessageSystem, "user": ChatMessageUser, "assistant": ChatMessageAssistant}


def chat_input(prompt: str | list[dict]) -> str | list:
    """A training prompt as Inspect's input, under the training prompt rule: a string is the user turn; a chat
    keeps every turn (a system turn included). Inspect sends them through the server's chat API, so the served
    model's chat template renders them as training did (docs/datasets.md)."""
    if isinstance(prompt, str):
        return prompt
    return [CHAT_MESSAGES[m["role"]](content=m["content"]) for m in prompt]


def reward_samples(path: str | Path) -> list[Sample]:
    """One sample per JSONL row; the row's other columns ride along for the reward (``metadata["columns"]``)."""
    rows = [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    return [
        Sample(
            id=i,
            input=chat_input(row["prompt"]),
            metadata={"prompt": row["prompt"], "columns": {k: v for k, v in row.items() if k != "prompt"}},
        )
        for i, row in enumerate(rows)
    ]


@metric
def reward() -> Metric:
    """The mean reward over the samples the reward scored (an abstention is NaN and left out)."""

    def compute(scores: list[SampleScore]) -> float:
        values = [s.score.as_float() for s in scores if not math.isnan(s.score.as_float())]
        return sum(values) / len(values) if values else float("nan")

    return compute


@metric
def abstained() -> Metric:
    """How many samples the reward abstained on (returned None)."""

    def compute(scores: list[SampleScore]) -> float:
        return float(sum(math.isnan(s.score.as_float()) for s in scores))

    return compute


async def score_completion(
    reward_func: Any, prompt: Any, completion: list[dict], columns: dict
) -> float | None:
    """``reward_func`` on one completion, as GRPO calls it (sync or async; one-element lists per column)."""
    values = reward_func(prompts=[prompt], completions=[completion], **{k: [v] for k, v in columns.items()})
    if inspect.isawaitable(values):
        values = await values
    return values[0]


@scorer(metrics=[reward(), abstained()])
def reward_scorer(spec: str | dict[str, Any]):
    """Score an answer with the reward a recipe entry ``spec`` builds (``{factory: code_execution}``, ...)."""

    reward_func, _ = resolve_reward(spec)

    async def score(state: TaskState, target: Target) -> Score:
        answer = state.output.completion
        value = await score_completion(
            reward_func,
            state.metadata["prompt"],
            [{"role": "assistant", "content": answer}],
            state.metadata["columns"],
        )
        return Score(value=float("nan") if value is None else float(value), answer=answer)

    return score


def reward_task(path: str | Path, name: str, spec: str | dict[str, Any]) -> Task:
    """The held-out prompts of ``path``, answered once each and scored by the reward of ``spec``."""
    return Task(
        dataset=MemoryDataset(reward_samples(path), name=name), solver=generate(), scorer=reward_scorer(spec)
    )
