"""Alignment checks of distillation before any model loads: full vocabularies, vocab sizes, LoRA on lm_head.

Teachers here are tokenizer + config.json copies of the tiny teacher with one change each (no
weights: every check must decide from those files alone, under ``--dry_run``).
"""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.run.runner import prepare

RECIPE = "configs/distill/tiny-cpu.yaml"
FILES = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)


def _teacher_copy(tiny_teacher, out, tokenizer_edit=None, config_edit=None):
    out.mkdir()
    for name in FILES:
        shutil.copy(tiny_teacher / name, out / name)
    if tokenizer_edit:
        data = json.loads((out / "tokenizer.json").read_text())
        tokenizer_edit(data)
        (out / "tokenizer.json").write_text(json.dumps(data))
    if config_edit:
        data = json.loads((out / "config.json").read_text())
        config_edit(data)
        (out / "config.json").write_text(json.dumps(data))
    return out


def _swap_two_rare_tokens(data):
    """Swap the ids of the two highest-id BPE tokens: no probe text uses them, the vocabularies differ."""
    vocab = data["model"]["vocab"]
    (a, ia), (b, ib) = sorted(vocab.items(), key=lambda kv: kv[1])[-2:]
    vocab[a], vocab[b] = ib, ia


def _dry_run(*flags):
    return prepare("distill", ["--config", RECIPE, "--dry_run", *flags])


def test_vocabularies_that_differ_outside_the_probes_are_refused(tmp_path, tiny_model, tiny_teacher):
    teacher = _teacher_copy(tiny_teacher, tmp_path / "swapped", tokenizer_edit=_swap_two_rare_tokens)
    with pytest.raises(DnaConfigError, match=r"vocabularies differ: 2 tokens have other ids.*teacher"):
        _dry_run("--teacher_model_name_or_path", str(teacher))


def test_a_padded_teacher_vocab_size_is_refused_from_config_json(tmp_path, tiny_model, tiny_teacher):
    teacher = _teacher_copy(
        tiny_teacher, tmp_path / "padded", config_edit=lambda c: c.update(vocab_size=1088)
    )
    with pytest.raises(DnaConfigError, match=r"vocab_size 1024 .* teacher .* vocab_size 1088"):
        _dry_run("--teacher_model_name_or_path", str(teacher))


def test_the_same_tokenizer_and_vocab_size_pass(tmp_path, tiny_model, tiny_teacher):
    teacher = _teacher_copy(tiny_teacher, tmp_path / "same")
    _dry_run("--teacher_model_name_or_path", str(teacher))


@pytest.mark.parametrize("targets", [".*", ".*_proj|lm_head", "lm_head"])
def test_lora_targets_that_peft_would_put_on_lm_head_are_refused(targets, tiny_model, tiny_teacher):
    with pytest.raises(DnaConfigError, match="puts an adapter on lm_head"):
        _dry_run("--use_peft", "true", "--lora_target_modules", targets, "--lora_modules_to_save", "[]")


def test_a_regex_with_lm_head_in_modules_to_save_is_allowed_as_peft_excludes_it(tiny_model, tiny_teacher):
    _dry_run(
        "--use_peft", "true", "--lora_target_modules", ".*_proj|lm_head", "--lora_modules_to_save", "lm_head"
    )


def test_all_linear_reaches_peft_as_its_shorthand_and_passes_the_guard(tiny_model, tiny_teacher):
    """PEFT expands the string 'all-linear' (and excludes the output layer); a list ['all-linear'] matches nothing."""
    from trl import ModelConfig, get_peft_config

    _, cfg = _dry_run("--use_peft", "true", "--lora_target_modules", "all-linear")
    assert cfg.get("lora_target_modules") == "all-linear"
    model_args = cfg.of(ModelConfig)
    assert get_peft_config(model_args).target_modules == "all-linear"


# --------------------------------------------------------------------------- off-policy sampling (server teacher)

SERVER = ["--distill_mode", "server_teacher", "--teacher_server_url", "http://127.0.0.1:9"]
OFF_POLICY = [
    (["--temperature", "0.7"], "temperature 0.7"),
    (["--top_p", "0.9"], "top_p 0.9"),
    (["--top_k", "20"], "top_k 20"),
    (["--min_p", "0.05"], "min_p 0.05"),
    (["--repetition_penalty", "1.1"], "repetition_penalty 1.1"),
    (["--generation_kwargs", '{"presence_penalty": 0.5}'], "generation_kwargs.presence_penalty 0.5"),
    (["--generation_kwargs", '{"do_sample": false}'], "generation_kwargs.do_sample False"),
    (["--use_vllm", "true"], "vLLM samples in bfloat16, its automatic dtype for this float32 checkpoint"),
]


