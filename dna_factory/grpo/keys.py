"""The GRPO stage's own keys (beyond TRL's GRPOConfig) and the reward checks both GRPO variants share.

The async variant (:mod:`dna_factory.async_grpo.stage`) builds on these too, so the sync stage
imports the async one and never the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dna_factory.configuration.config import ResolvedConfig
from dna_factory.configuration.validation import dataset_columns
from dna_factory.errors import DnaConfigError
from dna_factory.grpo.alarms import LearningAlarms
from dna_factory.grpo.answer_formats import check_gold_cells, warn_unasked_answer_formats
from dna_factory.grpo.reward_probe import probe_user_rewards
from dna_factory.grpo.shown_tests import warn_shown_tests
from dna_factory.inputs.row_lengths import PromptLengthArguments
from rewards.registry import check_reward_columns, resolve_rewards


@dataclass
class GRPOStageArguments(PromptLengthArguments):
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
        check_reward_columns(entries, columns)
    check_gold_cells(cfg)
    warn_unasked_answer_formats(cfg)
    warn_shown_tests(cfg)
    probe_user_rewards(cfg)


def learning_alarms(stage_args: GRPOStageArguments, funcs: list) -> LearningAlarms:
    names = [getattr(f, "__name__", None) or type(f).__name__ for f in funcs]
    return LearningAlarms(stage_args.alarm_after_steps, names)
