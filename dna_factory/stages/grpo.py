"""GRPO on TRL's GRPOTrainer, with rewards configured in YAML (``rewards.registry``).

Rows are normalised per S-DATA-3 (``messages`` -> ``prompt`` + ``expected_output``; other
columns such as ``solution`` stay and reach the rewards as keyword arguments; ``label`` is
added). Rewards are resolved from ``reward_funcs`` entries, their weights become TRL's
``reward_weights``. An ``environment`` (``dna_factory.agents``) adds tool-calling rollouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trl import GRPOConfig, GRPOTrainer

from dna_factory.agents.config import AgentArguments, agent_trainer_kwargs, validate_agent
from dna_factory.alarms import LearningAlarms
from dna_factory.completions_log import CompletionsLog
from dna_factory.config import ResolvedConfig
from dna_factory.errors import DnaConfigError
from dna_factory.prompts import warn_unasked_answer_formats
from dna_factory.services import probe_services, wait_for_services
from dna_factory.stages.base import Stage, StageContext
from dna_factory.validation import dataset_columns


@dataclass
class GRPOStageArguments:
    """Keys of the GRPO stage that TRL's GRPOConfig does not have."""

    reward_funcs: list[str | dict] | None = field(
        default=None,
        metadata={
            "help": "Rewards: TRL names (accuracy_reward), module:function paths, or mappings such as "
            "{factory: string_match, extractor: gsm8k, answer_column: answer, weight: 1.0}. See docs/rewards.md."
        },
    )
    grpo_execution: Literal["sync", "async"] = field(
        default="sync",
        metadata={"help": "sync: TRL's GRPOTrainer. async: TRL's AsyncGRPOTrainer (docs/async-grpo.md)."},
    )
    dynamic_sampling: Literal["off", "mask", "resample"] = field(
        default="off",
        metadata={
            "help": "Dead-group handling for sync GRPO: off, mask or resample (docs/dynamic-sampling.md)."
        },
    )
    dynamic_sampling_max_rounds: int = field(
        default=4, metadata={"help": "resample: most extra generation rounds per batch before falling back."}
    )
    alarm_after_steps: int = field(
        default=20,
        metadata={
            "help": "Warn, naming the likely cause, when every reward is None or every group is dead for this "
            "many consecutive steps (docs/grpo.md); 0 turns the alarms off."
        },
    )


def validate_rewards(cfg: ResolvedConfig) -> None:
    from rewards.registry import check_reward_columns, resolve_rewards

    entries = cfg.get("reward_funcs")
    if not entries:
        raise DnaConfigError(
            "GRPO needs at least one reward. Add `reward_funcs:`, e.g. "
            "`- {factory: string_match, extractor: boxed, answer_column: solution}`."
        )
    _, weights = resolve_rewards(entries)
    explicit = cfg.get("reward_weights")
    if explicit is not None and len(explicit) != len(entries):
        raise DnaConfigError(
            f"reward_weights has {len(explicit)} values for {len(entries)} reward_funcs. "
            "Give one weight per reward, or put `weight:` inside each reward_funcs entry instead."
        )
    if explicit is not None and any(w != 1.0 for w in weights):
        raise DnaConfigError(
            "Weights are set both in reward_funcs entries and in reward_weights. Keep one of the two."
        )
    columns = dataset_columns(cfg)
    if columns is not None:
        check_reward_columns(entries, columns | {"prompt", "completion"})
    warn_unasked_answer_formats(cfg)


def select_variant(argv: list[str]) -> Stage:
    """``grpo_execution: async`` (recipe or CLI; the CLI wins) selects the async GRPO stage."""
    from dna_factory.config import peek_value

    mode = peek_value(argv, "grpo_execution")
    if mode == "async":
        from dna_factory.async_grpo import validate_async_environment
        from dna_factory.stages.grpo_async import STAGE as ASYNC_STAGE

        validate_async_environment()

        return ASYNC_STAGE
    return STAGE


def async_only_keys() -> dict[str, str]:
    import dataclasses

    from trl import ModelConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig

    from dna_factory.config import RunArguments
    from dna_factory.stages.grpo_async import AsyncGRPOStageArguments

    accepted = {
        f.name
        for c in (GRPOConfig, ModelConfig, RunArguments, GRPOStageArguments)
        for f in dataclasses.fields(c)
    }
    async_keys = {f.name for c in (AsyncGRPOConfig, AsyncGRPOStageArguments) for f in dataclasses.fields(c)}
    reason = "applies to grpo_execution: async only. Add grpo_execution: async, or remove it."
    return {key: reason for key in async_keys - accepted}


def validate_dynamic_sampling(cfg: ResolvedConfig) -> None:
    if cfg.get("dynamic_sampling", "off") != "resample":
        return
    args = cfg.of(GRPOConfig)
    local = args.per_device_train_batch_size * args.steps_per_generation
    if local % args.num_generations:
        raise DnaConfigError(
            f"dynamic_sampling: resample keeps groups whole on each process, so per_device_train_batch_size "
            f"× steps_per_generation ({local}) must be a multiple of num_generations ({args.num_generations}). "
            "Change per_device_train_batch_size or gradient_accumulation_steps."
        )


def build_trainer(ctx: StageContext) -> GRPOTrainer:
    from rewards.registry import resolve_rewards

    stage_args = ctx.config.of(GRPOStageArguments)
    funcs, weights = resolve_rewards(stage_args.reward_funcs)
    if ctx.training_args.reward_weights is None:
        ctx.training_args.reward_weights = weights
    trainer_cls = GRPOTrainer
    if stage_args.dynamic_sampling != "off":
        from dna_factory.dynamic_sampling import DynamicSamplingGRPOTrainer

        trainer_cls = DynamicSamplingGRPOTrainer
    kwargs = agent_trainer_kwargs(ctx)  # {"tools": [...]} for an agent recipe; updates ctx's datasets
    if trainer_cls is not GRPOTrainer:
        kwargs.update(
            dynamic_sampling=stage_args.dynamic_sampling, max_rounds=stage_args.dynamic_sampling_max_rounds
        )
    ctx.callbacks.append(learning_alarms(stage_args, funcs))
    if ctx.training_args.log_completions:
        ctx.callbacks.append(CompletionsLog(ctx.training_args.output_dir))
    # After agent_trainer_kwargs: it may replace ctx's datasets.
    return trainer_cls(reward_funcs=funcs, **ctx.trainer_kwargs(quantization=False), **kwargs)


def learning_alarms(stage_args: GRPOStageArguments, funcs: list) -> LearningAlarms:
    names = [getattr(f, "__name__", None) or type(f).__name__ for f in funcs]
    return LearningAlarms(stage_args.alarm_after_steps, names)


STAGE = Stage(
    name="grpo",
    defaults="GRPO",
    config_class=GRPOConfig,
    data_format="grpo",
    build_trainer=build_trainer,
    validators=(validate_rewards, validate_dynamic_sampling, validate_agent, probe_services),
    extra_dataclasses=(GRPOStageArguments, AgentArguments),
    variant=select_variant,
    foreign_keys=async_only_keys,
    wait_for_services=wait_for_services,
)
