"""The agent keys of the GRPO stage: what they are, how ``--dry_run`` checks them, what TRL receives.

A GRPO recipe becomes an agent recipe with an ``environment`` and a bound on tool-calling turns::

    environment: search                       # general | coding | search | package.module:Class
    environment_options: {corpus: data/agents/search_corpus.jsonl, top_k: 3}
    tools: [search]                           # optional subset of the environment's tools
    agent_system_prompt: "Use the search tool ... final answer in \\boxed{}."
    max_tool_calling_iterations: 4            # TRL's GRPOConfig key: tool rounds per completion

:func:`validate_agent` runs with the other validators, before anything loads.
:func:`agent_trainer_kwargs` is called by the stage's trainer factory once the tokenizer and
datasets are loaded: it readies the tokenizer (``tool_calls.prepare_tokenizer``), builds the
environment and returns ``{"tools": [...]}`` for ``GRPOTrainer``. Prompts are chats by then
(tools are rendered only into chat prompts): the runner's prompt rule (``dna_factory.inputs.prompts``)
turns string prompts into a user turn after ``agent_system_prompt``, which is the run's
``system_prompt`` under an agent's name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from dna_factory.agents.environment import build_environment, check_environment
from dna_factory.agents.tool_calls import prepare_tokenizer
from dna_factory.configuration.config import ResolvedConfig
from dna_factory.errors import DnaConfigError
from dna_factory.inputs.prompts import validate_prompt_settings

logger = logging.getLogger(__name__)


@dataclass
class AgentArguments:
    """Keys of agentic GRPO (tool-calling rollouts); see docs/agents.md."""

    environment: str | None = field(
        default=None,
        metadata={
            "help": "Tools the model may call during rollouts: general (calculator, convert_units, lookup_fact), "
            "coding (run_python in the sandbox), search (BM25 search), or a package.module:Class Environment. "
            "Needs max_tool_calling_iterations. See docs/agents.md."
        },
    )
    environment_options: dict | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of the environment, e.g. {corpus: data/agents/search_corpus.jsonl, top_k: 3}."
        },
    )
    tools: list[str] | None = field(
        default=None,
        metadata={"help": "Expose only these tools of the environment (default: all of them)."},
    )
    agent_system_prompt: str | None = field(
        default=None,
        metadata={
            "help": "System message put before every prompt that has none (e.g. how to give the final answer)."
        },
    )


def validate_agent(cfg: ResolvedConfig) -> None:
    """The agent keys make sense together; the environment, its options and tools exist.

    Raises:
        DnaConfigError: "what is wrong. what to do."
    """

    agent = cfg.of(AgentArguments)
    if agent.environment is None:
        for key in ("environment_options", "tools", "agent_system_prompt"):
            if getattr(agent, key) is not None:
                raise DnaConfigError(
                    f"{key} is set but no environment is. Add `environment:` (general, coding, search) or remove {key}."
                )
        return
    check_environment(agent.environment, agent.environment_options, agent.tools)
    if agent.agent_system_prompt and cfg.get("system_prompt"):
        raise DnaConfigError(
            "Both system_prompt and agent_system_prompt are set; an agent's prompts have one system turn. "
            "Keep one of the two."
        )
    validate_prompt_settings(cfg, needs_chat=f"environment: {agent.environment} (tool calls)")
    iterations = cfg.get("max_tool_calling_iterations")
    if iterations is None:
        raise DnaConfigError(
            f"environment: {agent.environment} runs tools in a loop, but max_tool_calling_iterations is not set, "
            "so a model that keeps calling tools is stopped only by max_completion_length. "
            "Set max_tool_calling_iterations (e.g. 4)."
        )
    if iterations < 1:
        raise DnaConfigError(
            f"max_tool_calling_iterations is {iterations}, so no tool would ever run. Set it to 1 or more."
        )


def agent_trainer_kwargs(ctx: Any) -> dict[str, Any]:
    """What an agent recipe adds to ``GRPOTrainer(...)``: ``{"tools": [...]}``, or ``{}`` without one.

    Readies ``ctx.tokenizer`` (see the module docstring).

    Args:
        ctx: The stage's :class:`~dna_factory.stages.base.StageContext`.

    Raises:
        DnaConfigError: When the model's chat template cannot carry tool calls.
    """

    agent = ctx.config.of(AgentArguments)
    if agent.environment is None:
        return {}
    prepare_tokenizer(ctx.tokenizer)
    if isinstance(ctx.train_dataset[0]["prompt"], str):
        raise DnaConfigError(
            f"environment: {agent.environment} needs chat prompts, but the prompts are plain strings. "
            "Use prompt_format: auto or chat with a model that has a chat template."
        )
    environment = build_environment(agent.environment, agent.environment_options)
    tools = environment.tools(agent.tools)
    logger.info(
        "Agent environment %s: tools %s, at most %s tool-calling rounds per completion.",
        agent.environment,
        ", ".join(t.__name__ for t in tools),
        ctx.training_args.max_tool_calling_iterations,
    )
    return {"tools": tools}
