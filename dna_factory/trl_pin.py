"""The TRL version dna-factory is written against, and every place that touches TRL's private API.

Each :class:`TouchPoint` names the module, what of TRL it relies on beyond the public API, and the canary
test that fails when TRL changes it. To move to another TRL: set :data:`TRL_VERSION`, run the canaries
(``pytest -k canary``) and fix what they name; ``tests/test_trl_pin.py`` fails first if the installed TRL
is another version, if a touch point's module or canary is gone, or if a module defines its own version.
"""

from __future__ import annotations

from dataclasses import dataclass

TRL_VERSION = "1.16.0"


@dataclass(frozen=True)
class TouchPoint:
    module: str
    uses: str
    canary: str


TOUCH_POINTS = (
    TouchPoint(
        "dna_factory/grpo/dynamic_sampling.py",
        "GRPOTrainer._calculate_rewards, _generate_and_score_completions, _prepare_inputs (overridden, each "
        "calls super()), _compute_loss's inputs['num_items_in_batch'], trl.trainer.utils.RepeatSampler and "
        "nanstd, and the attributes _metrics, _tokenizer, reward_weights, num_generations, beta, "
        "_entropy_bonus_enabled, aux_loss_enabled, multi_objective_aggregation, shuffle_dataset",
        "tests/test_dynamic_sampling.py::test_trl_canary",
    ),
    TouchPoint(
        "dna_factory/distill/trainers.py",
        "DistillationTrainer._generate_and_score_completions (overridden; its output keys), _metrics, "
        "_compute_loss (overridden, falls back to super()), _get_last_hidden_state, _forward_redirection, "
        "beta, temperature, teacher_model, trl.trainer.utils.add_fused_lm_head (log_probs shifted by one) and "
        "maybe_gather_lm_head_ctx",
        "tests/test_distill.py::test_trl_canary",
    ),
    TouchPoint(
        "dna_factory/distill/teacher_server.py",
        "VLLMClient.get_sequence_logprobs's actual_logprobs, the client's session set in __init__",
        "tests/test_distill.py::test_trl_canary",
    ),
    TouchPoint(
        "dna_factory/async_grpo/trainer.py",
        "AsyncGRPOTrainer._inner_training_loop, _save_checkpoint, _log_step_metrics, _sync_weight, get_train_dataloader "
        "(RolloutQueueDataset reads rollout_queue), the worker's _loop_kwargs and prompt numbering",
        "tests/test_async_grpo.py::test_trl_async_canary",
    ),
    TouchPoint(
        "dna_factory/async_grpo/trainer.py",
        "the rollout worker's group numbering and the queue dataset's reads (exact resume)",
        "tests/test_async_grpo.py::test_trl_rollout_numbering_and_queue_reads_canary",
    ),
    TouchPoint(
        "dna_factory/async_grpo/weight_sync.py",
        "_TrainBeginCallback's cold weight sync before the rollout worker starts, and pause() before resume() "
        "in _sync_weight_merged/_sync_weight_lora (a server left paused is resumed by the next run)",
        "tests/test_async_grpo.py::test_trl_cold_sync_comes_before_the_rollout_worker_canary",
    ),
    TouchPoint(
        "dna_factory/async_grpo/rollout_watchdog.py",
        "AsyncRolloutWorker._process, _failed_event, _exception_info_queue, _loop_kwargs['vllm_server_url'], "
        "check_health and stop (replaced on the instance)",
        "tests/test_async_grpo.py::test_trl_rollout_worker_watchdog_canary",
    ),
    TouchPoint(
        "dna_factory/async_grpo/rollout_child.py",
        "trl.chat_template_utils.parse_response's plain-text fallback and the rollout loop class hook",
        "tests/test_rollout_child.py::test_trl_canary_parse_response_and_the_loop_class_hook",
    ),
    TouchPoint(
        "dna_factory/agents/tool_calls.py",
        "parse_response(ids, prefix=..., tools=...) and GRPOTrainer._tool_call_loop's handling of tool errors",
        "tests/test_agents.py::test_trl_canary",
    ),
    TouchPoint(
        "dna_factory/eval/agent_task.py",
        "GRPOTrainer._get_tool_suffix_ids on a stand-in holding the five attributes it reads, and the tool loop's "
        "rules the eval repeats (prompt + completion + suffix ids, the max_completion_length drop, the training "
        "chat template where the model's is not prefix-preserving)",
        "tests/test_agent_eval.py::test_trl_canary_tool_suffix_and_the_tool_loop",
    ),
    TouchPoint(
        "dna_factory/filter/tool.py",
        "trl.trainer.utils.is_async_callable, which GRPOTrainer uses to tell async reward functions (awaited) "
        "from sync ones; the filter calls rewards the same way",
        "tests/test_filter_tasks.py::test_trl_canary_is_async_callable",
    ),
    TouchPoint(
        "dna_factory/serving/colocate.py",
        "GRPOTrainer.vllm_generation.llm (TRL's colocated vLLM engine), stopped before the process group",
        "tests/test_vllm_colocate.py::test_colocated_vllm_samples_with_the_weights_just_trained_and_ends_cleanly",
    ),
    TouchPoint(
        "dna_factory/inputs/preview.py",
        "SFTTrainer._prepare_dataset on a stand-in holding the three attributes TRL reads",
        "tests/test_preview.py::test_canary_sft_preview_tokenizes_exactly_as_a_real_sft_trainer",
    ),
)
"""Every private TRL touch, in the order a reader meets the features (docs/dynamic-sampling.md lists them too)."""
