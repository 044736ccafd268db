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
from dna_factory.runner import prepare

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


def test_off_policy_sampling_runs_when_allowed_and_is_warned(tiny_model, tiny_teacher, caplog):
    with caplog.at_level(logging.WARNING):
        _dry_run(*SERVER, "--top_p", "0.9", "--top_k", "20", "--allow_off_policy_sampling", "true")
    assert "off-policy" in caplog.text and "top_p 0.9" in caplog.text and "top_k 20" in caplog.text


def test_neutral_sampling_settings_pass(tiny_model, tiny_teacher):
    _dry_run(*SERVER, "--top_k", "0", "--top_p", "1.0", "--repetition_penalty", "1.0", "--temperature", "1")
    _dry_run(*SERVER, "--generation_kwargs", '{"max_new_tokens": 16, "stop": []}')
    _dry_run(
        *SERVER, "--use_vllm", "true", "--dtype", "bfloat16"
    )  # what vLLM samples the float32 checkpoint in
