"""GRPO on TRL's GRPOTrainer, with rewards configured in YAML (``rewards.registry``).

Rows are normalised per S-DATA-3 (``messages`` -> ``prompt`` + ``expected_output``; other
columns such as ``solution`` stay and reach the rewards as keyword arguments; ``label`` is
added). Rewards are resolved from ``reward_funcs`` entries, their weights become TRL's
``reward_weights``. An ``environment`` (``dna_factory.agents``) adds tool-calling rollouts.
"""

from __future__ import annotations

from trl import GRPOConfig, GRPOTrainer

from dna_factory.agents.config import AgentArguments, agent_trainer_kwargs, validate_agent
from dna_factory.configuration.config import ResolvedConfig
from dna_factory.errors import DnaConfigError
from dna_factory.grpo.completions_log import CompletionsLog
from dna_factory.grpo.dynamic_sampling import DynamicSamplingGRPOTrainer
from dna_factory.grpo.keys import GRPOStageArguments, learning_alarms, validate_rewards
from dna_factory.serving.services import probe_services, wait_for_services
from dna_factory.stages.base import Stage, StageContext
from rewards.registry import resolve_rewards


def validate_dynamic_sampling(cfg: ResolvedConfig) -> None:
    if cfg.get("dynamic_sampling", "off") != "resample":
        return
    args = cfg.of(GRPOConfig)
    if {True: "group", False: "none"}.get(args.scale_rewards, args.scale_rewards) == "batch":
        raise DnaConfigError(
            "dynamic_sampling: resample scores each generation round on its own, so scale_rewards: batch would "
            "divide each round's advantages by that round's reward spread, not the optimizer batch's. Use "
            "scale_rewards: group (TRL's default: each group by its own spread, the same in any round) or none, "
            "or dynamic_sampling: mask."
        )
    local = args.per_device_train_batch_size * args.steps_per_generation
    if local % args.num_generations:
        raise DnaConfigError(
            f"dynamic_sampling: resample keeps groups whole on each process, so per_device_train_batch_size "
            f"× steps_per_generation ({local}) must be a multiple of num_generations ({args.num_generations}). "
            "Change per_device_train_batch_size or gradient_accumulation_steps."
        )


def build_trainer(ctx: StageContext) -> GRPOTrainer:
    stage_args = ctx.config.of(GRPOStageArguments)
    funcs, weights = resolve_rewards(stage_args.reward_funcs)
    if ctx.training_args.reward_weights is None:
        ctx.training_args.reward_weights = weights
    trainer_cls = GRPOTrainer
    if stage_args.dynamic_sampling != "off":
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


STAGE = Stage(
    name="grpo",
    defaults="grpo",
    config_class=GRPOConfig,
    data_format="grpo",
    build_trainer=build_trainer,
    validators=(validate_rewards, validate_dynamic_sampling, validate_agent, probe_services),
    extra_dataclasses=(GRPOStageArguments, AgentArguments),
    wait_for_services=wait_for_services,
)
