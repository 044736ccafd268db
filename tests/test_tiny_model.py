"""The offline tiny model: deterministic, vLLM-compatible shape, TRL's Qwen3 template verbatim."""

from __future__ import annotations

import hashlib
from pathlib import Path

import trl
from make_tiny_model import HEAD_DIM, make_tiny_model


def _digest(path: Path) -> str:
    return hashlib.sha256(
        (path / "model.safetensors").read_bytes() + (path / "tokenizer.json").read_bytes()
    ).hexdigest()


def test_deterministic_for_a_seed(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=3)
    b = make_tiny_model(tmp_path / "b", seed=3)
    c = make_tiny_model(tmp_path / "c", seed=4)
    assert _digest(a) == _digest(b) != _digest(c)


def test_shape_and_template(tiny_model, tiny_teacher):
    from transformers import AutoConfig, AutoTokenizer

    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    for path in (tiny_model, tiny_teacher):
        config = AutoConfig.from_pretrained(path)
        assert config.model_type == "qwen3" and config.head_dim >= HEAD_DIM
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert tokenizer.chat_template == template
        assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<|endoftext|>"
        for special in ("<|im_start|>", "<think>", "</think>", "<tool_call>"):
            assert len(tokenizer.encode(special, add_special_tokens=False)) == 1, special
    student = AutoTokenizer.from_pretrained(tiny_model)
    teacher = AutoTokenizer.from_pretrained(tiny_teacher)
    text = "Привет, 你好! def f(x): return 12 + 30"
    assert student.encode(text) == teacher.encode(text)  # same vocabulary: distillation-compatible
    rendered = student.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered.endswith("<|im_start|>assistant\n")
