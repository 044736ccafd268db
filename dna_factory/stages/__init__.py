"""Stage registry: each stage is one module that declares a :class:`~dna_factory.stages.base.Stage`.

A one-file stage lives here (``sft.py``, ``dpo.py``); a stage with helpers of its own is a wing
(``dna_factory/grpo/``, ``dna_factory/distill/``) whose ``stage.py`` declares it. Adding a stage
means its module, a line in :data:`~dna_factory.stages.registry.STAGE_MODULES`, a
``configs/_defaults-<stage>.yaml`` and the three-line ``<name>.py`` entry script; the runner (``dna_factory.run.runner``) and the pipeline's
``entry:`` names (``dna_factory.pipeline.recipe.ENTRIES``) follow this table.
"""

# The package's face: it hands the registry's names on (dna_factory/stages/registry.py holds them).
from dna_factory.stages.base import Stage, StageContext
from dna_factory.stages.registry import STAGE_MODULES, VARIANTS, get_stage, select_stage, variant_foreign_keys

__all__ = [
    "STAGE_MODULES",
    "VARIANTS",
    "Stage",
    "StageContext",
    "get_stage",
    "select_stage",
    "variant_foreign_keys",
]
