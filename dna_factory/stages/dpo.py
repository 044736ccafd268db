"""Direct preference optimisation on TRL's DPOTrainer (prompt, chosen, rejected).

Without LoRA, TRL builds the frozen reference model from ``model_name_or_path``; with
LoRA the reference is the base model with the adapter disabled.
"""

from __future__ import annotations

from trl import DPOConfig, DPOTrainer

from dna_factory.stages.base import Stage, StageContext


def build_trainer(ctx: StageContext) -> DPOTrainer:
    return DPOTrainer(
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
    name="dpo", defaults="DPO", config_class=DPOConfig, data_format="dpo", build_trainer=build_trainer
)