@pytest.mark.parametrize(("flags", "named"), OFF_POLICY, ids=[n for _, n in OFF_POLICY])
def test_off_policy_sampling_is_refused_naming_the_setting(flags, named, tiny_model, tiny_teacher):
    with pytest.raises(DnaConfigError, match=rf"{re.escape(named)}.*allow_off_policy_sampling: true"):
        _dry_run(*SERVER, *flags)


def _student_with_generation_defaults(tiny_model, out, **defaults):
    shutil.copytree(tiny_model, out)
    data = json.loads((out / "generation_config.json").read_text())
    (out / "generation_config.json").write_text(json.dumps(data | defaults))
    return out


def test_the_students_own_generation_defaults_are_named_as_off_policy(tmp_path, tiny_model, tiny_teacher):
    """HF generation fills what TRL leaves unset from the student's generation_config.json (min_p, typical_p...)."""
    student = _student_with_generation_defaults(
        tiny_model, tmp_path / "student", min_p=0.05, typical_p=0.9, no_repeat_ngram_size=3, top_k=20
    )
    with pytest.raises(DnaConfigError) as err:
        _dry_run(*SERVER, "--model_name_or_path", str(student))
    message = str(err.value)
    for named in ("min_p 0.05", "typical_p 0.9", "no_repeat_ngram_size 3"):
        assert f"{named} (from the student's generation_config.json" in message
    assert "top_k 20" not in message  # TRL passes top_k (0) explicitly: the model's 20 never applies
    # Neutral values in the recipe override the student's defaults; vLLM sampling never reads them.
    _dry_run(*SERVER, "--model_name_or_path", str(student), "--min_p", "0.0", "--generation_kwargs",
             '{"typical_p": 1.0, "no_repeat_ngram_size": 0}')  # fmt: skip
    with pytest.raises(DnaConfigError) as err:
        _dry_run(*SERVER, "--model_name_or_path", str(student), "--use_vllm", "true", "--dtype", "bfloat16")
    assert "use_vllm" in str(err.value) and "(from the student's generation_config.json" not in str(err.value)


def test_vllm_sampling_is_named_as_off_policy_as_its_ratio_is_not_corrected(tiny_model, tiny_teacher):
    """TRL keeps none of vLLM's sampling log-probabilities, so r_t = pi_theta / pi_vLLM cannot be formed."""
    with pytest.raises(
        DnaConfigError, match=r"use_vllm \(its log-probabilities differ .* ratio is not corrected\)"
    ):
        _dry_run(*SERVER, "--use_vllm", "true", "--dtype", "bfloat16")
    with pytest.raises(
        DnaConfigError, match=r"vllm_mode server: the server's sampling dtype cannot be checked"
    ):
        _dry_run(*SERVER, "--use_vllm", "true", "--vllm_mode", "server")
    _dry_run("--use_vllm", "true")  # local_teacher: the divergence is exact on whatever states are visited


def test_a_server_teacher_is_not_compared_with_an_unused_local_teacher(tmp_path, tiny_model, tiny_teacher):
    """Server mode scores with the served tokenizer (checked through /tokenize at start-up), not a local path."""
    other = _teacher_copy(tiny_teacher, tmp_path / "other", tokenizer_edit=_swap_two_rare_tokens)
    with pytest.raises(DnaConfigError):
        _dry_run("--teacher_model_name_or_path", str(other))
    _dry_run(*SERVER, "--teacher_model_name_or_path", str(other))


def test_canary_generate_fills_unset_sampling_keys_from_the_models_generation_config(tmp_path, tiny_model):
    """What the check above relies on (transformers' _prepare_generation_config): None keys take the model's values."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    student = _student_with_generation_defaults(
        tiny_model, tmp_path / "student", min_p=0.05, no_repeat_ngram_size=3
    )
    model = AutoModelForCausalLM.from_pretrained(student)
    trl_like = GenerationConfig(
        do_sample=True, temperature=1.0, top_p=1.0, top_k=0, min_p=None, max_new_tokens=4
    )
    prepared, _ = model._prepare_generation_config(trl_like)
    assert (prepared.min_p, prepared.no_repeat_ngram_size, prepared.top_k) == (0.05, 3, 0)


def test_off_policy_sampling_runs_when_allowed_and_is_warned(tiny_model, tiny_teacher, caplog):
    with caplog.at_level(logging.WARNING):
        _dry_run(*SERVER, "--top_p", "0.9", "--top_k", "20", "--allow_off_policy_sampling", "true")
    assert "off-policy" in caplog.text and "top_p 0.9" in caplog.text and "top_k 20" in caplog.text


def test_neutral_sampling_settings_pass(tiny_model, tiny_teacher):
    _dry_run(*SERVER, "--top_k", "0", "--top_p", "1.0", "--repetition_penalty", "1.0", "--temperature", "1")
    _dry_run(*SERVER, "--generation_kwargs", '{"max_new_tokens": 16, "stop": []}')
