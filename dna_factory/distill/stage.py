"""On-policy distillation (S-OPD) on TRL's DistillationTrainer: ``python distill.py --config RECIPE``.

``distill_mode`` picks where the teacher lives and what it returns (see
:mod:`dna_factory.distill.trainers` for the maths, docs/distillation.md for when to use which):

* ``local_teacher``: ``teacher_model_name_or_path`` is loaded beside the student; the loss is
  TRL's full-vocabulary generalized JSD, ``beta`` 1.0 reverse KL (default), 0.0 forward KL,
  0.5 JSD.
* ``server_teacher``: the teacher behind a vLLM OpenAI-compatible server at
  ``teacher_server_url`` scores the student's sampled tokens; sampled-token reverse KL with
  advantage ``−opd_kl_coef · d_t`` and the importance-sampling loss.

Validators run before any tokenizer or model loads (and under ``--dry_run``): mode and
teacher settings, PEFT (only LoRA; never on ``lm_head``) and, when both tokenizers are
local, tokenizer compatibility. At start-up, before the student loads, the tokenizers are
compared again (a server teacher through its ``/tokenize``) and a server teacher's logprob
position convention is verified.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trl import DistillationConfig

from dna_factory.configuration.config import ResolvedConfig
from dna_factory.distill.teacher_server import TeacherServer
from dna_factory.distill.tokenizer_alignment import (
    check_tokenizers,
    compare_vocabularies,
    load_local_tokenizer,
)
from dna_factory.distill.trainers import LocalTeacherDistillationTrainer, SampledTokenOPDTrainer
from dna_factory.errors import DnaConfigError
from dna_factory.inputs.data_files import looks_local
from dna_factory.inputs.row_lengths import PromptLengthArguments
from dna_factory.serving.services import probe_services, server_root, start_line, wait_for_services
from dna_factory.stages.base import Stage, StageContext

logger = logging.getLogger(__name__)

PROMPT_LEARNING = {"prompttuning": "PromptTuning", "prefixtuning": "PrefixTuning", "ptuning": "P-Tuning"}


@dataclass
class DistillStageArguments(PromptLengthArguments):
    """Keys of the distill stage that TRL's DistillationConfig does not have."""

    distill_mode: Literal["local_teacher", "server_teacher"] = field(
        default="local_teacher",
        metadata={
            "help": "local_teacher: load teacher_model_name_or_path and train TRL's full-vocabulary divergence "
            "selected by beta. server_teacher: a vLLM server at teacher_server_url scores the student's sampled "
            "tokens (sampled-token reverse KL, S-OPD-3). See docs/distillation.md."
        },
    )
    teacher_server_url: str | None = field(
        default=None,
        metadata={
            "help": "server_teacher: the teacher's vLLM OpenAI-compatible server, e.g. http://127.0.0.1:8000."
        },
    )
    teacher_max_concurrent_requests: int = field(
        default=8,
        metadata={"help": "server_teacher: most scoring requests in flight at once while a batch is scored."},
    )
    teacher_sequences_per_request: int = field(
        default=1, metadata={"help": "server_teacher: student rollouts sent in one scoring request."}
    )
    teacher_server_timeout: float = field(
        default=60.0, metadata={"help": "server_teacher: seconds to wait for the teacher server's /health."}
    )
    teacher_request_timeout: float = field(
        default=300.0,
        metadata={
            "help": "server_teacher: seconds one try of a scoring request may take before it is retried "
            "(a stalled teacher fails the run after teacher_retries more tries instead of hanging it)."
        },
    )
    teacher_retries: int = field(
        default=3,
        metadata={
            "help": "server_teacher: tries after the first for a scoring request that timed out, could not "
            "connect or got HTTP 429/500/502/503/504 (with exponential back-off); then one clear error."
        },
    )
    opd_kl_coef: float = field(
        default=1.0,
        metadata={
            "help": "server_teacher: beta of S-OPD-3, the advantage is A_t = -opd_kl_coef * d_t with d_t = "
            "log p_student(y_t) - log p_teacher(y_t). Not the divergence selector `beta`."
        },
    )
    allow_off_policy_sampling: bool = field(
        default=False,
        metadata={
            "help": "server_teacher: run even though the student samples from another distribution than the one it "
            "trains (temperature != 1, top_p < 1, top_k, min_p, penalties, vLLM in another dtype); every d_t is then "
            "biased. A warning names the settings at every start."
        },
    )
    fused_loss: bool = field(
        default=True,
        metadata={
            "help": "Train the fused loss, which forms each token chunk's gradient in the forward pass: one "
            "vocabulary projection per model instead of TRL's two to four, at the memory of one chunk "
            "(dna_factory/distill/fused_loss.py, same values and gradients). false: TRL's chunked kernels. A "
            "sharded lm_head that trains (FSDP2, ZeRO-3) and vision-language inputs always use TRL's."
        },
    )
    peft_type: str = field(
        default="lora",
        metadata={
            "help": "Adapter type used with use_peft: true. Only lora: the loss reads lm_head.weight and calls the "
            "backbone directly, so prompt-learning methods (prompt_tuning, prefix_tuning, p_tuning) never act."
        },
    )


