"""Async GRPO (``grpo_execution: async``) on TRL's AsyncGRPOTrainer — the variant of the GRPO stage.

Selected when ``grpo_execution: async`` comes from the recipe or ``--grpo_execution async`` (the
CLI wins); layered over ``configs/_defaults-async_grpo.yaml`` instead of the sync defaults.
Everything the topology cannot run is rejected by ``dna_factory.async_grpo.preflight`` before anything
loads (also under ``--dry_run``).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Literal

from trl.experimental.async_grpo import AsyncGRPOConfig

from dna_factory.agents.config import AgentArguments
from dna_factory.async_grpo.preflight import (
    MAX_MODEL_LEN,
    setup_async_training_args,
    validate_async_environment,
    wait_for_server,
)
from dna_factory.async_grpo.rollout_watchdog import WatchdogTimeouts
from dna_factory.async_grpo.weight_sync import FileWeightTransfer
from dna_factory.configuration.config import ResolvedConfig
from dna_factory.errors import DnaConfigError, DnaServiceError
from dna_factory.grpo.keys import GRPOStageArguments, learning_alarms, validate_rewards
from dna_factory.inputs.prompts import validate_prompt_settings
from dna_factory.serving.services import probe_services
from dna_factory.serving.vllm_server import cuda_available, share_cores_with
from dna_factory.stages.base import Stage, StageContext
from rewards.registry import resolve_rewards

logger = logging.getLogger(__name__)


@dataclass
class AsyncGRPOStageArguments(GRPOStageArguments):
    """Keys of async GRPO beyond TRL's AsyncGRPOConfig."""

    tree_attention: Literal["fa3", "sdpa"] = field(
        default="fa3",
        metadata={
            "help": "Attention kernel for packed rows: fa3 (TRL's FlashAttention-3, NVIDIA GPUs with FA3) or sdpa "
            "(portable: CPU and any GPU; O(N^2) mask memory per row)."
        },
    )
    weight_sync: Literal["nccl", "file"] = field(
        default="nccl",
        metadata={
            "help": "How new weights reach vLLM: nccl (TRL, GPUs) or file (safetensors + vLLM reload_weights; CPU, "
            "tests). See docs/async-grpo.md."
        },
    )
    weight_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "weight_sync: file: directory the server reads (default <output_dir>/.vllm_weights)."
        },
    )
    server_down_after_s: float = field(
        default=60.0,
        metadata={
            "help": "During training: how long the vLLM server may fail /health before the run ends with one "
            "error line. A shorter outage is ridden out (the rollout child's request retries wait for it) and "
            "forgotten once /health answers again."
        },
    )
    server_probe_interval_s: float = field(
        default=10.0,
        metadata={"help": "During training: how often the watchdog asks the vLLM server's /health."},
    )
    rollout_stop_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": "At the end of training: the longest wait for the rollout worker's child to stop before it is "
            "killed."
        },
    )


def agent_keys() -> dict[str, str]:
    """The agent RL keys, which only the synchronous trainer runs (the other sync-only keys come from the stage
    registry, :func:`dna_factory.stages.variant_foreign_keys`)."""
    accepted = {f.name for cls in (AsyncGRPOConfig, AsyncGRPOStageArguments) for f in dataclasses.fields(cls)}
    reason = (
        "is an agent RL key: agent stages run on the synchronous GRPO trainer (TRL's tool loop), which "
        "the async trainer does not have. Run with --grpo_execution sync, or remove it."
    )
    return {f.name: reason for f in dataclasses.fields(AgentArguments) if f.init and f.name not in accepted}


check_environment = validate_async_environment
"""Run by the stage registry when ``grpo_execution: async`` picks this stage: the packages async GRPO needs."""


ASYNC_NEEDS_CHAT = "Async GRPO (TRL's rollout worker reads every prompt as a list of chat messages)"


