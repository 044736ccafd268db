"""The offline tiny models: deterministic, vLLM-compatible shape, TRL's Qwen3 / GLM-4.5 templates verbatim."""

from __future__ import annotations

import hashlib
from pathlib import Path

from make_tiny_model import HEAD_DIM, make_tiny_model

from tests.lazy import lazy

trl = lazy("trl")


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


def test_glm_air_twin_has_the_air_layout_and_trls_template(tiny_glm):
    from transformers import AutoConfig, AutoTokenizer
    from trl.chat_template_utils import get_training_chat_template

    config = AutoConfig.from_pretrained(tiny_glm)
    assert config.model_type == "glm4_moe" and config.architectures == ["Glm4MoeForCausalLM"]
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_shared_experts) == (4, 2, 1)
    assert config.first_k_dense_replace == 1 < config.num_hidden_layers  # a dense layer, then MoE layers
    assert config.head_dim >= HEAD_DIM and not config.tie_word_embeddings
    tokenizer = AutoTokenizer.from_pretrained(tiny_glm)
    template = (Path(trl.__file__).parent / "chat_templates" / "glm4moe.jinja").read_text(encoding="utf-8")
    assert tokenizer.chat_template == template
    assert get_training_chat_template(tokenizer) is not None  # TRL recognises the family by the exact string
    for special in (
        "[gMASK]",
        "<sop>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
        "<arg_key>",
        "<think>",
    ):
        assert len(tokenizer.encode(special, add_special_tokens=False)) == 1, special
    stops = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|user|>", "<|observation|>"])
    assert config.eos_token_id == stops  # GLM-4.5 stops at the next user or tool turn too
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
    )
    assert rendered == "[gMASK]<sop><|user|>\nWhat is 2 + 3?<|assistant|>"


def test_glm_air_twin_trains_with_trls_sft(tiny_glm, tmp_path):
    from tests.conftest import run_cli

    out = tmp_path / "sft"
    proc = run_cli(
        "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--model_name_or_path", str(tiny_glm),
        "--max_steps", "2", "--save_strategy", "no", "--output_dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "config.json").is_file()
