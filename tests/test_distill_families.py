"""Student log-probabilities of server-mode distillation on every logit convention TRL knows.

Sampled-token OPD compares ``log π_student(y_t)`` with the teacher's; the student side is
computed from the hidden states through the LM head in chunks. Model families transform the
head's output differently (Cohere ``logit_scale``, Gemma-2 soft-capping, Granite/MiniCPM3
``logits_scaling`` as a divisor, Falcon-H1 ``lm_head_multiplier``), so each is checked here
against ``log_softmax`` of the model's own full logits, on tiny randomly initialised models
built from a config (offline, < 1 s each).
"""

from __future__ import annotations

import pytest

from tests.lazy import lazy

opd = lazy("dna_factory.distill.trainers")
torch = lazy("torch")
transformers = lazy("transformers")


VOCAB = 96
BASE = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
FAMILIES = {
    "qwen3 (no scaling)": ("Qwen3Config", {}),
    "cohere logit_scale": ("CohereConfig", {"logit_scale": 0.25}),
    "gemma2 soft-capping": ("Gemma2Config", {"final_logit_softcapping": 2.0, "head_dim": 8}),
    "granite logits_scaling": ("GraniteConfig", {"logits_scaling": 8.0}),
    "falcon-h1 lm_head_multiplier": (
        "FalconH1Config",
        {
            "lm_head_multiplier": 3.0,
            "head_dim": 8,
            "mamba_d_ssm": 32,
            "mamba_n_heads": 4,
            "mamba_d_head": 8,
            "mamba_d_state": 8,
            "mamba_n_groups": 1,
            "mamba_chunk_size": 16,
        },
    ),
}


def _tiny(config_class: str, extra: dict):
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(
        **BASE, **extra, pad_token_id=0, eos_token_id=1, bos_token_id=2
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random heads are nearly flat; spread the logits so a wrong scale shows
        model.get_output_embeddings().weight.mul_(20)
    return model.eval()


def _batch():
    g = torch.Generator().manual_seed(1)
    prompt_ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    prompt_mask = torch.ones_like(prompt_ids)
    prompt_mask[1, :2] = 0  # left padding
    prompt_ids = prompt_ids.masked_fill(prompt_mask == 0, 0)
    completion_ids = torch.randint(3, VOCAB, (2, 5), generator=g)
    completion_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    completion_ids = completion_ids.masked_fill(completion_mask == 0, 0)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
    }


@pytest.mark.parametrize("family", list(FAMILIES))
def test_student_logprobs_equal_full_logits_log_softmax(family):
    model = _tiny(*FAMILIES[family])
    inputs = _batch()
    got = opd.completion_logprobs(model, inputs)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    p, c = inputs["prompt_ids"].size(1), inputs["completion_ids"].size(1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, p - 1 : p + c - 1].double()
    expected = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    expected = expected * inputs["completion_mask"]
    assert got.shape == expected.shape
    assert (expected < -0.5).any()  # not a degenerate, near-uniform case
    torch.testing.assert_close(got.double(), expected, atol=1e-4, rtol=1e-4)
