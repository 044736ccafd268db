"""S-DYN-1..7 on the tiny model with TRL's real GRPOTrainer (CPU, HF generation)."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import pytest

from dna_factory.errors import DnaConfigError
from dna_factory.inputs.loading import load_context
from dna_factory.run.runner import prepare
from dna_factory.trl_pin import TRL_VERSION
from tests.conftest import run_cli
from tests.lazy import lazy

dynamic_sampling = lazy("dna_factory.grpo.dynamic_sampling")
torch = lazy("torch")
trl = lazy("trl")


@pytest.fixture(scope="module")
def live_dead(tmp_path_factory):
    """Two one-label datasets from the bundled task: rows labelled `dead` always get reward 1."""
    root = tmp_path_factory.mktemp("dyn")
    rows = [json.loads(line) for line in Path("data/tiny/arith_prompts.jsonl").read_text().splitlines()]
    paths = {}
    for name, chunk in (
        ("live", rows[:32]),
        ("dead", rows[32:64]),
        ("one_live", rows[:1]),
        ("one_dead", rows[1:2]),
    ):
        paths[name] = root / f"{name}.jsonl"
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in chunk))
    return paths


def _argv(live_dead, tmp_path, *extra, live="live", dead="dead"):
    return [
        "--config", "configs/grpo/tiny-cpu.yaml",
        "--datasets", json.dumps([{"path": str(live_dead[live]), "label": "live"}, {"path": str(live_dead[dead]), "label": "dead"}]),
        "--reward_funcs", "[tests.reward_fixtures:group_parity_reward]",
        "--output_dir", str(tmp_path / "out"), "--max_completion_length", "8", "--logging_steps", "1",
        *extra,
    ]  # fmt: skip


def _trainer(argv):
    stage, cfg = prepare("grpo", argv)
    return stage.build_trainer(load_context(stage, cfg))


def test_trl_canary():
    """The private TRL 1.16.0 API dynamic_sampling.py relies on. If this fails, TRL changed shape: re-check the mixin."""
    from trl.trainer import grpo_trainer
    from trl.trainer.utils import RepeatSampler, nanstd

    assert trl.__version__ == TRL_VERSION, f"dynamic_sampling.py was written against TRL {TRL_VERSION}"
    GRPO = trl.GRPOTrainer
    assert list(inspect.signature(GRPO._calculate_rewards).parameters) == [
        "self",
        "inputs",
        "prompts",
        "completions",
        "completion_ids_list",
    ]
    assert list(inspect.signature(GRPO._generate_and_score_completions).parameters) == ["self", "inputs"]
    assert list(inspect.signature(GRPO._prepare_inputs).parameters) == ["self", "generation_batch"]
    prepare_src = inspect.getsource(GRPO._prepare_inputs)
    for fragment in (
        "self._generate_and_score_completions(generation_batch)",
        "shuffle_sequence_dict(",
        "split_tensor_dict(",
    ):
        assert fragment in prepare_src, fragment
    score_src = inspect.getsource(GRPO._generate_and_score_completions)
    for fragment in ("self._calculate_rewards(", '"num_items_in_batch": num_items_in_batch', "process_slice"):
        assert fragment in score_src, fragment
    assert 'inputs["num_items_in_batch"]' in inspect.getsource(GRPO._compute_loss)
    assert {"data_source", "mini_repeat_count", "batch_size", "repeat_count", "shuffle", "seed"} <= set(
        inspect.signature(RepeatSampler).parameters
    )
    spread = nanstd(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, float("nan")]]), dim=1)
    assert spread[0] == 0 and spread[1] > 0  # NaN (None reward) rows are ignored, equal rows give exactly 0
    assert hasattr(grpo_trainer, "shuffle_sequence_dict")


def test_trainer_attributes_exist(live_dead, tmp_path, tiny_model):
    trainer = _trainer(_argv(live_dead, tmp_path, "--dynamic_sampling", "mask"))
    for name in ("_metrics", "_tokenizer", "reward_weights", "num_generations", "beta", "_entropy_bonus_enabled",
                 "aux_loss_enabled", "multi_objective_aggregation", "shuffle_dataset", "_buffered_inputs", "_step"):  # fmt: skip
        assert hasattr(trainer, name), name
    assert isinstance(trainer, dynamic_sampling.DynamicSamplingGRPOTrainer)


def _grads_after_one_step(trainer, seed=0):
    """One optimizer step's accumulated gradients (GA=2 micro-batches), without the optimizer update."""
    from transformers import set_seed

    model = trainer.model
    model.zero_grad()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    batch = next(iter(trainer.get_train_dataloader()))
    set_seed(seed)
    for _ in range(trainer.args.gradient_accumulation_steps):
        trainer.training_step(model, batch, None)
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def test_mask_with_beta_zero_leaves_gradient_identical(live_dead, tmp_path, tiny_model, monkeypatch):
    # Keep TRL's group order so that micro-batch 0 is one prompt's group and micro-batch 1 the other's.
    from trl.trainer import grpo_trainer

    monkeypatch.setattr(grpo_trainer, "shuffle_sequence_dict", lambda batch: batch)
    common = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "2", "--beta", "0"]
    argv = _argv(live_dead, tmp_path, *common, live="one_live", dead="one_dead")
    plain = _trainer([*argv, "--dynamic_sampling", "off"])
    masked = _trainer([*argv, "--dynamic_sampling", "mask"])
    assert type(plain) is trl.GRPOTrainer
    reference = _grads_after_one_step(plain)
    got = _grads_after_one_step(masked)
    assert masked._metrics["train"]["dyn/masked_frac"] == [0.0, 1.0] or masked._metrics["train"][
        "dyn/masked_frac"
    ] == [1.0, 0.0]
    assert any(g.abs().sum() > 0 for g in reference.values()), "the live group must give a gradient"
    assert reference.keys() == got.keys()
    for name in reference:
        assert torch.equal(reference[name], got[name]), name


