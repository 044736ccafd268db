"""Fail-fast checks for async GRPO (S-ASYNC-2, S-ASYNC-3), run before any tokenizer, dataset or model load.

Async GRPO (TRL's AsyncGRPOTrainer) decouples generation from optimisation: one training
process on its own GPU and an external vLLM server on other GPUs, joined by a rollout queue
with bounded staleness. Whatever that topology cannot do is rejected here, each with its own
message, so a misconfigured run ends in seconds instead of minutes into a model load — or,
for an over-long completion, instead of 30 retried HTTP 400s and an opaque
``RuntimeError: AsyncRolloutWorker child exited during init`` (S-ASYNC-7).
"""

from __future__ import annotations

import json
import logging
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

from dna_factory.configuration.config import ResolvedConfig
from dna_factory.errors import DnaConfigError, DnaServiceError
from dna_factory.inputs.row_lengths import SERVER_MAX_MODEL_LEN
from dna_factory.serving.services import server_root, wait_for_services

logger = logging.getLogger(__name__)

ONE_GPU = (
    "AsyncGRPO supports one training GPU only, without DeepSpeed or FSDP. "
    "Run python grpo.py on one GPU and vllm serve on separate GPUs."
)
SERVER_RETRIES = 3
SERVER_RETRY_DELAY_S = 1.0
SERVER_TIMEOUT_S = 2.0


def _truthy(value: str | None) -> bool:
    return str(value or "").lower() in ("1", "true", "yes")


def _visible_gpu_count() -> int:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # torch without CUDA support reports nothing useful; treat as none
        return 0


def validate_async_environment() -> None:
    """The launch-environment half of S-ASYNC-2; runs before any config object is built.

    (Building transformers' TrainingArguments under WORLD_SIZE=2 would already try to join a process group.)
    """
    if _truthy(os.environ.get("ACCELERATE_USE_DEEPSPEED")):
        raise DnaConfigError(f"DeepSpeed is configured (ACCELERATE_USE_DEEPSPEED). {ONE_GPU}")
    if _truthy(os.environ.get("ACCELERATE_USE_FSDP")):
        raise DnaConfigError(f"FSDP is configured (ACCELERATE_USE_FSDP). {ONE_GPU}")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size != 1:
        raise DnaConfigError(
            f"WORLD_SIZE={world_size}: more than one training process. {ONE_GPU} "
            "Launch with plain python, not accelerate launch or torchrun."
        )
    if _visible_gpu_count() > 1:
        raise DnaConfigError(
            f"{_visible_gpu_count()} GPUs are visible to the trainer. {ONE_GPU} "
            "Set CUDA_VISIBLE_DEVICES to one GPU for the trainer (the server gets its own)."
        )


def _checkpoint_quantisation(model: str | None) -> str | None:
    """The ``quant_method`` of a local checkpoint whose config.json carries ``quantization_config``, else None."""
    config = Path(str(model or "")) / "config.json"
    if not config.is_file():
        return None
    try:
        quantization = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError):
        return None
    if not quantization:
        return None
    return (
        str(quantization.get("quant_method", "quantization_config"))
        if isinstance(quantization, dict)
        else "yes"
    )


def validate_async_args(cfg: ResolvedConfig) -> None:
    """Reject what AsyncGRPO cannot run (S-ASYNC-2). Pure over the config and the launch environment."""
    validate_async_environment()
    get = cfg.get
    if get("deepspeed"):
        raise DnaConfigError(f"DeepSpeed is configured. {ONE_GPU}")
    if get("fsdp"):
        raise DnaConfigError(f"FSDP is configured. {ONE_GPU}")
    if str(get("eval_strategy", "no")) != "no" or get("do_eval") or get("eval_datasets"):
        raise DnaConfigError(
            "AsyncGRPO does not run evaluation: the rollout queue serves training only. "
            "Remove eval_strategy / eval_datasets and evaluate saved checkpoints separately (eval_on_checkpoint)."
        )
    if get("dynamic_sampling", "off") != "off":
        raise DnaConfigError(
            "AsyncGRPO rejects dynamic_sampling: samples arrive one group at a time from the rollout queue, so there "
            "is no batch to refill or mask. Set dynamic_sampling: off, or use grpo_execution: sync."
        )
    if get("load_in_4bit") or get("load_in_8bit"):
        raise DnaConfigError(
            "AsyncGRPO does not train quantised (4/8-bit) models: the weights pushed to vLLM must be the trained "
            "full-precision ones. Remove load_in_4bit / load_in_8bit."
        )
    if get("attn_implementation"):
        raise DnaConfigError(
            f"attn_implementation={get('attn_implementation')!r}: AsyncGRPO loads the model with TRL's tree "
            "attention and picks the kernel with tree_attention (fa3 on GPUs with FlashAttention-3, sdpa anywhere). "
            "Remove attn_implementation."
        )
    quantised = _checkpoint_quantisation(get("model_name_or_path"))
    if quantised:
        raise DnaConfigError(
            f"{get('model_name_or_path')} is already quantised ({quantised} in its config.json). AsyncGRPO does not "
            "train quantised (4/8-bit) models: the weights pushed to vLLM must be the trained full-precision ones. "
            "Start from the full-precision checkpoint."
        )
    if get("use_peft"):
        raise DnaConfigError(
            "AsyncGRPO does not train PEFT/LoRA adapters here: the vLLM server must receive full policy weights. "
            "Set use_peft: false, or use grpo_execution: sync for LoRA."
        )
    for entry in get("reward_funcs") or []:
        target = entry.get("reward_model") if isinstance(entry, dict) else entry
        if isinstance(target, str) and (Path(target) / "config.json").is_file():
            raise DnaConfigError(
                f"Reward {target!r} is a model that would run on the trainer's GPU. AsyncGRPO keeps that GPU for "
                "training: serve the reward model behind an OpenAI-compatible server and use {factory: judge}."
            )
        if isinstance(entry, dict) and "reward_model" in entry:
            raise DnaConfigError(
                "A local reward model is not supported by AsyncGRPO. Serve it and use {factory: judge} instead."
            )
        if isinstance(entry, dict) and float(entry.get("weight", 1.0)) != 1.0:
            raise DnaConfigError(
                "AsyncGRPO (TRL 1.16) sums rewards without weights, so reward weights would be ignored. "
                "Remove `weight:` from reward_funcs (or scale inside the reward)."
            )
    if get("reward_weights"):
        raise DnaConfigError("AsyncGRPO (TRL 1.16) ignores reward_weights. Remove the key.")