# --------------------------------------------------------------------------- validators


def validate_mode(cfg: ResolvedConfig) -> None:
    mode = cfg.get("distill_mode", "local_teacher")
    teacher = cfg.get("teacher_model_name_or_path")
    url = cfg.get("teacher_server_url")
    if mode == "local_teacher":
        if url:
            raise DnaConfigError(
                f"teacher_server_url is set ({url}) but distill_mode is local_teacher, which loads the teacher "
                "locally. Set distill_mode: server_teacher to use the server, or drop teacher_server_url."
            )
        if not teacher:
            raise DnaConfigError(
                "distill_mode: local_teacher needs teacher_model_name_or_path (a model directory or hub id). "
                "Set it, or use distill_mode: server_teacher with teacher_server_url."
            )
    else:
        if not url:
            raise DnaConfigError(
                "distill_mode: server_teacher needs teacher_server_url, the teacher's vLLM server "
                f"(e.g. http://127.0.0.1:8000). Start one with {start_line('teacher', 'TEACHER', 8000)}, or use "
                "distill_mode: local_teacher."
            )
        server_root(url, "teacher_server_url")
        beta = cfg.get("beta", 1.0)
        if beta != 1.0:
            raise DnaConfigError(
                f"beta is {beta} but distill_mode: server_teacher estimates the reverse KL from sampled tokens only "
                "(beta 1.0): forward KL and JSD need the teacher's full distribution. Use distill_mode: local_teacher "
                "for beta < 1, or set opd_kl_coef to scale the sampled-token signal."
            )
        if cfg.get("opd_kl_coef", 1.0) <= 0:
            raise DnaConfigError("opd_kl_coef must be > 0 (it is the distillation strength). Use e.g. 1.0.")
        for key in ("teacher_max_concurrent_requests", "teacher_sequences_per_request"):
            if cfg.get(key, 1) < 1:
                raise DnaConfigError(
                    f"{key} must be at least 1. Use e.g. 8 for concurrency and 1 per request."
                )
        for key in ("teacher_server_timeout", "teacher_request_timeout"):
            if not cfg.get(key, 1.0) > 0:
                raise DnaConfigError(f"{key} must be > 0 seconds (it bounds a wait). Use e.g. 60 or 300.")
        if cfg.get("teacher_retries", 0) < 0:
            raise DnaConfigError("teacher_retries must be >= 0 (0: fail at the first timeout). Use e.g. 3.")
    if teacher and looks_local(teacher) and not Path(teacher).expanduser().exists():
        hint = " Build it with python scripts/make_tiny_model.py --size teacher --out " + teacher
        raise DnaConfigError(
            f"Teacher path '{teacher}' does not exist.{hint if 'tiny' in teacher else ' Check the path or use a hub id.'}"
        )


