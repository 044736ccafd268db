"""Supervised fine-tuning on TRL's SFTTrainer (conversations, prompt/completion or text)."""

from __future__ import annotations

from trl import SFTConfig, SFTTrainer

from dna_factory.stages.base import Stage, StageContext


def build_trainer(ctx: StageContext) -> SFTTrainer:
    return SFTTrainer(**ctx.trainer_kwargs())


STAGE = Stage(
    name="sft", defaults="sft", config_class=SFTConfig, data_format="sft", build_trainer=build_trainer
)