def test_resample_yields_only_informative_groups(live_dead, tmp_path, tiny_model):
    trainer = _trainer(_argv(live_dead, tmp_path, "--dynamic_sampling", "resample", "--max_steps", "4"))
    trainer.train()
    logs = [h for h in trainer.state.log_history if "dyn/refilled" in h]
    assert len(logs) == 4
    assert all(h["dyn/refilled"] == 1.0 and h["dyn/dead_frac"] == 0.0 for h in logs), logs
    assert sum(h["dyn/rounds"] for h in logs) > 0, (
        "half the prompts are dead: some batch must have been refilled"
    )


def test_resample_falls_back_after_max_rounds(live_dead, tmp_path, tiny_model):
    argv = _argv(
        live_dead,
        tmp_path,
        "--dynamic_sampling",
        "resample",
        "--dynamic_sampling_max_rounds",
        "1",
        "--max_steps",
        "2",
    )
    argv[argv.index("--reward_funcs") + 1] = (
        "[{factory: string_match, extractor: full, answer_column: solution}]"
    )
    trainer = _trainer(argv)  # the untrained model never answers: every group is dead
    trainer.train()
    logs = [h for h in trainer.state.log_history if "dyn/refilled" in h]
    assert logs and all(
        h["dyn/refilled"] == 0.0 and h["dyn/dead_frac"] == 1.0 and h["dyn/rounds"] == 1.0 for h in logs
    )


def test_off_is_bit_reproducible(live_dead, tmp_path, tiny_model):
    outputs = []
    for run in ("a", "b"):
        out = tmp_path / run
        argv = _argv(live_dead, tmp_path, "--max_steps", "2", "--save_strategy", "no")
        argv[argv.index("--output_dir") + 1] = str(out)
        proc = run_cli("grpo.py", *argv)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs.append((out / "model.safetensors").read_bytes())
    assert outputs[0] == outputs[1]


def test_mask_warns_about_beta_and_entropy_and_continues(live_dead, tmp_path, tiny_model, caplog):
    with caplog.at_level(logging.WARNING, logger="dna_factory.grpo.dynamic_sampling"):
        trainer = _trainer(
            _argv(
                live_dead, tmp_path, "--dynamic_sampling", "mask", "--beta", "0.04", "--entropy_coef", "0.01"
            )
        )
    text = caplog.text
    assert "beta=0.04" in text and "entropy bonus" in text
    assert trainer.dynamic_sampling == "mask"


def test_mask_warns_about_router_aux_loss(live_dead, tmp_path, tiny_model, caplog):
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tok = AutoTokenizer.from_pretrained(tiny_model)
    config = Qwen3MoeConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                            num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.01,
                            pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)  # fmt: skip
    moe = tmp_path / "moe"
    Qwen3MoeForCausalLM(config).save_pretrained(moe)
    tok.save_pretrained(moe)
    with caplog.at_level(logging.WARNING, logger="dna_factory.grpo.dynamic_sampling"):
        _trainer(_argv(live_dead, tmp_path, "--dynamic_sampling", "mask", "--model_name_or_path", str(moe)))
    assert "router auxiliary loss" in caplog.text