NEUTRAL_SAMPLING = {
    "temperature": (1.0,),
    "top_p": (1.0, None),
    "top_k": (0, -1, None),
    "min_p": (0.0, None),
    "repetition_penalty": (1.0, None),
    "presence_penalty": (0.0, None),
    "frequency_penalty": (0.0, None),
}
"""Sampling settings under which the student samples from exactly the distribution it trains."""


HARMLESS_GENERATION_KWARGS = frozenset(
    {"max_new_tokens", "max_tokens", "stop", "stop_token_ids", "eos_token_id", "pad_token_id", "seed",
     "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output", "use_cache"}
)  # fmt: skip
"""generation_kwargs keys that do not change which distribution a token is drawn from (any other key is named)."""


STUDENT_GENERATION_DEFAULTS = {
    "min_p": (None, 0.0),
    "typical_p": (None, 1.0),
    "epsilon_cutoff": (None, 0.0),
    "eta_cutoff": (None, 0.0),
    "no_repeat_ngram_size": (None, 0),
    "min_new_tokens": (None, 0),
    "min_length": (None, 0),
    "bad_words_ids": (None, []),
    "suppress_tokens": (None, []),
    "begin_suppress_tokens": (None, []),
    "sequence_bias": (None, {}),
}
"""Keys of the student's generation_config.json that change the sampled distribution, with their neutral values.

TRL passes ``temperature``, ``top_p``, ``top_k`` and ``repetition_penalty`` to HF generation explicitly, but
leaves these unset (``min_p`` too unless the recipe sets it), and transformers' ``generate`` fills every unset
key from the model's own generation_config.json (transformers' ``_prepare_generation_config``, pinned by
tests/test_distill_alignment.py)."""


def _student_generation_config(cfg: ResolvedConfig) -> dict:
    """The student's generation_config.json as a dict ({} if it has none, or a hub id cannot be read offline)."""
    from transformers.utils import cached_file

    try:
        path = cached_file(
            cfg.get("model_name_or_path"), "generation_config.json", revision=cfg.get("model_revision"),
            _raise_exceptions_for_missing_entries=False, _raise_exceptions_for_connection_errors=False,
        )  # fmt: skip
    except OSError:
        return {}
    return json.loads(Path(path).read_text()) if path else {}


def _generation_config_settings(cfg: ResolvedConfig, kwargs: dict) -> list[str]:
    """HF generation: the student's own defaults that would apply because the recipe leaves them unset."""
    if cfg.get("use_vllm"):  # TRL hands vLLM explicit SamplingParams: the model's defaults do not apply
        return []
    found = []
    for key, value in _student_generation_config(cfg).items():
        neutral = STUDENT_GENERATION_DEFAULTS.get(key)
        set_by_recipe = key in kwargs or (key == "min_p" and cfg.get("min_p") is not None)
        if neutral is not None and not set_by_recipe and value not in neutral:
            found.append(f"{key} {value} (from the student's generation_config.json, which generate applies)")
    return found


