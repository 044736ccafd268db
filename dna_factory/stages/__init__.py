"""Stage registry: each stage is one module that declares a :class:`~dna_factory.stages.base.Stage`.

Adding a stage means adding a module here and a ``configs/_defaults-<Stage>.yaml``; the
runner (``dna_factory.runner``) is shared by all of them.
"""

from __future__ import annotations

import importlib

from dna_factory.stages.base import Stage, StageContext

STAGE_MODULES = {
    "sft": "dna_factory.stages.sft",
    "dpo": "dna_factory.stages.dpo",
    "grpo": "dna_factory.stages.grpo",
    "distill": "dna_factory.stages.distill",
}


def get_stage(name: str) -> Stage:
    """The Stage object declared by ``dna_factory.stages.<name>``."""
    if name not in STAGE_MODULES:
        raise KeyError(f"Unknown stage {name!r}; known: {', '.join(STAGE_MODULES)}")
    return importlib.import_module(STAGE_MODULES[name]).STAGE


__all__ = ["STAGE_MODULES", "Stage", "StageContext", "get_stage"]
