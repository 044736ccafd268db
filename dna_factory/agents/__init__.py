"""Agentic RL: tool-calling rollouts for the General, Coding and Search Agent stages (docs/agents.md).

TRL 1.16's GRPOTrainer runs the multi-turn tool loop; this package supplies what it calls and
keeps the loop robust:

=================== ==========================================================================
``config``          the recipe keys (``environment``, ``environment_options``, ``tools``,
                    ``agent_system_prompt``), their ``--dry_run`` checks, and the ``tools=``
                    handed to ``GRPOTrainer``
``environment``     the :class:`Environment` base class, the ``@tool`` marker and the registry
``tool_calls``      response parsing (content / ``<think>`` / ``<tool_call>``) and turning
                    malformed calls and tool exceptions into tool messages
``general``         calculator, unit conversion, fact lookup
``coding``          Python execution in the sandbox of ``rewards.sandbox``
``search``          BM25 search (``bm25s``) over a local or Hub corpus
=================== ==========================================================================
"""

from dna_factory.agents.config import AgentArguments, agent_trainer_kwargs, validate_agent
from dna_factory.agents.environment import (
    ENVIRONMENTS,
    Environment,
    build_environment,
    check_environment,
    tool,
)

__all__ = [
    "ENVIRONMENTS",
    "AgentArguments",
    "Environment",
    "agent_trainer_kwargs",
    "build_environment",
    "check_environment",
    "tool",
    "validate_agent",
]