def server_models(base_url: str, retries: int = SERVER_RETRIES) -> list[dict] | None:
    """The ``data`` list of ``GET /v1/models``, or None when the server does not answer after a few short retries."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    for attempt in range(retries):
        try:
            with urllib.request.urlopen(url, timeout=SERVER_TIMEOUT_S) as response:
                return list(json.loads(response.read())["data"])
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            if attempt + 1 < retries:
                time.sleep(SERVER_RETRY_DELAY_S)
    return None


def validate_completion_length_against_server(cfg: ResolvedConfig) -> int | None:
    """S-ASYNC-3: raise if max_completion_length >= the server's max_model_len; best effort.

    Returns the server's ``max_model_len``, or None when the server did not answer (the check is
    then skipped and TRL's own wait for the server takes over).
    """
    base_url = cfg.get("vllm_server_base_url") or "http://localhost:8000"
    models = server_models(base_url)
    max_model_len = int(models[0]["max_model_len"]) if models else None
    if max_model_len is None:
        logger.warning(
            "Completion-length check skipped: the vLLM server at %s did not answer after %d tries. "
            "The run continues and waits for the server.",
            base_url,
            SERVER_RETRIES,
        )
        return None
    served = [m.get("id") for m in models]
    wanted = str(cfg.get("model_name_or_path"))
    if wanted not in served:
        # TRL's rollout worker asks for the model by its name_or_path; any other name is a 404, retried 30 times.
        raise DnaConfigError(
            f"The vLLM server at {base_url} serves {served} but the recipe trains '{wanted}', which is the name "
            f"the rollout worker requests. Restart vLLM with --served-model-name {wanted} (several names may "
            "follow the flag)."
        )
    completion = int(cfg.get("max_completion_length") or 0)
    if completion >= max_model_len:
        raise DnaConfigError(
            f"max_completion_length={completion} is >= the server's max_model_len={max_model_len} ({base_url}), so "
            "every request would fail with HTTP 400. Lower max_completion_length, or restart vLLM with "
            f"--max-model-len >= longest prompt + {completion}."
        )
    budget = cfg.get("token_budget")
    if budget is not None and 0 < budget < max_model_len:
        logger.warning(
            "token_budget=%d is below the server's max_model_len=%d: a sample longer than the budget is dropped. "
            "Leave token_budget: null to use max_model_len.",
            budget,
            max_model_len,
        )
    logger.info(
        "vLLM max_model_len=%d, max_completion_length=%d: prompts up to %d tokens fit.",
        max_model_len,
        completion,
        max_model_len - completion,
    )
    return max_model_len


MAX_MODEL_LEN = SERVER_MAX_MODEL_LEN
"""The key under which :func:`wait_for_server` leaves the server's ``max_model_len`` in ``cfg.services``: the
prompts' length limit (:mod:`dna_factory.inputs.row_lengths`)."""


def wait_for_server(cfg: ResolvedConfig) -> None:
    """Before data, tokenizer and model load: wait (each up to ``server_wait_s``) for the recipe's servers.

    :func:`dna_factory.serving.services.wait_for_services` waits for the vLLM server (and a judge); then the server
    checks of :func:`validate_completion_length_against_server` run for real: a run never starts generating
    against a server whose ``max_model_len`` it could not read, so the over-long-prompt filter is never skipped.
    """
    wait_for_services(cfg)
    max_model_len = validate_completion_length_against_server(cfg)
    if max_model_len is None:
        root = server_root(cfg.get("vllm_server_base_url") or "http://localhost:8000", "vllm_server_base_url")
        raise DnaServiceError(
            f"The vLLM server at {root} answers /health but not /v1/models; is it a vLLM server?"
        )
    cfg.services[MAX_MODEL_LEN] = max_model_len  # the over-long-prompt filter's limit, read once


def setup_async_training_args(cfg: ResolvedConfig) -> None:
    """Every async check before tokenizer, dataset or model load.

    The server half runs here under ``--dry_run`` only, like :func:`dna_factory.serving.services.probe_services`:
    a real run checks the server once, in :func:`wait_for_server`, after waiting for it.
    """
    validate_async_args(cfg)
    if cfg.get("dry_run") and (max_model_len := validate_completion_length_against_server(cfg)) is not None:
        cfg.services[MAX_MODEL_LEN] = max_model_len  # the dry run measures the prompts against it
