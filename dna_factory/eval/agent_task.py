"""Eval tasks for the agent families: each held-out prompt played as one tool-calling episode, as training plays it.

A GRPO agent stage rolls out in TRL's tool loop (``GRPOTrainer._tool_call_loop``): the prompt is rendered with
the tools' schemas by the model's chat template, the model generates a turn, the turn is parsed
(``trl.chat_template_utils.parse_response``, through our :class:`~dna_factory.agents.tool_calls.ToolCallParser`),
its tool calls run, the tool results are appended as token ids (``GRPOTrainer._get_tool_suffix_ids``), and the
model continues, for at most ``max_tool_calling_iterations`` rounds and ``max_completion_length`` tokens in all.
The reward then scores the whole episode once (the completion is the list of its messages).

:func:`agent_task` plays each held-out prompt the same way against the eval server, through its token-level
``/v1/completions`` API (a chat API would re-render the conversation and parse tool calls its own way): the
same template, parser, tool suffix (TRL's own method, called on this task's tokenizer), tools of the same
environment and the same bounds. The reward of the stage's ``reward_funcs`` entry scores the episode once.
The metrics are ``reward`` (the mean; an abstention is left out, as in
:mod:`dna_factory.eval.reward_task`), ``tool_call_rate`` (the share of episodes that called a tool) and
``turns`` (assistant turns per episode): the behaviour that RL changes.

The harness (:mod:`dna_factory.eval.harness`) tells the task where the model is served and where its
tokenizer lies through the environment variable ``DNA_EVAL_SERVED`` (JSON: ``base_url``, ``model``,
``model_dir``, ``temperature``), which it sets from its own command line.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from inspect_ai import Task
from inspect_ai.dataset import MemoryDataset
from inspect_ai.model import ModelOutput
from inspect_ai.scorer import Metric, SampleScore, Score, Target, metric, scorer
from inspect_ai.solver import Generate, TaskState, solver

from dna_factory.agents.environment import build_environment
from dna_factory.agents.tool_calls import prepare_tokenizer
from dna_factory.eval.harness import SERVED_ENV
from dna_factory.eval.reward_task import abstained, reward, reward_samples, score_completion
from rewards.registry import resolve_reward


@dataclass(frozen=True)
class AgentSpec:
    """The agent keys of the stage whose held-out split this is (the recipe's values; a test keeps them alike)."""

    environment: str
    tools: tuple[str, ...]
    max_tool_calling_iterations: int
    max_completion_length: int
    environment_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Served:
    base_url: str
    model: str
    model_dir: str
    temperature: float | None = None

    @classmethod
    def from_environment(cls) -> Served:
        text = os.environ.get(SERVED_ENV)
        if not text:
            raise RuntimeError(
                f"An agent eval task needs {SERVED_ENV} (the served model and its tokenizer's directory); the "
                "dna-factory eval harness sets it from --model-dir. Run it through eval_tasks or "
                "python -m dna_factory.eval.harness ... --model-dir DIR."
            )
        return cls(**json.loads(text))


class Episode:
    """What one agent episode needs that is the same for every sample: tokenizer, tools, TRL's tool suffix."""

    def __init__(self, served: Served, spec: AgentSpec) -> None:
        from openai import AsyncOpenAI  # the eval's only client; deferred with the tokenizer's transformers
        from transformers import AutoTokenizer
        from transformers.utils import get_json_schema
        from trl import GRPOTrainer
        from trl.chat_template_utils import get_training_chat_template, is_chat_template_prefix_preserving

        self.served, self.spec = served, spec
        self.tokenizer = AutoTokenizer.from_pretrained(served.model_dir)
        prepare_tokenizer(self.tokenizer)  # the response parser training used
        # as GRPOTrainer.__init__ with tools: a template that is not prefix-preserving (Qwen3's drops the empty
        # <think> block of an earlier turn) is replaced by TRL's training template, for prompts and tool results
        self.chat_template = (
            None
            if is_chat_template_prefix_preserving(self.tokenizer)
            else get_training_chat_template(self.tokenizer)
        )
        environment = build_environment(spec.environment, spec.environment_options)
        self.tools = {tool.__name__: tool for tool in environment.tools(list(spec.tools))}
        self.schemas = [get_json_schema(tool) for tool in self.tools.values()]
        # TRL's own method on a stand-in trainer: the tool results' token ids exactly as training appends them
        self._suffix_owner = SimpleNamespace(
            processing_class=self.tokenizer,
            _tokenizer=self.tokenizer,
            chat_template=self.chat_template,
            chat_template_kwargs={},
            _is_vlm=False,
        )
        self._suffix = GRPOTrainer._get_tool_suffix_ids
        self.client = AsyncOpenAI(base_url=served.base_url, api_key=os.environ.get("DNA_API_KEY", "local"))

    def tool_suffix_ids(self, tool_messages: list[dict]) -> list[int]:
        return self._suffix(self._suffix_owner, tool_messages)

    async def generate(self, ids: list[int], max_tokens: int) -> list[int]:
        """One turn's token ids, from ``ids`` on (the server's stop at end of turn included)."""
        extra: dict[str, Any] = {"skip_special_tokens": False, "return_token_ids": True}
        response = await self.client.completions.create(
            model=self.served.model,
            prompt=ids,
            max_tokens=max_tokens,
            temperature=self.served.temperature if self.served.temperature is not None else 1.0,
            extra_body=extra,
        )
        choice = response.choices[0]
        token_ids = (choice.model_extra or {}).get("token_ids")
        if token_ids is None:
            raise RuntimeError(
                "The eval server returned no token_ids for a completion (vLLM's return_token_ids); an agent eval "
                "needs a vLLM server that supports it."
            )
        return list(token_ids)

    async def call_tools(self, calls: list[dict]) -> list[dict]:
        """Run one turn's tool calls as ``GRPOTrainer._tool_call_loop`` does: an error is the tool's result."""
        messages = []
        for call in calls:
            function = call.get("function", {})
            name = function.get("name", "unknown")
            try:
                if call.get("type") != "function":
                    raise ValueError(f"Unsupported tool call type: {call.get('type')}")
                if name not in self.tools:
                    raise ValueError(f"Tool {name} not found.")
                result = self.tools[name](**function.get("arguments", {}))
                if inspect.isawaitable(result):
                    result = await result
            except Exception as exc:  # noqa: BLE001 - as TRL's loop: the model reads the error
                result = {"error": str(exc)}
            messages.append({"role": "tool", "name": name, "content": str(result)})
        return messages

    async def play(self, prompt: list[dict]) -> list[dict]:
        """One episode: the completion as a list of messages (assistant turns and tool results)."""
        from trl.chat_template_utils import parse_response

        prompt_ids = self.tokenizer.apply_chat_template(
            prompt,
            tools=self.schemas,
            chat_template=self.chat_template,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        budget = self.spec.max_completion_length
        completion_ids: list[int] = []
        completion: list[dict] = []
        for turn in range(self.spec.max_tool_calling_iterations + 1):
            ids = await self.generate(prompt_ids + completion_ids, budget - len(completion_ids))
            message = parse_response(
                self.tokenizer, ids, prefix=prompt_ids + completion_ids, tools=self.schemas
            )
            completion_ids += ids
            completion.append(message)
            calls = message.get("tool_calls")
            if not calls or turn == self.spec.max_tool_calling_iterations:
                break
            results = await self.call_tools(calls)
            suffix = self.tool_suffix_ids(results)
            if len(completion_ids) + len(suffix) > budget:
                break  # as TRL: results that would pass the completion budget are dropped, the episode ends
            completion += results
            completion_ids += suffix
            if len(completion_ids) == budget:
                break  # no token left for the next turn
        return completion


_EPISODES: dict[int, Episode] = {}
_EPISODES_LOCK = threading.Lock()


def episode_for(spec: AgentSpec) -> Episode:
    """One :class:`Episode` per spec in this process (the tokenizer and tools load once)."""
    with _EPISODES_LOCK:
        if id(spec) not in _EPISODES:
            _EPISODES[id(spec)] = Episode(Served.from_environment(), spec)
        return _EPISODES[id(spec)]


@solver
def play_episode(spec: AgentSpec):
    """Play the sample's prompt as one agent episode (see :class:`Episode`)."""

    async def solve(state: TaskState, generate: Generate) -> TaskState:
        episode = await asyncio.to_thread(episode_for, spec)
        completion = await episode.play(state.metadata["prompt"])
        state.metadata["completion"] = completion
        final = next((m.get("content") or "" for m in reversed(completion) if m["role"] == "assistant"), "")
        state.output = ModelOutput.from_content(model=episode.served.model, content=final)
        return state

    return solve


@metric
def tool_call_rate() -> Metric:
    """The share of episodes that called at least one tool."""

    def compute(scores: list[SampleScore]) -> float:
        return sum(bool((s.score.metadata or {}).get("tool_calls")) for s in scores) / max(len(scores), 1)

    return compute


@metric
def turns() -> Metric:
    """Assistant turns per episode (1: answered without a tool)."""

    def compute(scores: list[SampleScore]) -> float:
        return sum((s.score.metadata or {}).get("turns", 0) for s in scores) / max(len(scores), 1)

    return compute


@scorer(metrics=[reward(), abstained(), tool_call_rate(), turns()])
def episode_scorer(spec: str | dict[str, Any]):
    """Score the whole episode once with the reward a recipe entry ``spec`` builds."""

    reward_func, _ = resolve_reward(spec)

    async def score(state: TaskState, target: Target) -> Score:
        completion = state.metadata["completion"]
        value = await score_completion(
            reward_func, state.metadata["prompt"], completion, state.metadata["columns"]
        )
        assistant = [m for m in completion if m["role"] == "assistant"]
        return Score(
            value=float("nan") if value is None else float(value),
            answer=state.output.completion,
            metadata={
                "turns": len(assistant),
                "tool_calls": sum(len(m.get("tool_calls") or []) for m in assistant),
            },
        )

    return score


def agent_task(path: str | Path, name: str, spec: str | dict[str, Any], agent: AgentSpec) -> Task:
    """The held-out prompts of ``path``, each played as one episode of ``agent`` and scored by ``spec``'s reward."""
    return Task(
        dataset=MemoryDataset(reward_samples(path), name=name),
        solver=play_episode(agent),
        scorer=episode_scorer(spec),
    )
