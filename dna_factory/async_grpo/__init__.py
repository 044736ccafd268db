"""Async GRPO (``grpo_execution: async``): TRL's AsyncGRPOTrainer with a vLLM server doing rollouts.

``preflight.py``       the checks that run before anything loads (launch environment, keys, the server)
``stage.py``           the Stage declaration, its keys and the trainer factory
``trainer.py``         the trainer subclass with exact resume and the prompt stream
``rollout_child.py``   the guards on TRL's rollout child; ``rollout_watchdog.py`` its health watchdog
``weight_sync.py``     file-based weight sync to vLLM (CPU, tests); ``tree_attention.py`` portable SDPA

See docs/async-grpo.md.
"""

from dna_factory.async_grpo.preflight import (
    validate_async_args,
    validate_async_environment,
    validate_completion_length_against_server,
)

__all__ = [
    "validate_async_args",
    "validate_async_environment",
    "validate_completion_length_against_server",
]
