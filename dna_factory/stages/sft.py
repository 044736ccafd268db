"""Supervised fine-tuning on TRL's SFTTrainer (conversations, prompt/completion or text)."""

from __future__ import annotations

from trl import SFTConfig, SFTTrainer

from dna_factory.stages.base import Stage, StageContext


def build_trainer(ctx: StageContext) -> SFTTrainer:
    return SFTTrainer(
        model=ctx.model_args.model_name_or_path,
        args=ctx.training_args,
        train_dataset=ctx.train_dataset,
        eval_dataset=ctx.eval_dataset,
        processing_class=ctx.tokenizer,
        peft_config=ctx.peft_config,
        quantization_config=ctx.quantization_config,
        callbacks=ctx.callbacks,
    )


STAGE = Stage(
    name="sft", defaults="SFT", config_class=SFTConfig, data_format="sft", build_trainer=build_trainer
)
