"""Stage registry: each stage is one module that declares a :class:`~dna_factory.stages.base.Stage`.

A one-file stage lives here (``sft.py``, ``dpo.py``); a stage with helpers of its own is a wing
(``dna_factory/grpo/``, ``dna_factory/distill/``) whose ``stage.py`` declares it. Adding a stage
means its module, a line in :data:`STAGE_MODULES`, a ``configs/_defaults-<stage>.yaml`` and the
three-line ``<name>.py`` entry script; the runner (``dna_factory.runner``) and the pipeline's
``entry:`` names (``dna_factory.pipeline_recipe.ENTRIES``) follow this table.
"""

from __future__ import annotations

import importlib

from dna_factory.stages.base import Stage, StageContext

STAGE_MODULES = {
    "sft": "dna_factory.stages.sft",
    "dpo": "dna_factory.stages.dpo",
    "grpo": "dna_factory.grpo.stage",
    "distill": "dna_factory.distill.stage",
}


def get_stage(name: str) -> Stage:
    """The Stage object declared by the module :data:`STAGE_MODULES` names for ``name``."""
    if name not in STAGE_MODULES:
        raise KeyError(f"Unknown stage {name!r}; known: {', '.join(STAGE_MODULES)}")
    return importlib.import_module(STAGE_MODULES[name]).STAGE


__all__ = ["STAGE_MODULES", "Stage", "StageContext", "get_stage"]
