"""vLLM inside the trainer's process (TRL's ``vllm_mode: colocate``): its engine stops before the process group.

TRL keeps the in-process engine at ``trainer.vllm_generation.llm``. vLLM stops an in-process engine from a
finalizer when the object is collected; at interpreter exit that runs after ``accelerator.end_training()`` has
destroyed the process group that vLLM's tensor-parallel group belongs to, and prints a traceback (``ValueError:
Invalid process group specified``) after a run that succeeded. The runner stops the engine first, with vLLM's own
shutdown (which also detaches that finalizer). ``tests/test_vllm_colocate.py`` is the canary.
"""

from __future__ import annotations

from typing import Any


def stop_colocated_vllm(trainer: Any) -> None:
    """Stop the vLLM engine a TRL trainer runs in its own process, if it has one (no-op otherwise)."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine is not None:
        engine.shutdown()