def test_resample_rejects_streaming_dataset(live_dead, tmp_path, tiny_model):
    stage, cfg = prepare(
        "grpo", _argv(live_dead, tmp_path, "--dynamic_sampling", "resample", "--max_steps", "1")
    )
    ctx = load_context(stage, cfg)
    ctx.train_dataset = ctx.train_dataset.to_iterable_dataset()
    with pytest.raises(DnaConfigError, match="the training dataset is streaming"):
        stage.build_trainer(ctx)


@pytest.mark.parametrize("mode", ["mask", "resample"])
def test_multimodal_rows_fail_on_first_batch(mode, live_dead, tmp_path, tiny_model):
    stage, cfg = prepare("grpo", _argv(live_dead, tmp_path, "--dynamic_sampling", mode, "--max_steps", "1"))
    ctx = load_context(stage, cfg)
    trainer = stage.build_trainer(ctx)
    rows = [dict(ctx.train_dataset[i], images=["fake.png"]) for i in range(8)]
    trainer.model.train()
    with pytest.raises(DnaConfigError, match=r"cannot handle multimodal or token-type inputs \(images\)"):
        trainer._generate_and_score_completions(rows)


@pytest.mark.slow
def test_resample_needs_whole_groups_per_process(live_dead, tmp_path, tiny_model):
    # 2 processes × 2 rows = one group of 4 split across ranks: fine for TRL, not for resample.
    argv = _argv(
        live_dead,
        tmp_path,
        "--dynamic_sampling",
        "resample",
        "--per_device_train_batch_size",
        "2",
        "--gradient_accumulation_steps",
        "1",
        "--dry_run",
    )
    proc = run_cli(
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/ddp-cpu.yaml",
        "grpo.py",
        *argv,
        timeout=300,
    )
    assert proc.returncode != 0
    assert (
        "must be a multiple of num_generations" in proc.stderr
        and "Traceback" not in proc.stderr.split("error:")[0][-200:]
    )


@pytest.mark.parametrize("scale", ["batch", "group"])
def test_resample_with_batch_scaled_rewards_is_refused(scale, live_dead, tmp_path, tiny_model, capsys):
    """#35 item 5: resample scores each generation round on its own, so scale_rewards: batch would divide each
    round by its own standard deviation instead of the optimizer batch's; it is refused (group scaling is
    per group, the same in any round)."""
    from dna_factory.run.runner import main

    argv = _argv(live_dead, tmp_path, "--dynamic_sampling", "resample", "--scale_rewards", scale, "--dry_run")
    code = main("grpo", argv)
    err = capsys.readouterr().err
    if scale == "group":
        assert code == 0, err
        return
    assert code == 2 and err.count("\n") == 1, err
    assert "scale_rewards: batch" in err and "dynamic_sampling: resample" in err and "group" in err, err


def test_none_and_label_routed_rewards_flow_end_to_end(live_dead, tmp_path, tiny_model):
    rewards = json.dumps([
        {"factory": "string_match", "extractor": "last_number", "answer_column": "solution", "only_label": "live"},
        "tests.reward_fixtures:only_live_reward",
    ])  # fmt: skip
    argv = _argv(live_dead, tmp_path, "--dynamic_sampling", "resample", "--max_steps", "2")
    argv[argv.index("--reward_funcs") + 1] = rewards
    trainer = _trainer(argv)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    assert len(logs) == 2
    for h in logs:
        assert h["rewards/only_live_reward/mean"] == pytest.approx(0.5)
        assert (
            h["dyn/dead_frac"] == 0.0
        )  # dead-labelled rows are unscorable (all None): their groups are dead


@pytest.mark.slow
def test_two_process_resample_finishes(live_dead, tmp_path, tiny_model):
    argv = _argv(
        live_dead,
        tmp_path,
        "--dynamic_sampling",
        "resample",
        "--max_steps",
        "2",
        "--per_device_train_batch_size",
        "4",
    )
    proc = run_cli(
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        "configs/accelerate/ddp-cpu.yaml",
        "grpo.py",
        *argv,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads((tmp_path / "out" / "run_summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_step"] == 2


def test_benchmark_runs_and_writes_json(tmp_path, tiny_model):
    out = tmp_path / "dyn.json"
    proc = run_cli("bench/dynamic_sampling.py", "--steps", "2", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == ["off", "mask", "resample"]
    assert data["results"][2]["informative_share"] == 1.0  # the refill always finds live groups here