WATCHDOG_KEYS = (
    "heartbeat_stale_after_s",
    "server_down_after_s",
    "server_probe_interval_s",
    "rollout_stop_timeout_s",
)


def validate_async(cfg: ResolvedConfig) -> None:
    for key in (*WATCHDOG_KEYS, "weight_sync_timeout"):
        value = cfg.get(key)
        if value is not None and not (isinstance(value, int | float) and value > 0):
            raise DnaConfigError(f"{key} is {value!r}; it must be a number of seconds > 0.")
    validate_prompt_settings(cfg, needs_chat=ASYNC_NEEDS_CHAT)
    setup_async_training_args(cfg)


def build_trainer(ctx: StageContext):
    # Deferred, not for a cycle: importing the trainer patches TRL's rollout child (rollout_child.py),
    # which only an async run should do.
    from dna_factory.async_grpo.trainer import DnaAsyncGRPOTrainer, prompt_stream

    args = ctx.training_args
    stage_args = ctx.config.of(AsyncGRPOStageArguments)
    funcs, _ = resolve_rewards(stage_args.reward_funcs)
    train_dataset = ctx.train_dataset
    if isinstance(train_dataset[0]["prompt"], str):  # the worker would split the string into characters
        raise DnaConfigError(
            f"{ASYNC_NEEDS_CHAT}, but the prompts are plain strings. Use prompt_format: auto or chat with a "
            "model that has a chat template."
        )
    max_model_len = ctx.config.services.get(MAX_MODEL_LEN)
    if max_model_len is None:  # wait_for_server reads it before the data loads: never train unmeasured rows
        raise DnaServiceError(
            f"The vLLM server's max_model_len was not read before the data loaded ({args.vllm_server_base_url}); "
            "the prompts cannot be checked against it. Run through the stage's runner (python grpo.py), "
            "which waits for the server first."
        )
    weight_transfer = None
    if stage_args.weight_sync == "file":
        from transformers import AutoConfig  # deferred with the trainer (heavy)

        model_config = AutoConfig.from_pretrained(ctx.model_args.model_name_or_path)
        weight_transfer = FileWeightTransfer(
            args.vllm_server_base_url,
            stage_args.weight_sync_dir or f"{args.output_dir}/.vllm_weights",
            config_dir=ctx.model_args.model_name_or_path,
            tie_word_embeddings=bool(getattr(model_config, "tie_word_embeddings", False)),
            timeout_s=float(args.weight_sync_timeout),  # TRL's key: the NCCL sync's bound, here the reload's
        )
    stream = prompt_stream(
        train_dataset, max_model_len=max_model_len, max_completion_length=args.max_completion_length
    )
    # the rollout worker keeps the server generating all through training
    share_cores_with(
        args.vllm_server_base_url, args.use_cpu or not cuda_available(), "async GRPO's generation"
    )
    ctx.callbacks.append(learning_alarms(stage_args, funcs))
    return DnaAsyncGRPOTrainer(
        model=ctx.model_args.model_name_or_path,
        reward_funcs=funcs,
        args=args,
        train_dataset=train_dataset,
        processing_class=ctx.tokenizer,
        callbacks=ctx.callbacks,
        weight_transfer=weight_transfer,
        tree_attention=stage_args.tree_attention,
        prompt_stream=stream,
        watchdog_timeouts=WatchdogTimeouts(
            grace_s=args.heartbeat_stale_after_s,
            server_down_s=stage_args.server_down_after_s,
            probe_s=stage_args.server_probe_interval_s,
            stop_s=stage_args.rollout_stop_timeout_s,
        ),
    )


STAGE = Stage(
    name="grpo",
    defaults="async_grpo",
    config_class=AsyncGRPOConfig,
    data_format="grpo",
    build_trainer=build_trainer,
    validators=(validate_async, validate_rewards, probe_services),
    extra_dataclasses=(AsyncGRPOStageArguments,),
    foreign_keys=agent_keys,
    wait_for_services=wait_for_server,
)
