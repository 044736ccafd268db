"""vLLM inside the trainer's process (TRL's ``vllm_mode: colocate``): its engine is stopped before the trainer ends.

TRL keeps the in-process engine at ``trainer.vllm_generation.llm``. vLLM stops an in-process engine from a
finalizer when the object is collected; at interpreter exit that runs after ``accelerator.end_training()`` has
destroyed the process group that vLLM's tensor-parallel group belongs to, and prints a traceback (``ValueError:
Invalid process group specified``) after a run that succeeded. The runner stops the engine first, with vLLM's own
shutdown, which also detaches that finalizer and tears down the distributed state vLLM set up (the default process
group included: ``accelerator.end_training()`` then finds none to destroy). ``tests/test_vllm_colocate.py`` is the
canary.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def stop_colocated_vllm(trainer: Any) -> None:
    """Stop the vLLM engine a TRL trainer runs in its own process, if it has one (no-op otherwise). The model and
    the run's summary are saved by then: a failure here is a warning, not a failed run."""
    llm = getattr(getattr(trainer, "vllm_generation", None), "llm", None)
    engine = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine is None:
        return
    try:
        engine.shutdown()
    except Exception as exc:  # noqa: BLE001 - reported; what the run produced is already on disk
        logger.warning("Stopping the colocated vLLM engine failed (%s); the run's outputs are saved.", exc)
