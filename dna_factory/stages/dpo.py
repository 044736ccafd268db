"""Direct preference optimisation on TRL's DPOTrainer (prompt, chosen, rejected).

Without LoRA, TRL builds the frozen reference model from ``model_name_or_path``; with
LoRA the reference is the base model with the adapter disabled.
"""

from __future__ import annotations

from trl import DPOConfig, DPOTrainer

from dna_factory.stages.base import Stage, StageContext


def build_trainer(ctx: StageContext) -> DPOTrainer:
    return DPOTrainer(**ctx.trainer_kwargs())


STAGE = Stage(
    name="dpo", defaults="dpo", config_class=DPOConfig, data_format="dpo", build_trainer=build_trainer
)