def _checkpoint_dtype(cfg: ResolvedConfig) -> str | None:
    """``dtype`` in the student's config.json (local or, online, from the Hub), else None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(
            cfg.get("model_name_or_path"),
            revision=cfg.get("model_revision"),
            trust_remote_code=bool(cfg.get("trust_remote_code", False)),
        )
    except (OSError, ValueError):
        return None  # a hub id offline: checked when the run starts online
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return None if dtype is None else str(dtype).removeprefix("torch.")


def _vllm_auto_dtype(checkpoint: str) -> str:
    """What colocated vLLM (TRL passes no dtype: "auto") samples in on bf16-capable hardware.

    vLLM 0.32 ``_resolve_auto_dtype``: a float32 checkpoint is downcast to the platform's
    preferred dtype (bfloat16 on recent GPUs and x86 CPUs); other dtypes are kept.
    """
    return "bfloat16" if checkpoint == "float32" else checkpoint


def off_policy_settings(cfg: ResolvedConfig) -> list[str]:
    """The settings that make the student sample from another distribution than ``π_θ`` it trains, as ``key value``."""
    found = []
    for key, neutral in NEUTRAL_SAMPLING.items():
        value = cfg.get(key, neutral[0])
        if value not in neutral:
            found.append(f"{key} {value:g}" if isinstance(value, float) else f"{key} {value}")
    kwargs = cfg.get("generation_kwargs") or {}
    if isinstance(kwargs, str):  # TRL parses a JSON string itself
        try:
            kwargs = json.loads(kwargs)
        except json.JSONDecodeError:
            raise DnaConfigError(
                f'generation_kwargs {kwargs!r} is not a JSON object. Use e.g. {{"stop": []}}.'
            ) from None
    for key, value in kwargs.items():
        neutral = NEUTRAL_SAMPLING.get(key) or STUDENT_GENERATION_DEFAULTS.get(key)
        if neutral is not None:
            if value not in neutral:
                found.append(f"generation_kwargs.{key} {value}")
        elif key not in HARMLESS_GENERATION_KWARGS:
            found.append(f"generation_kwargs.{key} {value}")
    found += _generation_config_settings(cfg, kwargs)
    if cfg.get("use_vllm"):
        found.append(_vllm_sampling(cfg))
    return found


def _vllm_sampling(cfg: ResolvedConfig) -> str:
    """Why vLLM sampling is off-policy for the sampled-token loss: TRL discards vLLM's log-probabilities.

    The trainer's forward and vLLM's kernels give slightly different ``π(y_t)`` (more so in another dtype), and
    TRL's DistillationTrainer requests no sampling log-probabilities from vLLM, so the importance ratio
    ``π_θ / π_vLLM`` cannot be corrected: ``r_t`` is 1 by construction.
    """
    gap = "its log-probabilities differ from the trainer's forward and TRL keeps none, so the ratio is not corrected"
    if cfg.get("vllm_mode", "colocate") != "colocate":
        return f"use_vllm (vllm_mode server: the server's sampling dtype cannot be checked from here; {gap})"
    checkpoint = _checkpoint_dtype(cfg)
    trained = str(cfg.get("dtype") or "auto")
    trained = checkpoint if trained == "auto" else trained
    if checkpoint and trained != _vllm_auto_dtype(checkpoint):
        return (
            f"use_vllm (colocated vLLM samples in {_vllm_auto_dtype(checkpoint)}, its automatic dtype for this "
            f"{checkpoint} checkpoint, while the student trains in {trained}; {gap})"
        )
    return f"use_vllm ({gap})"


def validate_sampling(cfg: ResolvedConfig) -> None:
    """Server teacher: sampled-token OPD is unbiased only when the student samples from the distribution it trains."""
    if cfg.get("distill_mode", "local_teacher") != "server_teacher":
        return
    found = off_policy_settings(cfg)
    if not found:
        return
    what = "; ".join(found)
    if cfg.get("allow_off_policy_sampling"):
        logger.warning(
            "Sampling is off-policy (allow_off_policy_sampling: true): %s. d_t = log p_student(y_t) - log "
            "p_teacher(y_t) is estimated from tokens the student does not sample from p_student, so every "
            "advantage is biased.",
            what,
        )
        return
    raise DnaConfigError(
        f"distill_mode: server_teacher estimates KL(student || teacher) from the tokens the student samples, which "
        f"must come from the distribution it trains, but the student samples with {what}. Use temperature 1.0, "
        "top_p 1.0, top_k 0, min_p unset, no penalties, vLLM in the training dtype and neutral values for the "
        'student\'s generation_config.json keys (in generation_kwargs, e.g. {"no_repeat_ngram_size": 0}), or set '
        "allow_off_policy_sampling: true to run anyway (every d_t is then biased)."
    )


def validate_peft(cfg: ResolvedConfig) -> None:
    """S-OPD-5: LoRA only, and never on ``lm_head`` (the loss reads ``lm_head.weight`` directly)."""
    peft_type = str(cfg.get("peft_type", "lora"))
    key = re.sub(r"[^a-z]", "", peft_type.lower())
    if key in PROMPT_LEARNING:
        raise DnaConfigError(
            f"peft_type: {peft_type} ({PROMPT_LEARNING[key]}) is a prompt-learning method, which distillation cannot "
            "train: the loss calls the backbone directly, bypassing PeftModel.forward, so the virtual tokens are "
            "never prepended and the loss would be computed on the wrong sequence. Use peft_type: lora "
            "(use_peft: true, lora_r, lora_target_modules)."
        )
    if key != "lora":
        raise DnaConfigError(
            f"peft_type: {peft_type} is not supported by distill.py. Use peft_type: lora (the only adapter type "
            "the distillation loss is verified with)."
        )
    if not cfg.get("use_peft"):
        return
    # lora_modules_to_save: [lm_head] is fine: PEFT's trainable copy is what lm_head.weight then returns.
    # PEFT's own matcher decides: a regex string, 'all-linear' (which PEFT expands without the output layer),
    # or list items matched as module-name suffixes.
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    targets = cfg.get("lora_target_modules")
    if targets is not None and str(targets).lower() != "all-linear":
        peft = LoraConfig(target_modules=targets, modules_to_save=cfg.get("lora_modules_to_save"))
        matched = check_target_module_exists(peft, "lm_head")
        if matched and matched.__class__.__name__ != "_ExcludedModule":
            raise DnaConfigError(
                f"lora_target_modules {targets!r} puts an adapter on lm_head (as PEFT matches it). The distillation "
                "loss projects hidden states with lm_head.weight directly (chunked over the vocabulary), so an "
                "adapter on the head would never receive a gradient and the run would silently train nothing there. "
                "Exclude lm_head; adapt the attention projections (q_proj, k_proj, v_proj, o_proj) instead."
            )
    parameters = cfg.get("lora_target_parameters") or []
    parameters = [parameters] if isinstance(parameters, str) else parameters
    if any("lm_head" in p.split(".") for p in parameters):
        raise DnaConfigError(
            "lora_target_parameters contains lm_head. The distillation loss projects hidden states with "
            "lm_head.weight directly, so an adapter there would never receive a gradient. Remove lm_head."
        )


def _both_tokenizers_local(cfg: ResolvedConfig) -> bool:
    student, teacher = cfg.get("model_name_or_path"), cfg.get("teacher_model_name_or_path")
    return bool(student and teacher and Path(student).is_dir() and Path(teacher).is_dir())


def validate_tokenizers(cfg: ResolvedConfig) -> None:
    """S-OPD-4 under --dry_run: compare the tokenizers when both are local directories (hub ids: at start-up).

    local_teacher only: a server teacher's tokenizer is the served one, compared through its ``/tokenize`` at
    start-up; a local ``teacher_model_name_or_path`` beside it is not what scores the tokens.
    """
    if cfg.get("distill_mode", "local_teacher") == "local_teacher" and _both_tokenizers_local(cfg):
        _check_local_tokenizers(cfg.get("model_name_or_path"), cfg.get("teacher_model_name_or_path"), cfg)


def _check_local_tokenizers(student: str, teacher: str, cfg: ResolvedConfig, student_tokenizer=None) -> None:
    """Full vocabularies (ids of every token), then the probe encodings (normalisation, pre-tokenisation)."""
    trust = bool(cfg.get("trust_remote_code", False))
    if student_tokenizer is None:
        student_tokenizer = load_local_tokenizer(student, cfg.get("model_revision"), trust)
    teacher_tokenizer = load_local_tokenizer(teacher, cfg.get("teacher_model_revision"), trust)
    compare_vocabularies(student_tokenizer, teacher_tokenizer, teacher)
    check_tokenizers(
        student_tokenizer, lambda text: teacher_tokenizer.encode(text, add_special_tokens=False), teacher
    )


def _vocab_size(path: str, revision: str | None, trust: bool) -> int | None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, revision=revision, trust_remote_code=trust)
    return getattr(config.get_text_config(), "vocab_size", None)


def check_vocab_sizes(cfg: ResolvedConfig) -> None:
    """local_teacher: the two heads must have the same number of rows (read from config.json, no weights)."""
    student, teacher = cfg.get("model_name_or_path"), cfg.get("teacher_model_name_or_path")
    trust = bool(cfg.get("trust_remote_code", False))
    s = _vocab_size(student, cfg.get("model_revision"), trust)
    t = _vocab_size(teacher, cfg.get("teacher_model_revision"), trust)
    if s is not None and t is not None and s != t:
        raise DnaConfigError(
            f"The student has vocab_size {s} ({student}) but the teacher has vocab_size {t} ({teacher}): the same "
            "tokenizer with embeddings padded to another size. distill_mode: local_teacher compares the two full "
            "next-token distributions row by row, so the sizes must match. Use a teacher with the student's "
            "vocab_size, or distill_mode: server_teacher, which scores only the sampled token ids."
        )


def validate_vocab_sizes(cfg: ResolvedConfig) -> None:
    """S-OPD-4 under --dry_run, when both models are local (hub ids: at start-up, before either model loads)."""
    if cfg.get("distill_mode", "local_teacher") == "local_teacher" and _both_tokenizers_local(cfg):
        check_vocab_sizes(cfg)


# --------------------------------------------------------------------------- trainer


def build_trainer(ctx: StageContext):
    """The trainer of ``distill_mode``; alignment is checked here, before the student model loads."""
    stage_args = ctx.config.of(DistillStageArguments)
    args = ctx.training_args
    common = ctx.trainer_kwargs()
    teacher_path = args.teacher_model_name_or_path
    if stage_args.distill_mode == "local_teacher":
        if not _both_tokenizers_local(ctx.config):  # otherwise the validators have compared them already
            _check_local_tokenizers(
                ctx.model_args.model_name_or_path, teacher_path, ctx.config, ctx.tokenizer
            )
            check_vocab_sizes(ctx.config)
        if args.teacher_model_init_kwargs is None:
            # The teacher loads like the student (dtype, attention) unless the recipe says otherwise.
            args.teacher_model_init_kwargs = {
                k: v
                for k, v in (args.model_init_kwargs or {}).items()
                if k in ("dtype", "attn_implementation")
            }
        return LocalTeacherDistillationTrainer(
            teacher_model=teacher_path, fused_loss=stage_args.fused_loss, **common
        )

    teacher = TeacherServer(
        stage_args.teacher_server_url,
        max_concurrent_requests=stage_args.teacher_max_concurrent_requests,
        sequences_per_request=stage_args.teacher_sequences_per_request,
        timeout_s=stage_args.teacher_server_timeout,
        request_timeout_s=stage_args.teacher_request_timeout,
        retries=stage_args.teacher_retries,
    )
    teacher.check_alignment(ctx.tokenizer)  # the served tokenizer (/tokenize) is the one that matters
    return SampledTokenOPDTrainer(
        teacher=teacher, kl_coef=stage_args.opd_kl_coef, fused_loss=stage_args.fused_loss, **common
    )


STAGE = Stage(
    name="distill",
    defaults="distill",
    config_class=DistillationConfig,
    data_format="prompt",
    build_trainer=build_trainer,
    validators=(
        validate_mode,
        validate_sampling,
        validate_peft,
        validate_tokenizers,
        validate_vocab_sizes,
        probe_services,
    ),
    extra_dataclasses=(DistillStageArguments,),
    wait_for_services=wait_for_services,
)
